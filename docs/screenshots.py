"""Take the README's screenshots (docs/images/*.png) of one pipeline run, in headless Chromium
(the Debian packages chromium and chromium-driver; the helper of tests/infra/browser.py).

Against standing servers, after a run that learns:

    infra/start-servers.sh && source .grpo-servers/env.sh
    grpo run --set run_name=demo ...
    python docs/screenshots.py --run-name demo

The run, its stage runs, flow runs and artifacts are looked up through the MLflow and Prefect
APIs (MLFLOW_TRACKING_URI, PREFECT_API_URL, or --tracking-uri / --prefect-api); the pages are
the ones the CLI and the Prefect artifacts link to. Each PNG is written under a temporary
name and renamed, so an interrupted run leaves the previous image, never half of one.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "infra"))
from browser import chromium, missing_browser  # noqa: E402

# name -> what it shows (the order they are taken in)
SHOTS = {
    "prefect-flow-run": "Prefect: the pipeline's flow run, its graph of stages",
    "prefect-artifacts": "Prefect: the flow run's Artifacts tab",
    "prefect-stage-artifact": "Prefect: the RL stage's summary artifact",
    "prefect-pipeline-summary": "Prefect: the pipeline's summary artifact",
    "mlflow-runs": "MLflow: the experiment's runs table, the pipeline's row expanded",
    "mlflow-parent-run": "MLflow: the pipeline's parent run, Overview (description)",
    "mlflow-parent-charts": "MLflow: the parent run's Model metrics (one step per stage)",
    "mlflow-rl-metrics": "MLflow: the RL stage run's Model metrics (eval, train, details)",
    "mlflow-completions": "MLflow: the RL stage's completions table (last iteration)",
}
# MLflow's assistant panel opens on a browser's first visit and covers a third of the page
MLFLOW_STORAGE = {
    "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": "true",
    "mlflow.assistant.panelOpen_v1": "false",
}
CHART_CARD = "[data-testid=experiment-view-compare-runs-card] h4"


def find_run(run_name: str, tracking_uri: str, api: str, rl_stage: str, experiment: str | None):
    """Everything the screenshots need about pipeline ``run_name``: ids and page URLs."""
    from mlflow.tracking import MlflowClient

    from tasks.tracking.stages import experiment_url, run_url

    client = MlflowClient(tracking_uri)
    if experiment:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            sys.exit(f"no MLflow experiment {experiment!r} at {tracking_uri}")
        exp_ids = [exp.experiment_id]
    else:
        exp_ids = [e.experiment_id for e in client.search_experiments()]
    parents = [
        r
        for r in client.search_runs(
            exp_ids,
            f"attributes.run_name = '{run_name}' and tags.pipeline = 'r1'",
            order_by=["attributes.start_time DESC"],
        )
        if "mlflow.parentRunId" not in r.data.tags
    ]
    if not parents:
        sys.exit(f"no pipeline run named {run_name!r} at {tracking_uri} (grpo run first)")
    parent = parents[0]
    exp_id, pid = parent.info.experiment_id, parent.info.run_id
    stages = client.search_runs([exp_id], f"tags.`mlflow.parentRunId` = '{pid}'")
    rl = next((r for r in stages if r.data.tags.get("stage") == rl_stage), None)
    if rl is None:
        sys.exit(f"pipeline run {run_name!r} has no {rl_stage} stage run")
    tables = sorted(
        a.path for a in client.list_artifacts(rl.info.run_id, "samples") if a.path.endswith(".json")
    )
    return {
        "run_name": run_name,
        "rl_run_name": rl.info.run_name,
        **_prefect_pages(api, run_name, rl_stage),
        "mlflow": tracking_uri.rstrip("/"),
        "experiment": experiment_url(tracking_uri, exp_id),
        "parent": run_url(tracking_uri, exp_id, pid),
        "parent_charts": run_url(tracking_uri, exp_id, pid, "model-metrics"),
        "rl_charts": run_url(tracking_uri, exp_id, rl.info.run_id, "model-metrics"),
        "completions": tables
        and run_url(tracking_uri, exp_id, rl.info.run_id, f"artifacts/{tables[-1]}"),
        "completions_path": tables[-1] if tables else None,
    }


def _prefect_pages(api: str, run_name: str, rl_stage: str) -> dict:
    """The Prefect UI's pages of pipeline ``run_name``: its flow run, and the latest summary
    artifacts of the pipeline and of ``rl_stage``."""
    import httpx

    with httpx.Client(base_url=api, timeout=30) as http:
        flow = http.get("/flows/name/r1-pipeline")
        flow.raise_for_status()
        tops = http.post(
            "/flow_runs/filter",
            json={
                "flow_runs": {"name": {"any_": [run_name]}},
                "flows": {"id": {"any_": [flow.json()["id"]]}},
                "sort": "START_TIME_DESC",
                "limit": 1,
            },
        ).json()
        if not tops:
            sys.exit(f"no Prefect flow run named {run_name!r} at {api}")
        top = tops[0]["id"]
        subs = http.post(
            "/flow_runs/filter", json={"flow_runs": {"parent_flow_run_id": {"any_": [top]}}}
        ).json()
        arts = http.post(
            "/artifacts/filter",
            json={
                "artifacts": {"flow_run_id": {"any_": [top, *(s["id"] for s in subs)]}},
                "sort": "CREATED_DESC",
                "limit": 200,
            },
        ).json()
    artifact = {}
    for a in arts:  # newest first: the first of each key is its latest
        if a.get("key"):
            artifact.setdefault(a["key"], a["id"])
    ui = api.rstrip("/").removesuffix("/api")
    stage_key = f"{rl_stage.replace('_', '-')}-summary"
    summary_key = next(
        (k for k in ("pipeline-summary", "r1-pipeline-summary") if k in artifact), ""
    )
    return {
        "prefect_ui": ui,
        "flow_run": f"{ui}/runs/flow-run/{top}",
        "stage_artifact": artifact.get(stage_key)
        and f"{ui}/artifacts/artifact/{artifact[stage_key]}",
        "pipeline_artifact": summary_key and f"{ui}/artifacts/artifact/{artifact[summary_key]}",
    }


def _settle(b, seconds: float = 1.5) -> None:
    """Let charts, graphs and tables finish drawing (their animations change no text)."""
    b.wait_quiet(timeout=20, quiet=1.0)
    b.js("document.activeElement && document.activeElement.blur()")  # no focus outline
    time.sleep(seconds)


def take(b, name: str, run: dict) -> str | None:
    """Open and prepare the page of shot ``name``; None when ready, else why it is skipped."""
    rn = run["run_name"]
    if name == "prefect-flow-run":
        b.open(run["flow_run"])
        b.wait_text(rn, "Completed", timeout=60)
        b.wait_css("canvas", timeout=60)  # the flow run graph
        _settle(b, 3)
    elif name == "prefect-artifacts":
        b.open(run["flow_run"])
        b.wait_text(rn, "Artifacts", timeout=60)
        b.click("[role=tab], .p-tab", "Artifacts")
        b.wait_text("summary", timeout=60)
        _settle(b)
    elif name == "prefect-stage-artifact":
        return _open_if_any(b, run["stage_artifact"], "no stage summary artifact", "MLflow run:")
    elif name == "prefect-pipeline-summary":
        why = "no pipeline summary artifact"
        return _open_if_any(b, run["pipeline_artifact"], why, rn, "MLflow parent run")
    elif name == "mlflow-runs":
        b.open(run["experiment"])
        b.wait_text("Run Name", rn, timeout=60)
        b.wait_quiet(quiet=1)
        expand = b.find('[role=gridcell][col-id="attributes.`Run Name`"] button')
        if expand:
            expand[0].click()
            b.wait_text(run["rl_run_name"], timeout=30)
        _settle(b)
    elif name == "mlflow-parent-run":
        b.open(run["parent"])
        b.wait_text(rn, "Description", timeout=60)
        b.wait_quiet(quiet=1)
        more = [e for e in b.find("button, a") if e.text.strip() == "Show more"]
        if more:  # the whole description: the pipeline's table and what it ran
            more[0].click()
        _settle(b)
    elif name in ("mlflow-parent-charts", "mlflow-rl-metrics"):
        b.open(run["parent_charts" if name == "mlflow-parent-charts" else "rl_charts"])
        b.wait_css(CHART_CARD, timeout=60)
        _settle(b, 2)
    elif name == "mlflow-completions":
        why = "the RL stage run has no samples/*.json table"
        return _open_if_any(b, run["completions"], why, run["completions_path"], "completion")
    return None


def _open_if_any(b, url: str | None, missing: str, *texts: str) -> str | None:
    """Open a page the run may not have (``missing``: why the shot is skipped then) and wait
    for ``texts`` on it."""
    if not url:
        return missing
    b.open(url)
    b.wait_text(*texts, timeout=60)
    _settle(b)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--run-name", required=True, help="the pipeline run (its run_name)")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "images", help="[docs/images]")
    p.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI"))
    p.add_argument("--prefect-api", default=os.environ.get("PREFECT_API_URL"))
    p.add_argument("--experiment", help="MLflow experiment [every experiment, newest run]")
    p.add_argument("--rl-stage", default="rl_1", help="the RL stage shown [rl_1]")
    p.add_argument("--only", nargs="+", choices=list(SHOTS), help="these shots only")
    p.add_argument("--size", default="1600x1000", help="page size in pixels [1600x1000]")
    args = p.parse_args(argv)
    if not (args.tracking_uri or "").startswith(("http://", "https://")) or not args.prefect_api:
        p.error(
            "needs an MLflow server and a Prefect server: source .grpo-servers/env.sh "
            "(infra/start-servers.sh), or --tracking-uri and --prefect-api"
        )
    if why := missing_browser():
        p.error(why)
    width, height = (int(v) for v in args.size.lower().split("x"))
    run = find_run(
        args.run_name, args.tracking_uri, args.prefect_api, args.rl_stage, args.experiment
    )
    failed = 0
    with chromium(window=(width, height)) as b:
        b.open(f"{run['mlflow']}/health")  # MLflow's origin: its remembered UI state
        for k, v in MLFLOW_STORAGE.items():
            b.js("localStorage.setItem(arguments[0], arguments[1])", k, v)
        for name in args.only or SHOTS:
            try:
                skipped = take(b, name, run)
            except TimeoutError as e:
                failed += 1
                print(f"{name}: FAILED, {e}", file=sys.stderr)
                b.screenshot(args.out / f".{name}.failed.png")
                continue
            if skipped:
                print(f"{name}: skipped ({skipped})")
                continue
            path = b.screenshot(args.out / f"{name}.png")
            print(f"{name}: {path}  ({SHOTS[name]}; {b.url})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

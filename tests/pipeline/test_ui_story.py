"""What a user sees in the Prefect and MLflow UIs after `grpo run`, checked through the APIs
of real `prefect server` and `mlflow server` processes (issue: "The Prefect UI and the
MLflow UI tell the whole R1 story"): links, escaped markdown, where runs go, one flow
history, the experiment kind, run names, the parent run's charts, tables, tags, artifacts
and the pipeline graph."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import httpx
import pytest
from test_real_servers import servers  # noqa: F401  (the fixture: both servers on localhost)
from tests_support import TINY_OVERRIDES

from flows.config import CHECKPOINT_STAGES, load_config

BOOKKEEPING = {"cached", "iteration", "global_step", "cached_iterations"}
# file hand-overs between the pipeline's tasks and subflows (Prefect's graph edges)
EDGES = {
    ("prepare", "cold_start_sft"),
    ("prepare", "rl_1"),
    ("prepare", "rejection_sampling"),
    ("prepare", "rl_2"),
    ("cold_start_sft", "rl_1"),
    ("rl_1", "rejection_sampling"),
    ("rl_1", "re_sft"),
    ("rejection_sampling", "re_sft"),
    ("re_sft", "rl_2"),
    *(("prepare", f"final_evaluation/{s}") for s in CHECKPOINT_STAGES),
    *((s, f"final_evaluation/{s}") for s in CHECKPOINT_STAGES),
    # an SFT checkpoint's final eval is the next RL stage's start eval (the same table)
    ("rl_1", "final_evaluation/cold_start_sft"),
    ("rl_2", "final_evaluation/re_sft"),
}


def test_tracking_uri_resolution_order(tmp_path, monkeypatch):
    """--set tracking.uri > the user's config file > MLFLOW_TRACKING_URI > the default (the
    packaged presets' value counts as the default)."""
    own = tmp_path / "own.yaml"
    own.write_text("tracking: {uri: 'sqlite:///own.db'}\n")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = load_config(None, [])
    assert (cfg.tracking.uri, cfg.tracking.uri_source) == ("sqlite:///mlflow.db", "default")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:1")
    cfg = load_config(None, [])
    assert (cfg.tracking.uri, cfg.tracking.uri_source) == (
        "http://127.0.0.1:1",
        "MLFLOW_TRACKING_URI",
    )
    assert load_config(own, []).tracking.uri == "sqlite:///own.db"
    cfg = load_config(own, ["tracking.uri=sqlite:///set.db"])
    assert (cfg.tracking.uri, cfg.tracking.uri_source) == ("sqlite:///set.db", "--set tracking.uri")


def test_a_run_leaves_the_next_runs_default_alone(tmp_path, monkeypatch):
    """One process, two runs (a ``grpo serve`` worker, a notebook): the first run's
    ``--set tracking.uri`` must not become the second run's choice. ``mlflow.set_tracking_uri``
    writes MLFLOW_TRACKING_URI; opening the store keeps the variable as the user set it."""
    from tasks.tracking.stages import Tracking

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    first = load_config(None, [f"tracking.uri=sqlite:///{tmp_path / 'first.db'}"])
    Tracking.open(first.tracking.uri, "first")
    assert "MLFLOW_TRACKING_URI" not in os.environ
    cfg = load_config(None, [])
    assert (cfg.tracking.uri, cfg.tracking.uri_source) == ("sqlite:///mlflow.db", "default")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:1")
    Tracking.open(f"sqlite:///{tmp_path / 'second.db'}", "second")
    assert os.environ["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:1"


def test_a_continued_parent_run_shows_no_stale_duration(tmp_path):
    """A resumed pipeline continues its killed parent run: RUNNING again with no end time, as
    a new run (the UI's duration is end - start: the killed attempt's end made it stale)."""
    from tasks.tracking.stages import Tracking

    store = Tracking.open(f"sqlite:///{tmp_path / 'mlflow.db'}", "resume")
    first = store.start_parent("r", {}, params={"a": 1}, workspace=tmp_path / "ws")
    first.end(first.parent_run_id, "KILLED")
    assert first.client.get_run(first.parent_run_id).info.end_time
    again = store.start_parent("r", {}, params={"a": 1}, workspace=tmp_path / "ws")
    info = again.client.get_run(again.parent_run_id).info
    assert again.parent_run_id == first.parent_run_id
    assert info.status == "RUNNING" and not info.end_time
    again.end(again.parent_run_id)
    assert again.client.get_run(again.parent_run_id).info.end_time > info.start_time


def test_mlflow_urls_open_model_training_mode():
    from tasks.tracking.stages import experiment_url, run_url

    assert experiment_url("sqlite:///m.db", "1") is None
    assert (
        experiment_url("http://h:5000/", "3")
        == "http://h:5000/#/experiments/3/runs?workflowType=machine_learning"
    )
    assert (
        run_url("http://h:5000", "3", "ab", "model-metrics")
        == "http://h:5000/#/experiments/3/runs/ab/model-metrics?workflowType=machine_learning"
    )


def test_markdown_cells_and_closing_hint():
    from flows.summary import md_cell, mlflow_hint

    cell = md_cell("<|user|>12+3=?<|assistant|> a|b\nc")
    assert re.search(r"(?<!\\)\|", cell) is None and "\n" not in cell and "<" not in cell
    assert mlflow_hint("http://127.0.0.1:5000/") == "open http://127.0.0.1:5000"
    assert mlflow_hint("http://h:5000", "http://h:5000/#/x?y") == "open http://h:5000/#/x?y"
    hint = mlflow_hint("sqlite:///mlflow.db")
    assert hint.startswith("mlflow ui --backend-store-uri sqlite:////")


def _grpo_run(servers, tmp_path, run_name: str, *extra: str) -> str:  # noqa: F811
    env = {
        **servers["env"],
        "PREFECT_API_URL": servers["prefect"],
        "MLFLOW_TRACKING_URI": servers["mlflow"],  # as `source env.sh` sets it: no --set
        "GRPO_SYSTEM_METRICS_INTERVAL": "1",
    }
    sets = [*TINY_OVERRIDES, f"output_dir={tmp_path / 'runs'}", f"run_name={run_name}", *extra]
    cmd = [sys.executable, "-m", "flows.cli", "run", *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.slow
def test_ui_story(servers, tmp_path):  # noqa: F811
    out = _grpo_run(servers, tmp_path, "lr-3e-4", "rl.learning_rate=3e-4")
    # 3. the environment's tracking server, said so; the hint for a server is its URL
    assert f"runs go to {servers['mlflow']} (MLFLOW_TRACKING_URI)" in out
    ui = f"{servers['mlflow']}/#/experiments/"
    assert (
        f"MLflow UI: {ui}" in out and f"open {ui}" in out and "--backend-store-uri http" not in out
    )
    assert "View run" not in out  # MLflow's own links (GenAI mode) are not printed
    assert not (tmp_path / "mlflow.db").exists()
    check_story(servers["prefect"], servers["mlflow"], "lr-3e-4")


def _artifacts(api: str, flow_run_ids: list[str]) -> dict[str, dict]:
    found = httpx.post(
        f"{api}/artifacts/filter",
        json={"artifacts": {"flow_run_id": {"any_": flow_run_ids}}, "limit": 200},
    ).json()
    return {a["key"]: a for a in found if a.get("key")}


def check_story(api: str, mlflow_uri: str, run_name: str) -> None:
    """Every numbered item, through the Prefect and MLflow APIs, for pipeline ``run_name``."""
    from mlflow.tracking import MlflowClient

    from flows.deployments import R1_DEPLOYMENT, r1_from_config

    client = MlflowClient(mlflow_uri)
    # 5. the experiment opens on the runs table
    exp = client.get_experiment_by_name("grpo-demo")
    assert exp.tags.get("mlflow.experimentKind") == "custom_model_development"
    runs = client.search_runs([exp.experiment_id], max_results=500)
    parent = next(
        r for r in runs if r.info.run_name == run_name and "mlflow.parentRunId" not in r.data.tags
    )
    pid = parent.info.run_id
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == pid]
    by_stage = {r.data.tags["stage"]: r for r in children}
    # 6. run names say which pipeline they belong to
    assert {r.info.run_name for r in children} == {f"{s} ({run_name})" for s in by_stage}
    groups = [
        r for r in runs if r.data.tags.get("mlflow.parentRunId") == by_stage["rl_1"].info.run_id
    ]
    assert groups and all(
        re.fullmatch(rf"rl_1 it \d+-\d+ \({run_name}\)", g.info.run_name) for g in groups
    )
    # 7. stage progression on the parent: one step per evaluated stage; plot; description
    for m in ("accuracy", "format_rate", "mean_length"):
        steps = [h.step for h in client.get_metric_history(pid, f"eval/{m}")]
        assert sorted(steps) == list(range(len(CHECKPOINT_STAGES))), (m, steps)
    parent_files = {a.path for a in client.list_artifacts(pid, "compare")}
    assert "compare/grpo-compare.png" in parent_files
    note = parent.data.tags["mlflow.note.content"]
    assert note.startswith("| stage | held-out accuracy |") and "| rl_2 |" in note
    assert "R1 recipe" in note and "model:" in note and "data:" in note
    assert f"get-artifact?path=compare%2Fgrpo-compare.png&run_uuid={pid}" in note
    # 8. tables the UI renders (and the Parquet kept)
    rl1 = by_stage["rl_1"].info.run_id
    files = {a.path for a in client.list_artifacts(rl1, "samples")}
    files |= {a.path for a in client.list_artifacts(rl1, "eval_samples")}
    files |= {a.path for a in client.list_artifacts(rl1, "eval")}
    assert {"samples/iter_0000.json", "eval_samples/step_0000.json", "eval/samples.json"} <= files
    assert any(f.endswith(".parquet") for f in files)
    import mlflow

    mlflow.set_tracking_uri(mlflow_uri)  # load_table searches with the global URI
    # 10. `grpo compare` shows the wall times the run's summary shows
    from flows.compare import load_pipeline_run

    shown = mlflow.artifacts.load_dict(f"runs:/{pid}/summary.json")
    compared = {s.stage: s.wall_time_s for s in load_pipeline_run(client, parent).stages}
    assert compared == {r["stage"]: pytest.approx(r["wall_time_s"]) for r in shown["stages"]}
    table = client.load_table(exp.experiment_id, "samples/iter_0000.json", run_ids=[rl1])
    assert list(table.columns[:3]) == ["reward", "advantage", "answer"] and len(table)
    assert {"completion", "model_answer"} <= set(table.columns)
    ev_run = by_stage["final_evaluation"].info.run_id
    assert {f"eval_tables/{s}.json" for s in CHECKPOINT_STAGES} <= {
        a.path for a in client.list_artifacts(ev_run, "eval_tables")
    }
    # 9. bookkeeping values are tags, not metrics; iteration groups have curves
    for r in [parent, *children, *groups]:
        assert not BOOKKEEPING & set(r.data.metrics), r.info.run_name
    assert by_stage["rl_1"].data.tags["global_step"] == "4"
    assert by_stage["rl_1"].data.tags["cached"] in ("true", "false")
    g0 = min(groups, key=lambda g: g.info.run_name)
    by_step = client.get_metric_history(g0.info.run_id, "train/by_step/loss")
    assert [h.step for h in by_step] == [1, 2]
    # the stage's curves: one point per iteration, the eval from step 0
    rl1_evals = client.get_metric_history(rl1, "eval/accuracy")
    assert sorted(h.step for h in rl1_evals) == [0, 1, 2]
    # 10. standard source tags; system metrics on the training stages
    for r in [parent, *children]:
        assert r.data.tags["mlflow.source.name"] == "grpo-pipeline"
        assert re.fullmatch(r"[0-9a-f]{40}", r.data.tags.get("mlflow.source.git.commit", ""))
        assert "git_commit" not in r.data.tags
    for s in CHECKPOINT_STAGES:
        assert any(k.startswith("system/") for k in by_stage[s].data.metrics), s

    # 4. one flow, one history: the CLI's flow run and the deployment are the same flow
    with httpx.Client(base_url=api) as http:
        flow = http.get("/flows/name/r1-pipeline").json()
        assert http.get("/flows/name/r1-from-config").status_code == 404
        top = http.post(
            "/flow_runs/filter",
            json={
                "flow_runs": {"name": {"any_": [run_name]}},
                "flows": {"id": {"any_": [flow["id"]]}},
            },
        ).json()
        assert len(top) == 1 and top[0]["state_type"] == "COMPLETED"
        top_id = top[0]["id"]
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: api}):
            dep_id = r1_from_config.to_deployment(name=R1_DEPLOYMENT).apply()
        assert http.get(f"/deployments/{dep_id}").json()["flow_id"] == flow["id"]
        # 6. Prefect subflow and task run names carry the pipeline's name
        subflows = http.post(
            "/flow_runs/filter", json={"flow_runs": {"parent_flow_run_id": {"any_": [top_id]}}}
        ).json()
        assert {f["name"] for f in subflows} >= {f"{run_name}/rl_1", f"{run_name}/rl_2"}
        sub_ids = [f["id"] for f in subflows]
        tasks = http.post(
            "/task_runs/filter",
            json={"task_runs": {"flow_run_id": {"any_": [top_id, *sub_ids]}}, "limit": 200},
        ).json()
        names = {t["name"] for t in tasks}
        assert {f"{run_name}/cold_start_sft", f"{run_name}/rl_1/rollout-0"} <= names
        assert f"{run_name}/rl_1/update-1" in names and f"{run_name}/rejection_sampling" in names
        # 11. the graph's edges are the data hand-overs
        graph = http.get(f"/flow_runs/{top_id}/graph-v2").json()
        label = {nid: n["label"].split(" / ")[-1] for nid, n in graph["nodes"]}
        edges = {
            (label[nid].removeprefix(f"{run_name}/"), label[c["id"]].removeprefix(f"{run_name}/"))
            for nid, n in graph["nodes"]
            for c in n["children"]
        }
        assert edges == EDGES, edges ^ EDGES
        arts = _artifacts(api, [top_id, *sub_ids])

    # 1. + 2. stage artifacts: links to the MLflow run page (model-training mode); RL stages
    # tell reward and held-out accuracy first -> last, per iteration, in escaped tables
    link_re = r"\]\((http[^)]*)/#/experiments/(\w+)/runs/([0-9a-f]{32})\?workflowType=\w+\)"
    for s in CHECKPOINT_STAGES:
        md = arts[f"{s.replace('_', '-')}-summary"]["data"]
        link = re.search(link_re, md)
        assert link, md
        assert link.group(1) == mlflow_uri and link.group(2) == exp.experiment_id
        assert client.get_run(link.group(3)).info.experiment_id == exp.experiment_id
        assert httpx.get(link.group(1)).status_code == 200
        if s.startswith("rl_"):
            assert re.search(r"held-out accuracy \*\*[\d.]+% -> [\d.]+%\*\*", md), md
            assert re.search(r"reward \*\*[\d.]+ -> [\d.]+\*\*", md), md
            table = md.split("| iteration | reward |")[1].split("\n\n")[0].strip().splitlines()[1:]
            assert len(table) == 1 + {"rl_1": 2, "rl_2": 1}[s]  # separator, one row each
            for row in table:
                assert len(re.findall(r"(?<!\\)\|", row)) == 8, row
    # 11. rejection sampling and the pipeline summary
    rs = arts["rejection-sampling"]["data"]
    assert re.search(r"Kept \*\*\d+\*\* of \*\*\d+\*\*", rs)
    per_prompt = arts["rejection-sampling-by-prompt"]["data"]
    assert "acceptance_rate" in str(per_prompt)
    summary = arts["pipeline-summary"]["data"]
    assert (
        f"/#/experiments/{exp.experiment_id}/runs/{pid}?workflowType=machine_learning)" in summary
    )
    assert "compare/grpo-compare.png" in summary and r"| rl\_2 |" in summary

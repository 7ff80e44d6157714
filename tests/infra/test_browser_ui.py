"""The first five minutes in the UIs, in a real browser: infra/start-servers.sh starts a Prefect
server and an MLflow server on non-default ports, `grpo run` runs a tiny pipeline against them
as a user types it, and headless Chromium opens the URLs the CLI printed. What a person sees:
the experiment's runs table (not GenAI's trace overview), the RL stage's chart sections with
eval accuracy and train reward first, and a Prefect UI that talks to its own port.

Needs the Debian packages chromium and chromium-driver (.ci/run installs them); skipped where
they are missing unless GRPO_REQUIRE_BROWSER=1, then it fails."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from browser import REQUIRE_ENV, chromium, missing_browser
from servers_script import run_script

sys.path.insert(0, str(Path(__file__).parents[1] / "pipeline"))
from tests_support import TINY_OVERRIDES  # noqa: E402

REPO = Path(__file__).parents[2]
RUN_NAME = "first-five-minutes"
pytestmark = pytest.mark.slow

# what MLflow 3's GenAI mode shows in an experiment (sidebar, overview tabs, page title)
GENAI_MARKERS = ("Training runs", "Evaluation runs", "Judges", "Sessions", "Tool calls")
# the RL stage's headline metrics: never in the "Model metrics" catch-all section
HEADLINE = {"reward", "reward_std", "loss", "entropy", "accuracy", "kl"}
NO_API = "Can't connect to Server API"


def _free_port(taken: set[int]) -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in taken | {4200, 5000}:  # never the defaults: the point of the test
            return port


def _env_sh(path: Path) -> dict[str, str]:
    """The variables infra/start-servers.sh wrote to env.sh (what `source env.sh` sets)."""
    return dict(re.findall(r"^export (\w+)=(\S+)$", path.read_text(), re.M))


@pytest.fixture(scope="module")
def browser_ready():
    why = missing_browser()
    if why:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but {why}")
        pytest.skip(why)


@pytest.fixture(scope="module")
def stack(browser_ready, tmp_path_factory):
    """Prefect + MLflow from infra/start-servers.sh on free, non-default ports."""
    root = tmp_path_factory.mktemp("browser_stack")
    (root / "work").mkdir()
    pport = _free_port(set())
    mport = _free_port({pport})
    env = {
        **os.environ,
        "GRPO_STATE_DIR": str(root / "state"),
        "GRPO_WORKDIR": str(root / "work"),
        "PREFECT_PORT": str(pport),
        "MLFLOW_PORT": str(mport),
        "GRPO_PYTHON": sys.executable,
    }
    env.pop("PREFECT_API_URL", None)
    env.pop("MLFLOW_TRACKING_URI", None)
    try:
        run_script("start-servers.sh", env, "prefect", "mlflow")
        yield {
            "env": env,
            "root": root,
            "prefect_port": pport,
            "mlflow_port": mport,
            "sourced": _env_sh(root / "state" / "env.sh"),
        }
    finally:
        run_script("stop-servers.sh", env)


@pytest.fixture(scope="module")
def pipeline(stack):
    """`grpo run` with the tiny budget, in a shell that sourced env.sh; the URLs it printed."""
    work = stack["root"] / "work"
    env = {**stack["env"], **stack["sourced"], "PREFECT_HOME": str(stack["root"] / "cli_home")}
    sets = [*TINY_OVERRIDES, f"output_dir={work / 'runs'}", f"run_name={RUN_NAME}"]
    cmd = [sys.executable, "-m", "flows.cli", "run", *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    out = proc.stdout

    def printed(pattern: str) -> str:
        m = re.search(pattern, out, re.M)
        assert m, f"the CLI printed no line matching {pattern!r}:\n{out}"
        return m.group(1)

    return {
        "stdout": out,
        "mlflow_ui": printed(r"^MLflow UI: (\S+)\s*$"),
        "open": printed(r"^\s*open (\S+)\s*$"),
        "parent": printed(r"^\s*parent run: (\S+)\s*$"),
        "prefect": printed(r"^\s*Prefect: (http\S+)\s*$"),
        "api": stack["sourced"]["PREFECT_API_URL"],
        "mlflow": stack["sourced"]["MLFLOW_TRACKING_URI"],
    }


@contextmanager
def page(tmp_path: Path, name: str):
    """A fresh headless Chromium; on a failed check its screenshot and page text go to
    ``tmp_path`` and the assertion message names them."""
    with chromium(tmp_path / f"profile-{name}") as b:
        try:
            yield b
        except (AssertionError, TimeoutError) as e:
            raise AssertionError(f"{e}\n{b.evidence(tmp_path, name)}") from e


# -- MLflow -------------------------------------------------------------------------------------

RUN_NAMES_JS = """return [...document.querySelectorAll(
    '[role=gridcell][col-id="attributes.`Run Name`"]')].filter(e => e.offsetParent)
    .map(e => e.innerText.trim().split('\\n').pop())"""


def _pipeline_runs(mlflow_uri: str, experiment_id: str) -> tuple[str, list[str]]:
    """The pipeline's parent run name and its stage runs' names, from the MLflow API: what the
    table must show (the test does not guess the naming scheme)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_uri)
    runs = client.search_runs([experiment_id], max_results=500)
    [parent] = [
        r for r in runs if r.info.run_name == RUN_NAME and "mlflow.parentRunId" not in r.data.tags
    ]
    children = [
        r.info.run_name for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
    ]
    assert len(children) >= 5, children
    return parent.info.run_name, children


def _check_runs_table(b, url: str, experiment_id: str, children: list[str]) -> None:
    b.open(url)
    b.wait(lambda b: RUN_NAME in b.js(RUN_NAMES_JS), 45, what=f"run {RUN_NAME!r} in the table")
    headers = [h.text.strip() for h in b.find("[role=columnheader]") if h.text.strip()]
    assert "Run Name" in headers, headers
    assert f"/experiments/{experiment_id}/runs" in b.url and "workflowType=genai" not in b.url
    text = b.text()
    sidebar = text.split("Docs")[0]  # the navigation, above the "Docs" / "Settings" links
    assert "Models" in sidebar and "Model registry" in sidebar, sidebar
    assert not [m for m in GENAI_MARKERS if m in text], [m for m in GENAI_MARKERS if m in text]
    # a person expands the pipeline's row: its stage runs
    b.wait_quiet(quiet=1)
    [expand] = b.find('[role=gridcell][col-id="attributes.`Run Name`"] button')
    expand.click()
    names = b.wait(
        lambda b: (n := b.js(RUN_NAMES_JS)) and set(children) <= set(n) and n,
        20,
        what=f"the stage runs {children} after expanding the pipeline's row",
    )
    assert names[0] == RUN_NAME, names


def test_cli_urls_open_the_runs_table_in_a_fresh_browser(pipeline, tmp_path):
    exp = re.search(r"/#/experiments/(\w+)/runs\b", pipeline["mlflow_ui"])
    assert exp, pipeline["mlflow_ui"]
    assert pipeline["mlflow_ui"].startswith(pipeline["mlflow"] + "/")
    _, children = _pipeline_runs(pipeline["mlflow"], exp.group(1))
    with page(tmp_path, "mlflow-root-then-cli-url") as b:
        # first the plain server root, as someone who types the host:port would: recorded,
        # MLflow decides (GenAI home in 3.x); then the URL the CLI printed
        b.open(pipeline["mlflow"] + "/")
        b.wait_text("Experiments", timeout=45)
        b.wait_quiet(quiet=1.5)
        root = b.evidence(tmp_path, "mlflow-root")
        print(f"MLflow server root in a fresh profile: {b.url} {root}")
        _check_runs_table(b, pipeline["mlflow_ui"], exp.group(1), children)
    if pipeline["open"] != pipeline["mlflow_ui"]:
        with page(tmp_path, "mlflow-open-url") as b:
            _check_runs_table(b, pipeline["open"], exp.group(1), children)


def test_parent_run_url_opens_the_run_page(pipeline, tmp_path):
    with page(tmp_path, "mlflow-parent-run") as b:
        b.open(pipeline["parent"])
        text = b.wait_text(RUN_NAME, "Overview", "Model metrics", "R1 recipe", timeout=45)
        assert "workflowType=genai" not in b.url
        assert "Model registry" in text.split("Docs")[0]  # the model-training sidebar


SECTIONS_JS = """return [...document.querySelectorAll('.du-bois-light-collapse-item')]
  .filter(it => it.querySelector('[data-testid=experiment-view-compare-runs-section-header]'))
  .map(it => ({
    header: it.querySelector('[data-testid=experiment-view-compare-runs-section-header]')
      .innerText.replace(/\\s+/g, ' ').trim(),
    charts: [...it.querySelectorAll('[data-testid=experiment-view-compare-runs-card] h4')]
      .map(e => e.getAttribute('title') || e.innerText.trim()),
  }))"""


def read_chart_sections(b, timeout: float = 45) -> list[tuple[str, list[str]]]:
    """The chart sections of a run's "Model metrics" tab, top to bottom: ``(title, [metric
    key of each chart])``. MLflow draws only the cards in view: the window is made as tall as
    the page for the reading (every card drawn), and put back."""
    b.wait_css("[data-testid=experiment-view-compare-runs-section-header]", timeout)
    size = b.driver.get_window_size()

    def all_drawn(b):
        sections = []
        for s in b.js(SECTIONS_JS):
            m = re.match(r"(.*?) \((\d+)\)", s["header"])
            if not m or len(s["charts"]) < int(m.group(2)):
                return None
            sections.append((m.group(1), s["charts"]))
        return sections

    try:
        tall = b.js(
            "return Math.max(...[...document.querySelectorAll('*')]"
            ".map(e => e.scrollHeight > e.clientHeight + 5 ? e.scrollHeight : 0))"
        )
        b.driver.set_window_size(size["width"], min(int(tall) + 600, 16000))
        return b.wait(all_drawn, timeout, what="every chart section drawn")
    finally:
        b.driver.set_window_size(size["width"], size["height"])


def _rl1_run_url(b, pipeline) -> str:
    """The rl_1 stage's MLflow run link, as a person finds it: on the stage's artifact page in
    the Prefect UI ("MLflow run: <run id>")."""
    with httpx.Client(base_url=pipeline["api"]) as http:
        [top] = http.post(
            "/flow_runs/filter", json={"flow_runs": {"name": {"any_": [RUN_NAME]}}}
        ).json()
        subflows = http.post(
            "/flow_runs/filter",
            json={"flow_runs": {"parent_flow_run_id": {"any_": [top["id"]]}}},
        ).json()
        arts = http.post(
            "/artifacts/filter",
            json={
                "artifacts": {"flow_run_id": {"any_": [top["id"], *(f["id"] for f in subflows)]}},
                "limit": 200,
            },
        ).json()
    keys = [a.get("key") for a in arts]
    [art] = [a for a in arts if a.get("key") == "rl-1-summary"] or [None]
    assert art, f"no rl-1-summary artifact on the pipeline's flow runs: {keys}"
    b.open(pipeline["api"].removesuffix("/api") + f"/artifacts/artifact/{art['id']}")
    b.wait_text("MLflow run:", timeout=45)
    links = [
        a.get_attribute("href")
        for a in b.find("a[href]")
        if re.fullmatch(r"[0-9a-f]{32}", a.text.strip())
        and "/#/experiments/" in (a.get_attribute("href") or "")
    ]
    assert links, "no MLflow run link on the rl-1-summary artifact page"
    return links[0]


def test_rl_stage_charts_put_eval_accuracy_and_train_reward_first(pipeline, tmp_path):
    with page(tmp_path, "mlflow-rl1-model-metrics") as b:
        run_url = _rl1_run_url(b, pipeline)
        assert run_url.startswith(pipeline["mlflow"] + "/"), run_url
        from mlflow.tracking import MlflowClient

        run_id = re.search(r"/runs/([0-9a-f]{32})", run_url).group(1)
        run = MlflowClient(pipeline["mlflow"]).get_run(run_id)
        assert run.data.tags.get("stage") == "rl_1", run.data.tags
        b.open(run_url)
        b.wait_text(run.info.run_name, "Model metrics", timeout=45)
        b.click("[role=tab]", "Model metrics")
        b.wait(lambda b: "/model-metrics" in b.url, 20, what="the Model metrics tab")
        assert "workflowType=genai" not in b.url
        # what a person sees first, without scrolling: the top section's first chart
        first = b.wait_css("[data-testid=experiment-view-compare-runs-card] h4")
        first = first[0].get_attribute("title")
        sections = read_chart_sections(b)
        order = [title for title, _ in sections]
        charts = dict(sections)
        print(f"rl_1 model-metrics sections: {sections}")
        assert order[:2] == ["eval", "train"], f"sections top to bottom: {order}"
        assert charts["eval"][0] == "eval/accuracy", charts["eval"]
        assert "train/reward" in charts["train"], charts["train"]
        assert first == "eval/accuracy", f"first chart in view: {first}"
        details = order[2:]
        assert all(t.startswith("train/") for t in details if t != "Model metrics"), order
        assert "train/clip_ratio" in details, order
        if "Model metrics" in charts:  # MLflow's catch-all for keys without a "/"
            assert order[-1] == "Model metrics", order
            assert not HEADLINE & set(charts["Model metrics"]), charts["Model metrics"]


# -- Prefect ------------------------------------------------------------------------------------


def test_prefect_ui_connects_on_its_own_port(stack, pipeline, tmp_path):
    ui = f"http://127.0.0.1:{stack['prefect_port']}"
    api = f"{ui}/api"
    assert pipeline["api"] == api and pipeline["prefect"].startswith(ui + "/")
    # where the UI's JavaScript is told its API lives
    assert httpx.get(f"{ui}/ui-settings").json()["api_url"] == api
    with page(tmp_path, "prefect-ui") as b:
        b.open(ui + "/")
        # the dashboard renders its panels (its counts lag the API on a busy machine: the
        # Runs page below is what must list the pipeline)
        text = b.wait_text("Dashboard", "Flow Runs", "Task Runs", timeout=45)
        assert NO_API not in text
        b.click("a", "Runs")  # the sidebar's Runs page lists the pipeline's flow run
        b.wait(lambda b: "/runs" in b.url, 20, what="the Runs page")
        text = b.wait_text(RUN_NAME, "Completed", timeout=45)
        assert NO_API not in text
        # the flow run page the CLI printed
        b.open(pipeline["prefect"])
        text = b.wait_text(RUN_NAME, "r1-pipeline", "Completed", "Artifacts", timeout=45)
        assert NO_API not in text, text[:2000]
        api_seen = b.js("return fetch('/ui-settings').then(r => r.json()).then(s => s.api_url)")
        assert api_seen == api, api_seen

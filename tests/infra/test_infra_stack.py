"""The team setup, as a user runs it: infra/start-servers.sh starts a real Prefect server, an
MLflow server and a process worker on localhost; the deployments of infra/prefect.yaml are
registered with `prefect deploy` and `grpo serve` (flows/deployments.py); tiny pipelines are
triggered through the API with `run_deployment`; `grpo compare` reads both runs from the
MLflow server; infra/stop-servers.sh stops everything."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from servers_script import run_script

from flows.config import CHECKPOINT_STAGES
from tasks.workspace import Workspace

sys.path.insert(0, str(Path(__file__).parents[1] / "pipeline"))
from tests_support import TINY_OVERRIDES  # noqa: E402

REPO = Path(__file__).parents[2]
SERVICES = ("prefect", "mlflow", "worker")
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("stack")
    (root / "work").mkdir()
    pport, mport = _free_port(), _free_port()
    env = {
        **os.environ,
        "GRPO_STATE_DIR": str(root / "state"),
        "GRPO_WORKDIR": str(root / "work"),
        "PREFECT_PORT": str(pport),
        "MLFLOW_PORT": str(mport),
        "GRPO_PYTHON": sys.executable,
        "GRPO_WORK_POOL": "grpo-local",
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "PREFECT_RUNNER_POLL_FREQUENCY": "2",
    }  # telemetry off etc.: os.environ has flows/env.py's defaults (tests/conftest.py)
    env.pop("PREFECT_API_URL", None)
    env.pop("MLFLOW_TRACKING_URI", None)
    try:
        out = run_script("start-servers.sh", env, *SERVICES)
    except BaseException:
        run_script("stop-servers.sh", env)  # what did start must not outlive the test
        raise
    api, mlflow_uri = f"http://127.0.0.1:{pport}/api", f"http://127.0.0.1:{mport}"
    assert api in out and mlflow_uri in out and "polling work pool 'grpo-local'" in out
    stack = {
        "env": {**env, "PREFECT_API_URL": api, "PREFECT_HOME": str(root / "cli_home")},
        "script_env": env,
        "api": api,
        "mlflow": mlflow_uri,
        "state": root / "state",
        "work": root / "work",
    }
    try:
        yield stack
    finally:
        run_script("stop-servers.sh", env)  # idempotent: a no-op once test_stop_servers ran


def _run_deployment(stack, name: str, run_name: str) -> object:
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    overrides = [
        *TINY_OVERRIDES,
        f"run_name={run_name}",
        f"output_dir={stack['work'] / 'runs'}",
        f"tracking.uri={stack['mlflow']}",
        "tracking.experiment=grpo-stack-test",
    ]
    with temporary_settings({PREFECT_API_URL: stack["api"]}):
        return run_deployment(
            name, parameters={"overrides": overrides}, timeout=480, poll_interval=2
        )


def _read_deployment(stack, name: str):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: stack["api"]}), get_client(sync_client=True) as c:
        return c.read_deployment_by_name(name)


@pytest.fixture(scope="module")
def worker_run(stack):
    """Deploy infra/prefect.yaml (every deployment whose flow imports) and run r1-pipeline
    on the process worker."""
    import importlib

    spec = yaml.safe_load((REPO / "infra" / "prefect.yaml").read_text())
    names = []
    for d in spec["deployments"]:
        module, _, attr = d["entrypoint"].rpartition(".")
        try:
            getattr(importlib.import_module(module), attr)
            names.append(d["name"])
        except (ImportError, AttributeError):
            continue
    assert "r1-pipeline" in names
    proc = subprocess.run(
        [sys.executable, "-m", "prefect", "--no-prompt", "deploy",
         "--prefect-file", "infra/prefect.yaml", *[a for n in names for a in ("--name", n)]],
        env=stack["env"], cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    t0 = time.perf_counter()
    flow_run = _run_deployment(stack, "r1-pipeline/r1-pipeline", "via-worker")
    return flow_run, time.perf_counter() - t0


def test_start_is_idempotent(stack):
    pids = {s: (stack["state"] / f"{s}.pid").read_text() for s in SERVICES}
    out = run_script("start-servers.sh", stack["script_env"], *SERVICES)
    for s in SERVICES:
        assert f"{s}: already running (pid {pids[s].strip()})" in out
        assert (stack["state"] / f"{s}.pid").read_text() == pids[s]
    assert f"PREFECT_API_URL={stack['api']}" in (stack["state"] / "env.sh").read_text()


def test_prefect_yaml_deployment_runs_on_the_worker(stack, worker_run):
    flow_run, _ = worker_run
    assert flow_run.state.type.value == "COMPLETED", flow_run.state
    deployment = _read_deployment(stack, "r1-pipeline/r1-pipeline")
    assert deployment.work_pool_name == "grpo-local"
    assert deployment.parameter_openapi_schema["properties"].keys() >= {"config", "overrides"}
    assert [s.schedule.cron for s in deployment.schedules] == ["0 2 * * *"]
    assert not any(s.active for s in deployment.schedules)  # the example schedule is paused
    # the flow ran in GRPO_WORKDIR and wrote the run's files there
    assert (
        Workspace(stack["work"] / "runs" / "via-worker").checkpoint("rl_2") / "config.json"
    ).exists()


@pytest.fixture(scope="module")
def served_run(stack, worker_run):
    """`grpo serve` (python -m flows.serve_cli) picks up a run triggered through the API.
    The worker is stopped first (stop-servers.sh for one service), so only serve can run it."""
    assert "worker: stopped" in run_script("stop-servers.sh", stack["script_env"], "worker")
    log = open(stack["work"] / "serve.log", "w")  # noqa: SIM115
    serve = subprocess.Popen(
        [sys.executable, "-m", "flows.serve_cli", "--no-stages", "--cron", "30 1 * * 0"],
        env=stack["env"], cwd=stack["work"], stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.time() + 120
        while True:  # registered: the deployment now has the serve's schedule
            assert serve.poll() is None, (stack["work"] / "serve.log").read_text()[-3000:]
            try:
                d = _read_deployment(stack, "r1-pipeline/r1-pipeline")
                if [s.schedule.cron for s in d.schedules] == ["30 1 * * 0"]:
                    break
            except Exception:
                pass
            assert time.time() < deadline, "grpo serve did not register its deployment"
            time.sleep(1)
        t0 = time.perf_counter()
        flow_run = _run_deployment(stack, "r1-pipeline/r1-pipeline", "via-serve")
        return flow_run, time.perf_counter() - t0
    finally:  # stop serve now, while the API it reports its shutdown to is still up
        os.killpg(serve.pid, 15)
        try:
            serve.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, 9)
        log.close()


def test_grpo_serve_runs_a_deployment_triggered_through_the_api(served_run):
    flow_run, _ = served_run
    assert flow_run.state.type.value == "COMPLETED", flow_run.state


def test_compare_reads_both_runs_from_the_mlflow_server(stack, worker_run, served_run, tmp_path):
    png = tmp_path / "cmp.png"
    proc = subprocess.run(
        [sys.executable, "-m", "flows.compare", "via-worker", "via-serve",
         "--tracking-uri", stack["mlflow"], "-o", str(png)],
        env=stack["env"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for stage in CHECKPOINT_STAGES:
        assert stage in proc.stdout
    assert "via-worker" in proc.stdout and "via-serve" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    from mlflow.tracking import MlflowClient

    client = MlflowClient(stack["mlflow"])
    exp = client.get_experiment_by_name("grpo-stack-test")
    parents = client.search_runs([exp.experiment_id], "tags.pipeline = 'r1'")
    assert {r.info.run_name for r in parents} == {"via-worker", "via-serve"}
    for r in parents:
        # its own plot, logged when the run ended, and the one of `grpo compare`
        assert sorted(a.path for a in client.list_artifacts(r.info.run_id, "compare")) == [
            "compare/cmp.png",
            "compare/grpo-compare.png",
        ]


def test_register_final_checkpoint_on_the_mlflow_server(stack, worker_run, tmp_path):
    from mlflow.tracking import MlflowClient

    from flows.model_registry import register_final_checkpoint

    client = MlflowClient(stack["mlflow"])
    exp = client.get_experiment_by_name("grpo-stack-test")
    parent = client.search_runs([exp.experiment_id], "attributes.run_name = 'via-worker'")[0]
    from flows.compare import _stage_numbers

    metrics = {  # the parent's stages/<n>_<stage>/<m> as the pipeline hands them over
        stage: {m: v for m, v in numbers.items() if m != "wall_time_s"}
        for stage, numbers in _stage_numbers(parent.data.metrics).items()
    }
    ckpt = Workspace(stack["work"] / "runs" / "via-worker").checkpoint("rl_2")
    version = register_final_checkpoint(stack["mlflow"], parent.info.run_id, ckpt, metrics)
    assert version.name == "grpo-stack-test" and version.tags["stage"] == "rl_2"
    assert float(version.tags["rl_2/eval/accuracy"]) == pytest.approx(metrics["rl_2"]["accuracy"])

    import mlflow
    from transformers import AutoModelForCausalLM

    source = MlflowClient(
        stack["mlflow"], registry_uri=stack["mlflow"]
    ).get_model_version_download_uri(version.name, version.version)
    local = mlflow.artifacts.download_artifacts(
        artifact_uri=source, dst_path=str(tmp_path), tracking_uri=stack["mlflow"]
    )
    assert AutoModelForCausalLM.from_pretrained(local).config.num_hidden_layers == 2


def test_stop_servers_stops_everything(stack):
    pids = {
        s: int((stack["state"] / f"{s}.pid").read_text())
        for s in SERVICES
        if (stack["state"] / f"{s}.pid").exists()  # the serve test stopped the worker already
    }
    assert {"prefect", "mlflow"} <= pids.keys()
    out = run_script("stop-servers.sh", stack["script_env"])
    for s in pids:
        assert f"{s}: stopped (pid {pids[s]})" in out
        assert not (stack["state"] / f"{s}.pid").exists()
    groups = subprocess.run(["ps", "-eo", "pgid=,stat="], capture_output=True, text=True).stdout
    alive = {int(g) for g, st in (line.split() for line in groups.splitlines()) if st[0] != "Z"}
    assert not alive & set(pids.values()), "a server's process group survived stop-servers.sh"
    for port in (stack["api"], stack["mlflow"]):
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", int(port.split(":")[2].split("/")[0]))) != 0
    again = run_script("stop-servers.sh", stack["script_env"])
    assert all(f"{s}: not running" in again for s in SERVICES)

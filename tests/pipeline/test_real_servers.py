"""The pipeline against real, standing servers on localhost: a `prefect server` and an
`mlflow server` started as separate processes, and `grpo run` as a user would type it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from tests_support import TINY_OVERRIDES


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"server exited with {proc.returncode}: {proc.stdout.read()[-2000:]}"
            )
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout}s")


@pytest.fixture
def servers(tmp_path):
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect_home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }
    pport, mport = _free_port(), _free_port()
    prefect = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "prefect",
            "server",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(pport),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    mlflow = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(mport),
            "--backend-store-uri",
            f"sqlite:///{tmp_path / 'server.db'}",
            "--artifacts-destination",
            str(tmp_path / "artifacts"),
            "--workers",
            "1",
        ],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        _wait_http(f"http://127.0.0.1:{pport}/api/health", prefect)
        _wait_http(f"http://127.0.0.1:{mport}/health", mlflow)
        yield {
            "prefect": f"http://127.0.0.1:{pport}/api",
            "mlflow": f"http://127.0.0.1:{mport}",
            "env": env,
        }
    finally:
        for p in (prefect, mlflow):
            os.killpg(p.pid, 15)
        for p in (prefect, mlflow):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)


@pytest.mark.slow
def test_grpo_run_against_real_prefect_and_mlflow_servers(servers, tmp_path):
    env = {**servers["env"], "PREFECT_API_URL": servers["prefect"]}
    cmd = [
        sys.executable,
        "-m",
        "flows.cli",
        "run",
        *[a for o in TINY_OVERRIDES for a in ("--set", o)],
        "--set",
        f"output_dir={tmp_path / 'runs'}",
        "--set",
        f"tracking.uri={servers['mlflow']}",
        "--set",
        "run_name=served",
    ]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "rl_2" in proc.stdout and "Where to look next" in proc.stdout

    from mlflow.tracking import MlflowClient

    client = MlflowClient(servers["mlflow"])
    exp = client.get_experiment_by_name("grpo-demo")
    runs = client.search_runs([exp.experiment_id], "tags.pipeline = 'r1'")
    assert len(runs) == 1 and "stages/4_rl_2/accuracy" in runs[0].data.metrics
    assert {a.path for a in client.list_artifacts(runs[0].info.run_id)} >= {
        "config.yaml",
        "summary.json",
    }

    from prefect.client.orchestration import get_client

    os.environ["PREFECT_API_URL"] = servers["prefect"]
    try:
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with (
            temporary_settings({PREFECT_API_URL: servers["prefect"]}),
            get_client(sync_client=True) as c,
        ):
            flow_runs = c.read_flow_runs()
    finally:
        os.environ.pop("PREFECT_API_URL", None)
    names = {(r.name, r.state.type.value) for r in flow_runs}
    assert ("served", "COMPLETED") in names
    assert ("served/rl_1", "COMPLETED") in names and ("served/rl_2", "COMPLETED") in names

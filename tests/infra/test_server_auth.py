"""The servers beyond loopback (issue 44): infra/start-servers.sh turns on Prefect's basic auth
and MLflow's basic-auth app when the bind address is not loopback (a password made once and
kept in GRPO_STATE_DIR/auth, mode 600) or when GRPO_AUTH is given; CORS answers only the bind
address's origins and MLflow refuses another Host header. Real servers, real requests; the
grpo command refuses a missing or wrong password in one line, and a client with env.sh's
variables runs a Prefect flow that logs to MLflow."""

from __future__ import annotations

import base64
import os
import socket
import stat
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from servers_script import run_script

pytestmark = pytest.mark.slow
PASSWORD = "a-long-s3cret-for-tests"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _exposed_address() -> str | None:
    """This machine's first non-loopback IPv4 address, if it has one."""
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    except OSError:
        return None
    return next((a for a in out if "." in a and not a.startswith("127.")), None)


def _status(url: str, headers: dict | None = None, method: str = "GET") -> tuple[int, dict]:
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers)


def _basic(creds: str) -> dict:
    return {"Authorization": "Basic " + base64.b64encode(creds.encode()).decode()}


def _servers(tmp_path: Path, host: str, auth: str | None):
    pport, mport = _free_port(host), _free_port(host)
    env = {
        **os.environ,
        "GRPO_HOST": host,
        "GRPO_STATE_DIR": str(tmp_path / "state"),
        "GRPO_WORKDIR": str(tmp_path),
        "PREFECT_PORT": str(pport),
        "MLFLOW_PORT": str(mport),
        "GRPO_PYTHON": sys.executable,
    }
    for k in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "GRPO_AUTH", "GRPO_EXPOSE_UNAUTHENTICATED"):
        env.pop(k, None)
    if auth:
        env["GRPO_AUTH"] = auth
    try:
        run_script("start-servers.sh", env, "prefect", "mlflow")
    except BaseException:
        run_script("stop-servers.sh", env)  # what did start must not outlive the test
        raise
    return env, f"http://{host}:{pport}/api", f"http://{host}:{mport}"


@pytest.fixture(scope="module", params=["loopback, GRPO_AUTH", "exposed, made password"])
def servers(request, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("servers")
    if request.param.startswith("loopback"):
        host, auth = "127.0.0.1", f"alice:{PASSWORD}"
    else:
        host, auth = _exposed_address(), None
        if host is None:
            pytest.skip("no non-loopback address on this machine")
    env, api, mlflow_uri = _servers(tmp_path, host, auth)
    try:
        state = Path(env["GRPO_STATE_DIR"])
        if auth is None:  # the password the script made, kept for the next start
            made = state / "auth"
            assert stat.S_IMODE(made.stat().st_mode) == 0o600
            auth = made.read_text().strip()
            assert auth.startswith("grpo:") and len(auth) > len("grpo:") + 12
        yield {"env": env, "api": api, "mlflow": mlflow_uri, "auth": auth, "state": state}
    finally:
        run_script("stop-servers.sh", env)


def test_both_servers_answer_their_api_to_the_password_only(servers):
    api, ml, good = servers["api"], servers["mlflow"], _basic(servers["auth"])
    bad = _basic(servers["auth"].split(":")[0] + ":not-the-password-at-all")
    search = ml + "/api/2.0/mlflow/experiments/search?max_results=1"
    assert _status(api + "/work_pools/filter", method="POST")[0] == 401
    assert _status(api + "/admin/version")[0] == 401
    assert _status(api + "/admin/version", bad)[0] == 401
    assert _status(api + "/admin/version", good)[0] == 200
    assert _status(search)[0] == 401
    assert _status(search, bad)[0] == 401
    assert _status(search, good)[0] == 200
    env_sh = servers["state"] / "env.sh"
    assert stat.S_IMODE(env_sh.stat().st_mode) == 0o600
    logs = servers["state"] / "logs"
    password = servers["auth"].split(":", 1)[1]
    assert stat.S_IMODE(logs.stat().st_mode) == 0o700
    for log in logs.iterdir():  # the password is in no log, and the logs are this user's only
        assert password not in log.read_text(errors="replace"), log.name
        assert stat.S_IMODE(log.stat().st_mode) == 0o600, log.name
    text = env_sh.read_text()
    assert "PREFECT_API_AUTH_STRING=" in text and "MLFLOW_TRACKING_PASSWORD=" in text
    # the servers' stores (Prefect's database, MLflow's password hashes) are this user's only
    stores = [servers["state"] / "mlflow-auth.db", servers["state"] / "prefect" / "prefect.db"]
    for store in stores:
        assert store.exists(), store
        assert stat.S_IMODE(store.stat().st_mode) & 0o077 == 0, store


def test_cors_and_host_headers_name_the_bind_address_only(servers):
    api, ml, good = servers["api"], servers["mlflow"], _basic(servers["auth"])
    evil = {**good, "Origin": "http://evil.example"}
    own = {**good, "Origin": api.rsplit("/api", 1)[0]}
    assert "access-control-allow-origin" not in {
        k.lower() for k in _status(api + "/health", evil)[1]
    }
    headers = {k.lower(): v for k, v in _status(api + "/health", own)[1].items()}
    assert headers.get("access-control-allow-origin") == own["Origin"]
    search = ml + "/api/2.0/mlflow/experiments/search?max_results=1"
    assert "access-control-allow-origin" not in {k.lower() for k in _status(search, evil)[1]}
    assert _status(search, {**good, "Host": "evil.example"})[0] == 403  # DNS rebinding


def _grpo(env: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", "--set", f"output_dir={tmp_path / 'runs'}"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_grpo_refuses_a_missing_password_in_one_line(servers, tmp_path):
    env = {
        **servers["env"],
        "PREFECT_API_URL": servers["api"],
        "MLFLOW_TRACKING_URI": servers["mlflow"],
    }
    env["PYTHONPATH"] = str(Path(__file__).parents[2])
    user, password = servers["auth"].split(":", 1)
    for k in ("PREFECT_API_AUTH_STRING", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        env.pop(k, None)
    proc = _grpo(env, tmp_path)
    assert proc.returncode == 2 and "MLFLOW_TRACKING_USERNAME" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    env.update(MLFLOW_TRACKING_USERNAME=user, MLFLOW_TRACKING_PASSWORD=password)
    proc = _grpo(env, tmp_path)
    assert proc.returncode == 2 and "PREFECT_API_AUTH_STRING" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()  # refused before anything is written


def test_a_client_with_env_sh_runs_a_flow_that_logs_to_mlflow(servers, tmp_path):
    script = tmp_path / "client.py"
    script.write_text(
        textwrap.dedent(
            """
            import mlflow
            from prefect import flow

            @flow
            def logged():
                mlflow.set_experiment("auth-check")
                with mlflow.start_run() as run:
                    mlflow.log_metric("x", 1.0)
                return run.info.run_id

            print("RUN", logged())
            """
        )
    )
    cmd = f'. "{servers["state"] / "env.sh"}" && "{sys.executable}" "{script}"'
    env = {k: v for k, v in servers["env"].items() if not k.startswith("PREFECT_API")}
    proc = subprocess.run(["bash", "-c", cmd], env=env, capture_output=True, text=True,
                          timeout=180, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_id = proc.stdout.split("RUN", 1)[1].strip()
    got = _status(
        servers["mlflow"] + f"/api/2.0/mlflow/runs/get?run_id={run_id}", _basic(servers["auth"])
    )
    assert got[0] == 200

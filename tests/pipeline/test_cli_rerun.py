"""`grpo run` as a user runs it: a fresh process, no PREFECT_API_URL, so the CLI starts
Prefect's temporary server itself (flows/local_server.py). Run twice: the second run reuses
every stage without loading torch, and each process leaves no server behind."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from tests_support import TINY_OVERRIDES

ROOT = Path(__file__).resolve().parents[2]


def _grpo_run(tmp_path: Path, *python_flags: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "PREFECT_HOME"))}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")  # the server's own sqlite db
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, *python_flags, "-m", "flows.cli", "run"]
    cmd += [a for o in TINY_OVERRIDES for a in ("--set", o)]
    cmd += ["--set", f"output_dir={tmp_path / 'runs'}", "--set", "run_name=cli"]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    return proc


def _port_open(url: str) -> bool:
    host_port = url.split("//")[1].split("/")[0]
    host, port = host_port.split(":")
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, int(port))) == 0


def _server_url(log: str) -> str:
    line = next(x for x in log.splitlines() if "Temporary Prefect server on" in x)
    return line.split("Temporary Prefect server on ")[1].split()[0]


@pytest.mark.slow
def test_grpo_run_twice_second_reuses_everything_without_torch(tmp_path):
    first = _grpo_run(tmp_path)
    out = first.stdout + first.stderr
    url = _server_url(out)
    assert "Traceback" not in out
    assert not _port_open(url), "the temporary Prefect server outlived the command"

    # -X importtime lists every module the process imports on stderr
    second = _grpo_run(tmp_path, "-X", "importtime")
    log = second.stdout + second.stderr
    imported = {
        line.rsplit("|", 1)[1].strip()
        for line in second.stderr.splitlines()
        if "import time:" in line
    }
    assert "prefect" in imported and "mlflow" in imported
    assert not {"torch", "transformers"} & imported, "a fully cached rerun loaded torch"
    for stage in ("cold_start_sft", "rejection_sampling", "re_sft"):
        assert f"{stage}: inputs unchanged" in log
    assert "rl_1: 2 of 2 iterations reused from cache" in log
    assert "rl_2: 1 of 1 iterations reused from cache" in log
    assert "Traceback" not in log
    assert not _port_open(_server_url(log))
    assert "R1 pipeline 'cli'" in second.stdout and "rl_2" in second.stdout


def test_configured_prefect_api_is_used_as_is(prefect_harness):
    """Under a configured API (here the test harness's settings) no server is started."""
    from prefect.settings import get_current_settings

    from flows import local_server

    assert get_current_settings().api.url
    assert local_server.start() is None
    with local_server.attach(None):
        assert get_current_settings().api.url

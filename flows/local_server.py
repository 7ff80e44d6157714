"""Prefect's temporary API server, started before the heavy imports instead of after them.

With no ``PREFECT_API_URL``, Prefect starts a temporary server (uvicorn in a subprocess,
``prefect.server.api.server.SubprocessASGIServer``) at the first API call: after ``grpo``
has spent ~10 s importing torch, transformers and mlflow, and the caller then waits ~7 s
more while the server imports FastAPI, SQLAlchemy and Prefect's server and migrates its
database. The CLI starts the same server, with the same command, flags and environment
Prefect uses, as its first step, so the two start-ups overlap on separate cores; the flow
then talks to it through ``PREFECT_API_URL`` and it is stopped when the command ends.

A server configured by the user (``PREFECT_API_URL`` in the environment, the active Prefect
profile or the settings context of a test harness) is used as is, and so is Prefect's own
choice when ephemeral mode is off.

The server dies with the command, however the command ends: it is stopped at exit (after
Prefect has sent it the flow's last states), and on Linux the kernel kills it (SIGKILL) when
the ``grpo`` process dies without stopping it, e.g. by SIGKILL (``PR_SET_PDEATHSIG``, set by
the server process itself before it loads uvicorn). Not SIGTERM there: with nobody left to
serve, a graceful shutdown only cancels the event recorder's flush and prints its traceback
into the terminal, seconds after ``grpo`` is gone; sqlite's own journal keeps its database
whole under a SIGKILL. It runs in its own session, so Ctrl-C in the terminal
reaches ``grpo`` only, and the server is still there to record the flow run as crashed.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

log = logging.getLogger(__name__)

# What SubprocessASGIServer._run_uvicorn_command sets: no UI, no background services.
_SERVER_ENV = {
    "PREFECT_UI_ENABLED": "0",
    "PREFECT__SERVER_EPHEMERAL": "1",
    "PREFECT__SERVER_FINAL": "1",
}
# Defaults the user's environment can override. The task-run recorder writes one event per
# sqlite transaction by default, ~40 events/s here: a cached rerun's 150 task runs (~450
# events) left it ~6 s behind the flow. Batches of 100, flushed every second, keep up.
_SERVER_DEFAULTS = {
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "100",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_READ_BATCH_SIZE": "100",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1",
}


# task runs in a final state: the last event of each task run the server records
_FINISHED_TASK_RUNS = json.dumps(
    {"task_runs": {"state": {"type": {"any_": ["COMPLETED", "FAILED", "CANCELLED", "CRASHED"]}}}}
).encode()


# Runs uvicorn as ``python -m uvicorn`` does, after asking the kernel to SIGKILL this process
# when its parent dies (prctl(PR_SET_PDEATHSIG); survives exec, set in the child itself
# rather than in a preexec_fn, which is unsafe once the parent has threads). A parent that
# died before the prctl call is caught by comparing getppid() with the pid it passed.
_LAUNCHER = """
import ctypes, os, signal, sys
parent = int(sys.argv.pop(1))
if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
if os.getppid() != parent:
    sys.exit(0)
sys.argv[0] = "uvicorn"
from uvicorn.main import main
main()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _configured_elsewhere() -> bool:
    """True when a Prefect API is already chosen (checked without importing Prefect when it
    is not imported yet, so the server can start before that import)."""
    if "prefect" in sys.modules:
        from prefect.settings import get_current_settings

        return bool(get_current_settings().api.url)
    return bool(os.environ.get("PREFECT_API_URL"))


class LocalServer:
    """A temporary ``prefect server`` (API only) on 127.0.0.1, owned by this process."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.process: subprocess.Popen | None = None
        self._spawn()
        # registered before Prefect is imported, so it runs after Prefect's own exit hooks
        # have sent the last logs and states to this server
        atexit.register(self.stop)

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def _spawn(self) -> None:
        import importlib.util

        prefect_dir = Path(importlib.util.find_spec("prefect").origin).parent
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _LAUNCHER,
                str(os.getpid()),
                "--app-dir",
                str(prefect_dir.parent),
                "--factory",
                "prefect.server.api.server:create_app",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--log-level",
                "error",
                "--lifespan",
                "on",
            ],
            env={**_SERVER_DEFAULTS, **os.environ, **_SERVER_ENV},
            start_new_session=True,  # its own process group; Ctrl-C does not reach it
        )

    def wait(self, timeout: float) -> None:
        """Block until ``/health`` answers 200; start again on another port if the port was
        taken meanwhile (uvicorn exits with 3 then; Prefect's own server does the same)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self.process.poll() if self.process else None
            if code is not None:
                if code == 3:
                    self.port = _free_port()
                    self._spawn()
                    continue
                raise RuntimeError(f"the temporary Prefect server exited with code {code}")
            try:
                with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(
            f"the temporary Prefect server on {self.api_url} did not answer within {timeout:.0f} s"
            " (PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)"
        )

    def _finished_task_runs(self) -> int | None:
        req = urllib.request.Request(
            f"{self.api_url}/task_runs/count",
            data=_FINISHED_TASK_RUNS,
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return int(r.read())
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
            return None

    def drain(self, timeout: float = 15.0, quiet_s: float = 1.0) -> None:
        """Wait until the server has recorded the task-run events it was sent (its count of
        finished task runs stops moving for ``quiet_s``, one recorder flush interval), so
        stopping it loses no run history; what is left in its queue is flushed at shutdown."""
        deadline = time.monotonic() + timeout
        last, since = self._finished_task_runs(), time.monotonic()
        while last is not None and time.monotonic() < deadline:
            time.sleep(0.1)
            now = self._finished_task_runs()
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return

    def stop(self, drain: bool = True) -> None:
        """Stop the server and anything it started (its process group); ``drain=False``
        skips waiting for it to record the last task-run events."""
        if self.process is None:
            return
        if drain and self.process.poll() is None:
            t0 = time.perf_counter()
            self.drain()
            log.debug("drained in %.1f s", time.perf_counter() - t0)
        _signal_group(self.process, signal.SIGTERM)
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            _signal_group(self.process, signal.SIGKILL)
            self.process.wait()
        self.process = None


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    """``sig`` to the server's process group (its pid: it leads its own session), while the
    server has not been reaped (after that its pid may name another process)."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        process.send_signal(sig)


def start() -> LocalServer | None:
    """Start the server now unless a Prefect API is already configured; it stops when
    the process exits."""
    if _configured_elsewhere():
        return None
    return LocalServer()


def attach(server: LocalServer | None) -> AbstractContextManager:
    """Settings context that points Prefect at ``server`` once it answers. Call after
    Prefect is imported: a server named by the user's profile wins, and ours is stopped."""
    if server is None:
        return nullcontext()
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_UI_URL,
        get_current_settings,
        temporary_settings,
    )

    settings = get_current_settings()
    if settings.api.url or not settings.server.ephemeral.enabled:
        server.stop()
        return nullcontext()
    waited = time.perf_counter()
    server.wait(settings.server.ephemeral.startup_timeout_seconds)
    from prefect.logging import get_logger

    get_logger("temporary_server").info(
        "Temporary Prefect server on %s (started with the imports; waited %.1f s for it). "
        "For the UI and run history, start a standing one: infra/start-servers.sh",
        server.api_url,
        time.perf_counter() - waited,
    )
    # no "View at <UI>" links: this server has no UI, as Prefect's own temporary one
    return temporary_settings(updates={PREFECT_API_URL: server.api_url, PREFECT_UI_URL: ""})

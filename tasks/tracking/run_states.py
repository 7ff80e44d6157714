"""Which MLflow runs are open, so that none is left RUNNING.

Runs this process opened and has not ended are registered here (:func:`opened`,
:func:`closed`); :func:`end_open_runs` ends them FAILED or KILLED when a pipeline fails or
is interrupted. Every run of a pipeline is tagged with the pid, host and workspace that
started it (:func:`process_tags`), so the next pipeline of the same workspace can end the
runs of a process that was SIGKILLed (:func:`pid_alive`; ``Tracking.end_dead_runs`` in
tasks/tracking/stages.py).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from mlflow.tracking import MlflowClient

from tasks.tracking.store import Shielded

# Tags on every run of a pipeline (Tracking.run_tags) and on its parent run.
PID, HOST, WORKSPACE = "grpo.pid", "grpo.host", "grpo.workspace"


def process_tags(workspace: str | Path) -> dict[str, str]:
    return {
        PID: str(os.getpid()),
        HOST: socket.gethostname(),
        WORKSPACE: str(Path(workspace).resolve()),
    }


def pid_alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, OverflowError):
        return True  # another user's process, or not a pid: leave its runs alone
    return True


@dataclass(frozen=True)
class OpenRun:
    """A run this process started and has not ended."""

    uri: str
    root: str  # the pipeline's parent run (itself for the parent)
    stage: str  # the stage tag; the run name for a parent


_open_runs: dict[str, OpenRun] = {}  # by run id, in the order they were started
_flow_roots: dict[str, set[str]] = {}  # Prefect flow run id -> parent runs it started
_open_guard = threading.Lock()


def current_flow_run() -> str | None:
    try:
        from prefect.context import FlowRunContext

        ctx = FlowRunContext.get()
    except ImportError:
        return None
    return str(ctx.flow_run.id) if ctx and ctx.flow_run else None


def opened(
    run_id: str, uri: str, root: str | None, stage: str, flow_run: str | None = None
) -> None:
    with _open_guard:
        _open_runs[run_id] = OpenRun(uri, root or run_id, stage)
        if flow_run:
            _flow_roots.setdefault(flow_run, set()).add(run_id)


def closed(run_id: str) -> None:
    """Forget ``run_id`` as open (it was ended)."""
    with _open_guard:
        _open_runs.pop(run_id, None)


def open_runs() -> dict[str, OpenRun]:
    """The runs this process started and has not ended, oldest first."""
    with _open_guard:
        return dict(_open_runs)


SYSTEM_METRICS_INTERVAL_ENV = "GRPO_SYSTEM_METRICS_INTERVAL"  # seconds between samples
_monitors: dict[str, object] = {}  # run id -> mlflow SystemMetricsMonitor


def start_system_metrics(run_id: str, uri: str) -> None:
    """Record CPU, memory, disk, network (and GPU, with pynvml) as ``system/*`` metrics of
    ``run_id`` from a background thread, until :func:`stop_system_metrics`. Needs psutil;
    ``GRPO_SYSTEM_METRICS_INTERVAL=0`` turns it off."""
    interval = float(os.environ.get(SYSTEM_METRICS_INTERVAL_ENV, "5"))
    if interval <= 0:
        return
    import logging

    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
    monitor = SystemMetricsMonitor(run_id, sampling_interval=interval, tracking_uri=uri)
    monitor.start()
    with _open_guard:
        _monitors[run_id] = monitor


def stop_system_metrics(run_id: str) -> None:
    """Stop ``run_id``'s monitor (if any) after one last sample, so a stage shorter than the
    sampling interval still has its point."""
    with _open_guard:
        monitor = _monitors.pop(run_id, None)
    if monitor is None:
        return
    monitor.finish()
    with contextlib.suppress(Exception):
        monitor.collect_metrics()
        monitor.publish_metrics(monitor.aggregate_metrics())
        monitor.mlflow_logger.flush()


def end_open_runs(status: str, *, flow_run: str | None = None) -> list[str]:
    """End the runs this process left open with ``status`` (``KILLED`` or ``FAILED``), the
    innermost first: all of them, or those of the parent runs that Prefect flow run
    ``flow_run`` started. Errors are swallowed: this runs while a pipeline is going down."""
    _release_store_frames(sys.exception())
    with _open_guard:
        roots = _flow_roots.pop(flow_run, set()) if flow_run else None
        chosen = [(k, r) for k, r in _open_runs.items() if roots is None or r.root in roots]
        for run_id, _ in chosen:
            del _open_runs[run_id]
    return _end(chosen, status)


def end_runs_from(run_id: str, status: str) -> list[str]:
    """End ``run_id`` and the runs opened after it that are still open (those nested in it:
    a stage's iteration runs) with ``status``, the innermost first, as
    :func:`end_open_runs` does."""
    _release_store_frames(sys.exception())
    with _open_guard:
        ids = list(_open_runs)
        chosen = [(k, _open_runs[k]) for k in ids[ids.index(run_id) :]] if run_id in ids else []
        for key, _ in chosen:
            del _open_runs[key]
    return _end(chosen, status)


def ended_status(exc: BaseException) -> str:
    """How a run that ``exc`` stopped ends: FAILED for an error; KILLED for a signal
    (``KeyboardInterrupt``, SIGTERM's exceptions: BaseExceptions, as Prefect's crashes)."""
    return "FAILED" if isinstance(exc, Exception) else "KILLED"


def _end(chosen: list[tuple[str, OpenRun]], status: str) -> list[str]:
    for run_id, run in reversed(chosen):
        with contextlib.suppress(Exception):
            with _open_guard:
                monitor = _monitors.pop(run_id, None)
            if monitor is not None:
                monitor.finish()
        with contextlib.suppress(Exception):
            Shielded(MlflowClient(tracking_uri=run.uri)).set_terminated(run_id, status)
    return [run_id for run_id, _ in chosen]


def _release_store_frames(exc: BaseException | None) -> None:
    """Clear the MLflow and SQLAlchemy frames that ``exc`` (a Ctrl-C or SIGTERM that hit an
    MLflow call outside ``Tracking``, e.g. the model registry) went through: their open
    sqlite cursor would keep the database locked while the exception is handled."""
    cleared, seen = False, set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            name = tb.tb_frame.f_code.co_filename
            if f"{os.sep}sqlalchemy{os.sep}" in name or f"{os.sep}mlflow{os.sep}" in name:
                with contextlib.suppress(RuntimeError):  # a frame still running
                    tb.tb_frame.clear()
                    cleared = True
            tb = tb.tb_next
        exc = exc.__context__
    if cleared:
        import gc

        gc.collect()

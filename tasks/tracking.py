"""MLflow tracking for stages: one parent run per pipeline, one child run per stage.

Uses ``MlflowClient`` with explicit run ids (no fluent, thread-local active run), so a
task can log to its run from whichever Prefect worker thread runs it.

No run is left RUNNING: runs this process opened and has not ended are known
(:func:`end_open_runs` ends them FAILED or KILLED when a pipeline fails or is interrupted),
and every run of a pipeline is tagged with the pid, host and workspace that started it, so
the next pipeline of the same workspace ends the runs of a process that was SIGKILLed
(:meth:`Tracking.end_dead_runs`) and continues its parent run (:meth:`Tracking.start_parent`).

MLflow reads ``MLFLOW_DISABLE_TELEMETRY`` when it is imported: entry points set it first
(flows/env.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import math
import os
import posixpath
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlflow
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient


def config_hash(config) -> str:
    """Short stable hash of a config section: the ``config_hash`` tag, so runs with the same
    settings can be found and grouped (``tags.config_hash = '...'``)."""
    blob = json.dumps(config, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


@functools.lru_cache(maxsize=1)
def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


@dataclass(frozen=True)
class Tracking:
    """Where to log: tracking URI, experiment and the pipeline's parent run (plain strings,
    so it can be passed to Prefect tasks)."""

    uri: str
    experiment_id: str
    parent_run_id: str | None = None
    # tags every run of this pipeline gets: the process and workspace that started it
    run_tags: tuple[tuple[str, str], ...] = ()

    @property
    def client(self) -> MlflowClient:
        return _Shielded(MlflowClient(tracking_uri=self.uri))

    @classmethod
    def open(cls, uri: str, experiment: str) -> Tracking:
        mlflow.set_tracking_uri(uri)
        # the first open of a sqlite store creates its schema: one process at a time, and
        # not cut short by Ctrl-C (a half-done migration leaves the store unusable)
        with store_lock(uri), _store_call(uri):
            client = MlflowClient(tracking_uri=uri)
            exp = client.get_experiment_by_name(experiment)
            exp_id = exp.experiment_id if exp else client.create_experiment(experiment)
        return cls(uri, exp_id)

    def start_parent(
        self,
        run_name: str,
        tags: dict[str, str],
        *,
        params: dict | None = None,
        workspace: str | Path | None = None,
    ) -> Tracking:
        """The pipeline's parent run, with ``params`` logged.

        Given the ``workspace`` (call it while holding the workspace's lock, flows/lock.py):
        RUNNING runs left by a dead process of this workspace are ended KILLED first; then,
        when the last parent run of ``run_name`` in this workspace ended KILLED or FAILED with
        the same ``params``, that run is continued (status RUNNING again, tag
        ``grpo.resumes`` counts the resumes) instead of starting a new one; with other params a
        new parent is tagged ``resumed_from`` with the previous one's id."""
        all_tags = {"git_commit": git_commit(), **tags}
        run_tags = process_tags(workspace) if workspace is not None else {}
        all_tags.update(run_tags)
        if params is not None:
            all_tags[PARAMS_HASH] = config_hash(params)
        previous = None
        if workspace is not None:
            self.end_dead_runs(workspace)
            previous = self._last_parent(run_name, run_tags[WORKSPACE])
        if previous is not None and previous.info.status not in ("KILLED", "FAILED"):
            previous = None  # finished: a rerun is a new run
        client = self.client
        resume = previous is not None and previous.data.tags.get(PARAMS_HASH) == all_tags.get(
            PARAMS_HASH
        )
        if previous is not None and not resume:
            all_tags[RESUMED_FROM] = previous.info.run_id
        with _store_call(self.uri):  # a RUNNING run is known as open (end_open_runs)
            if resume:
                run_id = previous.info.run_id
                client.update_run(run_id, status="RUNNING")
            else:
                run_id = client.create_run(
                    self.experiment_id, run_name=run_name, tags=all_tags
                ).info.run_id
            _opened(run_id, self.uri, run_id, run_name, _current_flow_run())
        if resume:
            resumes = int(previous.data.tags.get(RESUMES, "0")) + 1
            self.log_metric_batch(run_id, [], {**all_tags, RESUMES: str(resumes)})
        elif params is not None:
            self.log_params(run_id, params)
        return Tracking(self.uri, self.experiment_id, run_id, tuple(run_tags.items()))

    def end_dead_runs(self, workspace: str | Path) -> list[str]:
        """End KILLED every RUNNING run, started on this host, of ``workspace`` (whose lock
        this process holds, so no live process of it is logging) or of a process that is
        gone. Returns their ids."""
        workspace = str(Path(workspace).resolve())
        host, me = socket.gethostname(), str(os.getpid())
        ended = []
        for run in self._search_all("attributes.status = 'RUNNING'"):
            t = run.data.tags
            if t.get(HOST) != host or PID not in t or t[PID] == me:
                continue
            if t.get(WORKSPACE) == workspace or not _pid_alive(t[PID]):
                self.client.set_terminated(run.info.run_id, "KILLED")
                ended.append(run.info.run_id)
        return ended

    def _search_all(self, filter_string: str, **kw) -> list:
        client, out, token = self.client, [], None
        while True:
            page = client.search_runs(
                [self.experiment_id], filter_string, max_results=1000, page_token=token, **kw
            )
            out.extend(page)
            token = page.token
            if not token:
                return out

    def _last_parent(self, run_name: str, workspace: str):
        name = run_name.replace("'", "\\'")
        runs = self.client.search_runs(
            [self.experiment_id],
            f"attributes.run_name = '{name}'",
            order_by=["attributes.start_time DESC"],
            max_results=200,
        )
        for run in runs:
            t = run.data.tags
            if "mlflow.parentRunId" not in t and t.get(WORKSPACE) == workspace:
                return run
        return None

    def start_child(
        self,
        stage: str,
        tags: dict[str, str] | None = None,
        *,
        config=None,
        parent_run_id: str | None = None,
        run_name: str | None = None,
    ) -> str:
        """A run nested under the pipeline's parent run (or under ``parent_run_id``), tagged
        with its ``stage``, ``git_commit`` and, given its ``config``, ``config_hash``."""
        all_tags = {"stage": stage, "git_commit": git_commit(), **dict(self.run_tags)}
        all_tags.update(tags or {})
        if config is not None:
            all_tags["config_hash"] = config_hash(config)
        parent = parent_run_id or self.parent_run_id
        if parent:
            all_tags["mlflow.parentRunId"] = parent
        with _store_call(self.uri):  # created and known as open, or neither
            run = self.client.create_run(
                self.experiment_id, run_name=run_name or stage, tags=all_tags
            )
            _opened(run.info.run_id, self.uri, self.parent_run_id or parent, stage)
        return run.info.run_id

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
        self.log_metric_batch(run_id, metric_batch(metrics, step))

    def log_metric_batch(
        self, run_id: str, batch: list[Metric], tags: dict[str, str] | None = None
    ) -> None:
        """``batch`` (and ``tags``, with the first chunk) in as few ``log_batch`` calls as
        MLflow allows: at most 1000 metrics per call."""
        run_tags = [RunTag(safe_key(k), str(v)) for k, v in (tags or {}).items()]
        for i in range(0, max(len(batch), 1 if run_tags else 0), 900):
            self.client.log_batch(
                run_id, metrics=batch[i : i + 900], tags=run_tags if i == 0 else []
            )

    def pending(self, run_id: str) -> PendingMetrics:
        return PendingMetrics(self, run_id)

    def log_params(self, run_id: str, params: dict) -> None:
        flat = [Param(k, str(v)[:6000]) for k, v in _safe_params(_flatten(params)).items()]
        for i in range(0, len(flat), 90):
            self.client.log_batch(run_id, params=flat[i : i + 90])

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        self.log_metric_batch(run_id, [], tags)

    def log_artifact(self, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, str(path), artifact_path)

    def log_text(self, run_id: str, text: str, name: str) -> None:
        """Write ``text`` as artifact ``name`` (which may contain folders, e.g. ``samples/a.json``)."""
        folder, _, base = name.rpartition("/")
        with tempfile.TemporaryDirectory() as d:
            p = Path(d) / base
            p.write_text(text)
            self.client.log_artifact(run_id, str(p), folder or None)

    def log_json(self, run_id: str, obj, name: str) -> None:
        self.log_text(run_id, json.dumps(obj, indent=2, default=str), name)

    def end(self, run_id: str, status: str = "FINISHED") -> None:
        with _store_call(self.uri):
            self.client.set_terminated(run_id, status)
            with _open_guard:
                _open_runs.pop(run_id, None)


# Tags on every run of a pipeline (Tracking.run_tags) and on its parent run.
PID, HOST, WORKSPACE = "grpo.pid", "grpo.host", "grpo.workspace"
PARAMS_HASH, RESUMES, RESUMED_FROM = "grpo.params_hash", "grpo.resumes", "resumed_from"


@contextlib.contextmanager
def signals_deferred():
    """Hold Ctrl-C and SIGTERM until the block ends (main thread; elsewhere Python runs no
    signal handler anyway), then deliver them to the handlers that were there (Python's,
    Prefect's or the CLI's). The same signal a second time is not held. A signal landing
    inside a sqlite write would leave the interrupted statement open, and its lock held,
    until its traceback is freed: the runs could then not be ended KILLED."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    saved = {}

    def hold(num: int, frame) -> None:
        if num not in pending:
            pending.append(num)
            return
        pending.remove(num)  # twice: stop waiting
        handler = saved[num]
        if callable(handler):
            handler(num, frame)
        elif handler == signal.SIG_DFL:
            signal.signal(num, signal.SIG_DFL)
            os.kill(os.getpid(), num)

    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not None:  # None: installed outside Python, left alone
            saved[sig] = signal.signal(sig, hold)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        for sig in pending:
            os.kill(os.getpid(), sig)


def _store_call(uri: str):
    """:func:`signals_deferred` around a call to a sqlite store; nothing for a tracking
    server (an interrupted HTTP request holds no lock, and a dead server's retries must stay
    interruptible)."""
    return signals_deferred() if uri.startswith("sqlite:") else contextlib.nullcontext()


class _Shielded:
    """An ``MlflowClient`` whose calls run with :func:`signals_deferred` (sqlite stores)."""

    def __init__(self, client: MlflowClient) -> None:
        self._client = client
        self._uri = client.tracking_uri

    def __getattr__(self, name: str):
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        @functools.wraps(attr)
        def call(*args, **kwargs):
            with _store_call(self._uri):
                return attr(*args, **kwargs)

        return call


def process_tags(workspace: str | Path) -> dict[str, str]:
    return {
        PID: str(os.getpid()),
        HOST: socket.gethostname(),
        WORKSPACE: str(Path(workspace).resolve()),
    }


def _pid_alive(pid: str) -> bool:
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


def _current_flow_run() -> str | None:
    try:
        from prefect.context import FlowRunContext

        ctx = FlowRunContext.get()
    except ImportError:
        return None
    return str(ctx.flow_run.id) if ctx and ctx.flow_run else None


def _opened(
    run_id: str, uri: str, root: str | None, stage: str, flow_run: str | None = None
) -> None:
    with _open_guard:
        _open_runs[run_id] = OpenRun(uri, root or run_id, stage)
        if flow_run:
            _flow_roots.setdefault(flow_run, set()).add(run_id)


def open_runs() -> dict[str, OpenRun]:
    """The runs this process started and has not ended, oldest first."""
    with _open_guard:
        return dict(_open_runs)


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
    for run_id, run in reversed(chosen):
        with contextlib.suppress(Exception):
            _Shielded(MlflowClient(tracking_uri=run.uri)).set_terminated(run_id, status)
    return [run_id for run_id, _ in chosen]


def _release_store_frames(exc: BaseException | None) -> None:
    """Clear the MLflow and SQLAlchemy frames that ``exc`` (a Ctrl-C or SIGTERM that hit an
    MLflow call outside :class:`Tracking`, e.g. the model registry) went through: their open
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


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` tracking URI; None for any other store."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        return None
    rest = uri[len(prefix) :].split("?", 1)[0]
    return Path(rest) if rest and rest != ":memory:" else None


@contextlib.contextmanager
def store_lock(uri: str):
    """Hold ``<db>.lock`` (``flock``, blocking) while a sqlite store is opened: MLflow creates
    or migrates the schema on the first open, and two processes doing that at once fail on
    "table already exists" and can leave the migration half done. Other stores: no lock (a
    tracking server does its own schema work once)."""
    db = sqlite_path(uri)
    if db is None:
        yield
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(db.with_name(db.name + ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the only descriptor drops the lock


_KEY_CHARS = re.compile(r"[^/\w.\- :]")  # what MLflow accepts in a metric/param/tag key
MAX_KEY_LENGTH = 250


@functools.lru_cache(maxsize=4096)
def safe_key(key: str) -> str:
    """``key`` as a name MLflow accepts for a metric, parameter or tag: the one place keys are
    made safe. A reward given as ``/abs/path/file.py:fn`` makes ``rewards//abs/path/...``,
    which MLflow refuses (a name must not change under path normalisation); other characters
    it refuses become ``_``, empty, ``.`` and ``..`` path segments are dropped or escaped,
    and a key over 250 characters keeps its ends around a hash."""
    if (
        _KEY_CHARS.search(key) is None
        and posixpath.normpath(key) == key
        and not key.startswith(("/", ".."))
        and key != "."
        and len(key) <= MAX_KEY_LENGTH
    ):
        return key
    segments = [s for s in _KEY_CHARS.sub("_", key).split("/") if s not in ("", ".")]
    safe = "/".join("__" if s == ".." else s for s in segments) or "_"
    if len(safe) > MAX_KEY_LENGTH:
        digest = hashlib.sha256(key.encode()).hexdigest()[:8]
        safe = f"{safe[:120]}_{digest}_{safe[-120:]}"
    return safe


def _safe_params(flat: dict) -> dict:
    """Parameters under safe keys; a renamed key is kept, in full, as the value of
    ``<safe key>.key`` (e.g. a reward's file path)."""
    out = {}
    for k, v in flat.items():
        safe = safe_key(k)
        out[safe] = v
        if safe != k:
            out[safe_key(f"{safe}.key")] = k
    return out


def metric_batch(metrics: dict[str, float], step: int) -> list[Metric]:
    """MLflow metrics at ``step`` under safe keys (:func:`safe_key`); non-numeric and
    non-finite values are left out."""
    ts = int(time.time() * 1000)
    return [
        Metric(safe_key(k), float(v), ts, step)
        for k, v in metrics.items()
        if isinstance(v, int | float) and math.isfinite(float(v))
    ]


@dataclass
class PendingMetrics:
    """Metrics gathered for one run and sent in one ``log_batch`` call by :meth:`flush`
    (a cached RL iteration replays ~6 logging calls; 45 of them cost seconds on sqlite)."""

    tracking: Tracking
    run_id: str
    batch: list[Metric] = field(default_factory=list)

    def add(self, metrics: dict[str, float], step: int = 0) -> None:
        self.batch.extend(metric_batch(metrics, step))

    def flush(self, tags: dict[str, str] | None = None) -> None:
        """Send the gathered metrics (and ``tags``) in one call."""
        self.tracking.log_metric_batch(self.run_id, self.batch, tags)
        self.batch = []


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out

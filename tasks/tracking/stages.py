"""MLflow tracking for stages: one parent run per pipeline, one child run per stage, and
the helpers that log metrics, parameters and tags under keys MLflow accepts.

Uses ``MlflowClient`` with explicit run ids (no fluent, thread-local active run), so a
task can log to its run from whichever Prefect worker thread runs it.

No run is left RUNNING: every run :class:`Tracking` opens is registered as open until it is
ended (tasks/tracking/run_states.py: ``end_open_runs`` ends them FAILED or KILLED when a pipeline
fails or is interrupted), and every run of a pipeline is tagged with the pid, host and
workspace that started it, so the next pipeline of the same workspace ends the runs of a
process that was SIGKILLed (:meth:`Tracking.end_dead_runs`) and continues its parent run
(:meth:`Tracking.start_parent`). Calls to a sqlite store run with Ctrl-C and SIGTERM held
(tasks/tracking/store.py).

MLflow reads ``MLFLOW_DISABLE_TELEMETRY`` when it is imported: entry points set it first
(flows/env.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlflow
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from tasks.tracking.keys import flatten, metric_batch, safe_key, safe_params
from tasks.tracking.run_states import (
    HOST,
    PID,
    WORKSPACE,
    closed,
    current_flow_run,
    opened,
    pid_alive,
    process_tags,
    start_system_metrics,
    stop_system_metrics,
)
from tasks.tracking.store import Shielded, store_call, store_lock


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


# MLflow 3 opens an experiment tagged so on its runs table ("Model training"), not on the
# GenAI traces view (the UI's ExperimentKind.CUSTOM_MODEL_DEVELOPMENT).
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
SOURCE_NAME = "grpo-pipeline"  # the runs' "Source" column, with the git commit


def source_tags() -> dict[str, str]:
    """MLflow's standard source tags: what the UI shows in the "Source" column."""
    tags = {"mlflow.source.name": SOURCE_NAME, "mlflow.source.type": "LOCAL"}
    if git_commit() != "unknown":
        tags["mlflow.source.git.commit"] = git_commit()
    return tags


# MLflow 3's UI remembers one "workflow type" per browser and starts in GenAI mode (trace
# overview, "Evaluations" tabs, no model registry in the sidebar) whatever the experiment's
# kind tag says; a URL that carries ``workflowType=machine_learning`` opens the runs table and
# the run pages of model training (the home page and bare URLs stay in the remembered mode).
UI_MODE = "workflowType=machine_learning"


def experiment_url(uri: str, experiment_id: str) -> str | None:
    """``uri``'s UI page of the experiment's runs table, in model-training mode; None for a
    store without a UI server (sqlite file, folder)."""
    if not uri.startswith(("http://", "https://")):
        return None
    return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs?{UI_MODE}"


def run_url(uri: str, experiment_id: str, run_id: str, tab: str = "") -> str | None:
    """The run's page (``#/experiments/<id>/runs/<run id>[/<tab>]``), in model-training mode."""
    if not uri.startswith(("http://", "https://")):
        return None
    tab = f"/{tab.strip('/')}" if tab else ""
    return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}{tab}?{UI_MODE}"


TRACKING_ENV = "MLFLOW_TRACKING_URI"


def _set_global_uri(uri: str) -> None:
    """Point mlflow's fluent API (system metrics, ``log_table``) at ``uri`` without
    ``MLFLOW_TRACKING_URI`` changing: ``mlflow.set_tracking_uri`` also writes that variable,
    which would make it the choice of every later run in this process (a ``grpo serve``
    worker, a notebook), ahead of their own default (flows/config.py)."""
    before = os.environ.get(TRACKING_ENV)
    mlflow.set_tracking_uri(uri)
    if before is None:
        os.environ.pop(TRACKING_ENV, None)
    else:
        os.environ[TRACKING_ENV] = before


@dataclass(frozen=True)
class Tracking:
    """Where to log: tracking URI, experiment and the pipeline's parent run (plain strings,
    so it can be passed to Prefect tasks). ``run_name`` (the pipeline's) ends every
    child run's name: ``rl_1 (demo)``. Stages named in ``system_metrics`` record CPU, memory
    (and GPU, with pynvml) as ``system/*`` metrics while their run is open."""

    uri: str
    experiment_id: str
    parent_run_id: str | None = None
    # tags every run of this pipeline gets: the process and workspace that started it
    run_tags: tuple[tuple[str, str], ...] = ()
    run_name: str = ""
    system_metrics: tuple[str, ...] = ()

    @property
    def client(self) -> MlflowClient:
        return Shielded(MlflowClient(tracking_uri=self.uri))

    @classmethod
    def open(cls, uri: str, experiment: str) -> Tracking:
        _set_global_uri(uri)
        # the first open of a sqlite store creates its schema: one process at a time, and
        # not cut short by Ctrl-C (a half-done migration leaves the store unusable)
        with store_lock(uri), store_call(uri):
            client = MlflowClient(tracking_uri=uri)
            exp = client.get_experiment_by_name(experiment)
            if exp is None:
                exp_id = client.create_experiment(experiment, tags=dict([EXPERIMENT_KIND]))
            else:
                exp_id = exp.experiment_id
                if exp.tags.get(EXPERIMENT_KIND[0]) != EXPERIMENT_KIND[1]:
                    client.set_experiment_tag(exp_id, *EXPERIMENT_KIND)
        return cls(uri, exp_id)

    def start_parent(
        self,
        run_name: str,
        tags: dict[str, str],
        *,
        params: dict | None = None,
        workspace: str | Path | None = None,
        system_metrics: tuple[str, ...] = (),
    ) -> Tracking:
        """The pipeline's parent run, with ``params`` logged.

        Given the ``workspace`` (call it while holding the workspace's lock, flows/lock.py):
        RUNNING runs left by a dead process of this workspace are ended KILLED first; then,
        when the last parent run of ``run_name`` in this workspace ended KILLED or FAILED with
        the same ``params``, that run is continued (status RUNNING again, tag
        ``grpo.resumes`` counts the resumes) instead of starting a new one; with other params a
        new parent is tagged ``resumed_from`` with the previous one's id."""
        all_tags = {**source_tags(), **tags}
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
        with store_call(self.uri):  # a RUNNING run is known as open (end_open_runs)
            if resume:
                run_id = previous.info.run_id
                reopen(self.uri, run_id)
            else:
                run_id = client.create_run(
                    self.experiment_id, run_name=run_name, tags=all_tags
                ).info.run_id
            opened(run_id, self.uri, run_id, run_name, current_flow_run())
        if resume:
            resumes = int(previous.data.tags.get(RESUMES, "0")) + 1
            self.log_metric_batch(run_id, [], {**all_tags, RESUMES: str(resumes)})
        elif params is not None:
            self.log_params(run_id, params)
        return Tracking(
            self.uri,
            self.experiment_id,
            run_id,
            tuple(run_tags.items()),
            run_name,
            tuple(system_metrics),
        )

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
            if t.get(WORKSPACE) == workspace or not pid_alive(t[PID]):
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
        """A run nested under the pipeline's parent run (or under ``parent_run_id``), named
        ``<stage> (<pipeline run name>)`` (or ``run_name``), tagged with its ``stage``, MLflow's
        source tags and, given its ``config``, ``config_hash``."""
        all_tags = {"stage": stage, **source_tags(), **dict(self.run_tags)}
        all_tags.update(tags or {})
        if config is not None:
            all_tags["config_hash"] = config_hash(config)
        parent = parent_run_id or self.parent_run_id
        if parent:
            all_tags["mlflow.parentRunId"] = parent
        with store_call(self.uri):  # created and known as open, or neither
            run = self.client.create_run(
                self.experiment_id, run_name=run_name or self.child_name(stage), tags=all_tags
            )
            opened(run.info.run_id, self.uri, self.parent_run_id or parent, stage)
        if stage in self.system_metrics and parent_run_id is None:
            start_system_metrics(run.info.run_id, self.uri)
        return run.info.run_id

    def child_name(self, stage: str, detail: str = "") -> str:
        """``<stage>[ <detail>] (<pipeline run name>)``: ``rl_1 (demo)``, ``rl_1 it 0-4 (demo)``.
        The stage comes first: the runs table cuts long names at its column's width."""
        name = f"{stage} {detail}" if detail else stage
        return f"{name} ({self.run_name})" if self.run_name else name

    def experiment_url(self) -> str | None:
        """The experiment's runs table in the MLflow UI (tracking servers only)."""
        return experiment_url(self.uri, self.experiment_id)

    def run_url(self, run_id: str, tab: str = "") -> str | None:
        """The run's page in the MLflow UI (``tab``: ``model-metrics``, ``artifacts/<path>``)."""
        return run_url(self.uri, self.experiment_id, run_id, tab)

    def log_table(self, run_id: str, rows: list[dict], name: str) -> None:
        """``rows`` as an MLflow table artifact ``name`` (``.json``): the UI pages through it
        (artifact view, and the evaluation view's table). Values that are not plain scalars
        (chat messages, lists) become JSON text."""
        if not rows:
            return
        columns: dict[str, list] = {k: [] for k in rows[0]}
        for row in rows:
            for k in columns:
                v = row.get(k)
                if not (v is None or isinstance(v, str | int | float | bool)):
                    v = json.dumps(v, default=str)
                columns[k].append(v)
        self.client.log_table(run_id, columns, name)

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
        flat = [Param(k, str(v)[:6000]) for k, v in safe_params(flatten(params)).items()]
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
        stop_system_metrics(run_id)
        with store_call(self.uri):
            self.client.set_terminated(run_id, status)
            closed(run_id)


def reopen(uri: str, run_id: str) -> None:
    """Mark an ended run RUNNING again, with no end time: the UI shows a continued run as it
    shows a new one (no duration), not the killed attempt's end (``MlflowClient.update_run``
    cannot clear it, and ``set_terminated`` turns an end time of 0 into now)."""
    from mlflow.entities import RunStatus

    store = MlflowClient(tracking_uri=uri)._tracking_client.store
    store.update_run_info(run_id, RunStatus.RUNNING, end_time=0, run_name=None)


# Tags on a pipeline's parent run (besides run_states.PID, HOST and WORKSPACE).
PARAMS_HASH, RESUMES, RESUMED_FROM = "grpo.params_hash", "grpo.resumes", "resumed_from"


@dataclass
class PendingMetrics:
    """Metrics gathered for one run and sent in one ``log_batch`` call by :meth:`flush`
    (a cached RL iteration replays ~6 logging calls; 45 of them cost seconds on sqlite)."""

    tracking: Tracking
    run_id: str
    batch: list[Metric] = field(default_factory=list)
    last_flush: float = field(default_factory=time.monotonic)

    def add(self, metrics: dict[str, float], step: int = 0) -> None:
        self.batch.extend(metric_batch(metrics, step))

    def flush(self, tags: dict[str, str] | None = None) -> None:
        """Send the gathered metrics (and ``tags``) in one call."""
        self.tracking.log_metric_batch(self.run_id, self.batch, tags)
        self.batch = []
        self.last_flush = time.monotonic()

    def flush_every(self, seconds: float) -> None:
        """:meth:`flush` if the last one is at least ``seconds`` old: live curves at a
        bounded cost (one sqlite ``log_batch`` is tens of milliseconds on 2 cores)."""
        if self.batch and time.monotonic() - self.last_flush >= seconds:
            self.flush()

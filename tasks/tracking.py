"""MLflow tracking for stages: one parent run per pipeline, one child run per stage.

Uses ``MlflowClient`` with explicit run ids (no fluent, thread-local active run), so a
task can log to its run from whichever Prefect worker thread runs it.

MLflow reads ``MLFLOW_DISABLE_TELEMETRY`` when it is imported: entry points set it first
(flows/env.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import posixpath
import re
import subprocess
import tempfile
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

    @property
    def client(self) -> MlflowClient:
        return MlflowClient(tracking_uri=self.uri)

    @classmethod
    def open(cls, uri: str, experiment: str) -> Tracking:
        mlflow.set_tracking_uri(uri)
        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp else client.create_experiment(experiment)
        return cls(uri, exp_id)

    def start_parent(self, run_name: str, tags: dict[str, str]) -> Tracking:
        run = self.client.create_run(
            self.experiment_id, run_name=run_name, tags={"git_commit": git_commit(), **tags}
        )
        return Tracking(self.uri, self.experiment_id, run.info.run_id)

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
        all_tags = {"stage": stage, "git_commit": git_commit(), **(tags or {})}
        if config is not None:
            all_tags["config_hash"] = config_hash(config)
        parent = parent_run_id or self.parent_run_id
        if parent:
            all_tags["mlflow.parentRunId"] = parent
        run = self.client.create_run(self.experiment_id, run_name=run_name or stage, tags=all_tags)
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
        self.client.set_terminated(run_id, status)


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

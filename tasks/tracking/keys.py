"""Metric, parameter and tag keys in the form MLflow accepts, and metrics and parameters
in the form MLflow logs them (:func:`metric_batch`, :func:`flatten`, :func:`safe_params`).

Every key logged through ``Tracking`` (tasks/tracking/stages.py) goes through :func:`safe_key`.
"""

from __future__ import annotations

import functools
import hashlib
import math
import posixpath
import re
import time

from mlflow.entities import Metric

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


def safe_params(flat: dict) -> dict:
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


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out

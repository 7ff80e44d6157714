"""Content-addressed stage cache (docs/architecture.md, "Cache keys").

A stage's key is the hash of: its config section, the content hashes of its input files,
and the code version (a hash of the grpo_core and tasks sources, the code that computes a
stage's outputs; flows/ only wires stages together and passes every input explicitly, so
editing the CLI or the orchestration does not invalidate finished stages). After a stage
writes its outputs it records ``{key, result}`` in a manifest beside them; a later run with
the same key whose outputs still exist returns the recorded result instead of recomputing.
``force`` reruns regardless. Manifests are written atomically, after the outputs.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from grpo_core.checkpoint import file_sha256, policy_id
from grpo_core.io import write_json

_PACKAGES = ("grpo_core", "tasks")


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """Hash of the Python sources of the pipeline packages (works without git)."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for pkg in _PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=256)
def _file_hash(path: str, size: int, mtime_ns: int) -> str:
    return file_sha256(path)


def content_hash(path: str | Path) -> str:
    """Weights hash for a checkpoint directory, sha256 for a file (memoised on size+mtime)."""
    p = Path(path)
    if p.is_dir():
        return policy_id(p)
    st = p.stat()
    return _file_hash(str(p), st.st_size, st.st_mtime_ns)


def stage_key(stage: str, config: dict[str, Any], inputs: list[str | Path]) -> str:
    blob = json.dumps(
        {
            "stage": stage,
            "config": config,
            "inputs": [content_hash(p) for p in inputs],
            "code": code_version(),
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def manifest_path(output: str | Path) -> Path:
    p = Path(output)
    return p.with_name(f"{p.name}.stage.json")


def lookup(output: str | Path, key: str, *, outputs: list[str | Path] | None = None) -> dict | None:
    """The recorded result if ``output``'s manifest has ``key`` and the outputs exist."""
    m = manifest_path(output)
    if not m.exists():
        return None
    try:
        record = json.loads(m.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if record.get("key") != key:
        return None
    if not all(Path(p).exists() for p in [output, *(outputs or [])]):
        return None
    return record["result"]


def record(output: str | Path, key: str, result: dict) -> None:
    write_json(
        {"key": key, "code_version": code_version(), "result": result}, manifest_path(output)
    )


def cached(
    label: str,
    output: str | Path,
    key: str,
    compute,
    *,
    force: bool = False,
    outputs: list[str | Path] | None = None,
):
    """Return the recorded result for ``key`` or run ``compute()`` and record its result.

    ``compute`` returns a dataclass with a ``cached`` field (tasks/results.py), or a dict;
    the result says ``cached=True|False`` so flows and logs can say what ran. Fields marked
    ``NOT_RECORDED`` are not recorded; a hit rebuilds them with their defaults.
    """
    from tasks.common import logger

    if not force:
        hit = lookup(output, key, outputs=outputs)
        if hit is not None:
            logger(__name__).info("%s: inputs unchanged (key %s), reusing %s", label, key, output)
            return _with_cached(hit, True)
    result = compute()
    typed = dataclasses.is_dataclass(result)
    body = _record_body(result) if typed else result
    record(output, key, {"type": type(result).__name__, **body} if typed else body)
    return dataclasses.replace(result, cached=False) if typed else {**result, "cached": False}


def _record_body(result) -> dict:
    """The dataclass as recorded: without ``cached`` and the fields marked not to record
    (``tasks.results.NOT_RECORDED``: the MLflow run id), which a hit rebuilds as defaults."""
    skip = {"cached"} | {
        f.name for f in dataclasses.fields(result) if f.metadata.get("record", True) is False
    }
    return {k: v for k, v in dataclasses.asdict(result).items() if k not in skip}


def _with_cached(hit: dict, cached_: bool):
    from tasks import results

    kind = hit.get("type")
    if kind is None:
        return {**hit, "cached": cached_}
    cls = getattr(results, kind)
    return cls(**{k: v for k, v in hit.items() if k != "type"}, cached=cached_)

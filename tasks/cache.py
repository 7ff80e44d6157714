"""Content-addressed stage cache (docs/architecture.md, "Cache keys").

A stage's key is the hash of: its config section, the content hashes of its input files,
and the code version (a hash of the grpo_core, tasks and cluster sources, the code that
computes a stage's outputs, cluster/ included: its shard seeds and placement change what
a Ray run samples; flows/ only wires stages together and passes every input explicitly, so
editing the CLI or the orchestration does not invalidate finished stages). After a stage
writes its outputs it records ``{key, result}`` in a manifest beside them; a later run with
the same key returns the recorded result instead of recomputing, once each output is
verified: the manifest holds every output's sha256 with its size and modification time (per
model file for a checkpoint directory); equal size and mtime -> trusted without reading it,
otherwise it is hashed: the same hash -> reused (and the stamp refreshed), another hash or a
missing output -> recomputed, with one log line that says why. ``force`` reruns regardless.
Manifests are written atomically, after the outputs.

With ``storage.url`` set (cluster/storage.py), a record is also uploaded to the shared store
(outputs, then the manifest), and a lookup that finds no manifest here reads the store's and,
on the same key, downloads the outputs and verifies them as above.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from cluster import storage
from grpo_core.contracts.io import atomic_path, write_json
from grpo_core.contracts.run_folder import localised, portable, run_root
from grpo_core.training.checkpoint import checkpoint_sha256, checkpoint_stamp, memo_sha256

_PACKAGES = ("grpo_core", "tasks", "cluster")
# How outputs were verified on lookups in this process: by size + mtime alone, or by hashing
STATS = {"stamp_hits": 0, "hash_checks": 0}


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


def content_hash(path: str | Path) -> str:
    """Weights hash for a checkpoint directory (its verified ``policy_id``) or an RL
    iteration's policy record (tasks/policies/ref.py: the hash it recorded), sha256 for a file
    (memoised in the process on the file's identity, size and mtime)."""
    from tasks.policies import ref as policy_ref

    p = Path(path)
    if p.is_dir() or policy_ref.is_ref(p):
        return policy_ref.policy_id(p)
    return memo_sha256(p)


def user_code(names) -> dict[str, str]:
    """``{name: sha256}`` of the source file behind each user function a stage runs
    (``module:function`` or ``path/file.py:function``: an environment, a reward): editing
    it changes the stage's key, as editing the pipeline's own code does. Registered names
    (no ``:``) are the pipeline's code. Only the file that defines the function is hashed,
    not what it imports. A name that cannot be found keys as ``unresolved``."""
    out = {}
    for name in sorted({n for n in names if isinstance(n, str) and ":" in n}):
        path = _source_file(name.rsplit(":", 1)[0])
        out[name] = memo_sha256(path) if path is not None else "unresolved"
    return out


def tool_code(tools) -> tuple:
    """The user code of an environment (a ``ToolSpec``, or its fields): its environment and
    function tools, by name (:func:`user_code`)."""
    from grpo_core.config.tools import tool_spec_of

    tools = tool_spec_of(tools)
    if tools is None:
        return ()
    return (*tools.tools, *tools.functions, *(spec for _, spec in tools.environment_factory))


def _source_file(module: str) -> Path | None:
    import importlib.util

    if module.endswith(".py"):
        p = Path(module)
        return p if p.is_file() else None
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    origin = getattr(spec, "origin", None)
    return Path(origin) if origin and Path(origin).is_file() else None


def stage_key(
    stage: str, config: dict[str, Any], inputs: list[str | Path], *, code: tuple = ()
) -> str:
    """``code``: the user functions (environments, rewards) the stage runs, by name
    (:func:`user_code`)."""
    from tasks.policies import loading  # how policies are loaded (model.dtype, lora, ...)

    model = loading.options_key()
    users = user_code(code)
    blob = json.dumps(
        {
            "stage": stage,
            "config": config,
            "inputs": [content_hash(p) for p in inputs],
            "code": code_version(),
            **({"model": model} if model is not None else {}),
            **({"user_code": users} if users else {}),
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def manifest_path(output: str | Path) -> Path:
    p = Path(output)
    return p.with_name(f"{p.name}.stage.json")


def output_stamp(path: str | Path) -> dict | None:
    """What is checked without reading an output: ``{size, mtime_ns, ctime_ns}`` of a file,
    ``{files: {name: [size, mtime_ns, ctime_ns]}}`` of a checkpoint's model files; None if
    missing. The inode change time cannot be set back by a user (``touch -r`` restores the
    mtime, not the ctime), so an edit followed by a restored mtime is hashed, not trusted; a
    copy (``cp -a``) is hashed once, then trusted by its new stamp."""
    p = Path(path)
    if p.is_dir():
        return {"files": checkpoint_stamp(p)}
    if p.is_file():
        st = p.stat()
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}
    return None


def output_sha256(path: str | Path) -> str:
    """sha256 of a file, or of a checkpoint directory's model files (weights, config,
    tokenizer: ``grpo_core.training.checkpoint.checkpoint_sha256``)."""
    p = Path(path)
    return checkpoint_sha256(p) if p.is_dir() else memo_sha256(p)


def fingerprint(path: str | Path) -> dict:
    """The manifest entry of an output: its stamp and its sha256."""
    stamp = output_stamp(path)
    if stamp is None:
        raise FileNotFoundError(f"{path}: the stage did not write this output")
    return {**stamp, "sha256": output_sha256(path)}


def _name(path: str | Path, manifest: Path) -> str:
    """An output's name in the manifest: relative to the manifest's folder, so a moved run
    folder keeps its manifests."""
    folder, name = os.path.split(os.fspath(path))
    here = os.fspath(manifest.parent)
    return name if folder == here else os.path.relpath(path, here)


def verify(path: str | Path, entry: dict | None, name: str) -> tuple[dict | None, str | None]:
    """``(entry to record, None)`` when ``path`` still has the content ``entry`` records,
    else ``(None, why not)``. Equal stamps are trusted without reading the output; different
    ones cost a hash, and an equal hash returns the refreshed entry."""
    now = output_stamp(path)
    if now is None:
        return None, f"{name} is missing"
    if not entry or "sha256" not in entry:
        return None, f"{name} has no content hash in its manifest"
    if now == {k: v for k, v in entry.items() if k != "sha256"}:
        STATS["stamp_hits"] += 1
        return entry, None
    STATS["hash_checks"] += 1
    digest = output_sha256(path)
    if digest != entry["sha256"]:
        return None, (
            f"{name} changed since it was written "
            f"(sha256 {entry['sha256'][:12]}, now {digest[:12]})"
        )
    return {**now, "sha256": digest}, None


def _check(
    output: str | Path, key: str, outputs: list[str | Path] | None
) -> tuple[dict | None, str | None]:
    """``(recorded result, None)`` on a verified hit; ``(None, why)`` when an output fails
    verification; ``(None, None)`` when there is no usable record for ``key``."""
    m = manifest_path(output)
    pulled = not m.exists() and _pull_record(m, key, [output, *(outputs or [])])
    if not m.exists():
        return None, None
    try:
        record_ = _read_record(m.read_text(), key)
    except OSError:
        return None, None
    if record_ is None:
        return None, None
    recorded = record_.get("outputs") or {}
    checked, refreshed = {}, False
    for p in [output, *(outputs or [])]:
        name = _name(p, m)
        entry, why = verify(p, recorded.get(name), name)
        if entry is None:
            return None, why
        checked[name] = entry
        refreshed |= entry is not recorded.get(name)
    if refreshed:  # same bytes, new stamp (a copy, a touch): check by stamp next time
        with contextlib.suppress(OSError):  # a read-only run folder: hashed again next time
            write_json({**record_, "outputs": checked}, m)
    if not pulled:  # a record just downloaded is in the store
        _ensure_published(m, key, [output, *(outputs or [])])
    return localised(record_["result"], run_root(m)), None


def _read_record(text: str | None, key: str) -> dict | None:
    """A manifest's record when it is one for ``key``."""
    try:
        record_ = json.loads(text) if text else None
    except json.JSONDecodeError:
        return None
    if not isinstance(record_, dict) or record_.get("key") != key or "result" not in record_:
        return None
    return record_


def _pull_record(m: Path, key: str, paths: list[str | Path]) -> bool:
    """With a shared store: its manifest for ``key`` and the outputs this machine lacks,
    downloaded (then verified by the caller like any local output). False when the store has
    no record for ``key``."""
    store = storage.active()
    text = store.read_text(m) if store is not None else None
    if _read_record(text, key) is None:
        return False
    from tasks.run_log import logger

    log = logger(__name__)
    for p in paths:
        if store.pull(p):
            log.info("pulled %s from %s", p, store.url_of(p))
    with atomic_path(m) as tmp:  # the manifest as read, after its outputs
        tmp.write_text(text)
    return True


def _ensure_published(m: Path, key: str, paths: list[str | Path]) -> None:
    """A local hit whose record the shared store lacks (an upload that failed, a store
    added later): upload it now, so other machines find it."""
    store = storage.active()
    if store is None:
        return
    if _read_record(store.read_text(m), key) is None:
        storage.publish(*paths, m)


def lookup(output: str | Path, key: str, *, outputs: list[str | Path] | None = None) -> dict | None:
    """The recorded result if ``output``'s manifest has ``key`` and every output still has
    the content recorded there (:func:`verify`)."""
    return _check(output, key, outputs)[0]


def record(
    output: str | Path, key: str, result: dict, *, outputs: list[str | Path] | None = None
) -> None:
    m = manifest_path(output)
    paths = [output, *(outputs or [])]
    write_json(
        {
            "key": key,
            "code_version": code_version(),
            "result": portable(result, run_root(m)),
            "outputs": {_name(p, m): fingerprint(p) for p in paths},
        },
        m,
    )
    storage.publish(*paths, m)  # with a shared store: outputs first, the manifest last


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

    ``output`` and ``outputs`` are everything the stage writes (files or checkpoint
    directories); each is verified before reuse (:func:`verify`) and a failed check is
    logged (``"<label>: <output> changed since it was written (...), recomputing"``).
    ``compute`` returns a dataclass with a ``cached`` field (tasks/results.py), or a dict;
    the result says ``cached=True|False`` so flows and logs can say what ran. Fields marked
    ``NOT_RECORDED`` are not recorded; a hit rebuilds them with their defaults.
    """
    from tasks.run_log import logger

    if not force:
        hit, why = _check(output, key, outputs)
        if hit is not None:
            logger(__name__).info("%s: inputs unchanged (key %s), reusing %s", label, key, output)
            return _with_cached(hit, True)
        if why:
            logger(__name__).warning("%s: %s, recomputing", label, why)
    result = compute()
    typed = dataclasses.is_dataclass(result)
    body = _record_body(result) if typed else result
    record(output, key, {"type": type(result).__name__, **body} if typed else body, outputs=outputs)
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

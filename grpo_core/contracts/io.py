"""Atomic file output: write to a temporary name beside the target, then rename into place.

A stage killed mid-write leaves the previous file (or nothing), never half a file.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


@contextmanager
def atomic_path(target: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``target``; rename it onto ``target`` on success.

    Works for files and directories. On error the temporary is removed and ``target``
    is left as it was.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    _sweep_interrupted(target)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"  # the pid: a later writer sees it is gone
    tmp = target.with_name(f".{target.name}.tmp-{tag}")
    try:
        yield tmp
        if target.is_dir() and tmp.is_dir():
            old = target.with_name(f".{target.name}.old-{tag}")
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()


def _sweep_interrupted(target: Path) -> None:
    """Leftovers of writes of ``target`` by processes that were killed (SIGKILL runs no
    ``finally``): their temporaries are removed; a previous version moved aside just before a
    kill (``.old-``) is put back first when ``target`` itself is missing, so nothing already
    written is lost. Only names with a pid that no longer runs are touched."""
    prefix = f".{target.name}."
    try:
        names = os.listdir(target.parent)
    except OSError:
        return
    for name in sorted(names, key=lambda n: ".old-" not in n):  # a moved-aside version first
        if not name.startswith(prefix):
            continue
        kind, _, tag = name[len(prefix) :].partition("-")
        pid = tag.split("-", 1)[0]
        if kind not in ("tmp", "old") or not pid.isdigit() or os.path.exists(f"/proc/{pid}"):
            continue
        path = target.parent / name
        if kind == "old" and not target.exists():
            os.replace(path, target)
        elif path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def link_tree(src: str | Path, dst: str | Path) -> Path:
    """``dst`` as a copy of the directory ``src`` whose files are hard links to ``src``'s
    (a real copy where a link cannot be made: another file system, no link support).

    Only for trees whose files are never modified in place (checkpoints: every file is
    written once, through :func:`atomic_path`), so the two names can share one file: a
    stage's final checkpoint costs no copy of the weights and optimizer state."""

    def link_or_copy(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(src, dst, copy_function=link_or_copy)
    return Path(dst)


def write_parquet(table: pa.Table, path: str | Path) -> Path:
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
    return Path(path)


def write_json(obj, path: str | Path) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str))
    return Path(path)


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return Path(path)

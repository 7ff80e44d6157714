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
    tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        yield tmp
        if target.is_dir() and tmp.is_dir():
            old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
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

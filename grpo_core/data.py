"""Prompt datasets: JSONL, JSON, Parquet, or a ``datasets`` dataset saved to disk.

Rows need a ``prompt`` (text or chat messages); SFT rows also a ``completion``. Other
columns (``answer``, ``tests``, ...) are passed by name to reward functions, as in TRL.
"""

from __future__ import annotations

import json
from pathlib import Path


def load_rows(path: str | Path, *, required: tuple[str, ...] = ("prompt",)) -> list[dict]:
    """Read rows and check that each has the required columns; errors name file and row."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: data file does not exist")
    if path.is_dir():
        from datasets import load_from_disk

        rows = [dict(r) for r in load_from_disk(str(path))]
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    elif path.suffix == ".jsonl":
        rows = []
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}, line {n}: not valid JSON ({e.msg})") from None
    elif path.suffix == ".json":
        rows = json.loads(path.read_text())
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a JSON list of rows")
    else:
        raise ValueError(
            f"{path}: unsupported data format {path.suffix!r} (use .jsonl, .json, .parquet or a datasets dir)"
        )
    if not rows:
        raise ValueError(f"{path}: no rows")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(
                f"{path}, row {i}: expected an object with columns, got {type(row).__name__}"
            )
        missing = [c for c in required if c not in row or row[c] is None]
        if missing:
            raise ValueError(
                f"{path}, row {i}: missing column(s) {', '.join(missing)}; has {', '.join(sorted(row))}"
            )
        p = row["prompt"]
        if not (
            isinstance(p, str)
            or (
                isinstance(p, list)
                and all(isinstance(m, dict) and "role" in m and "content" in m for m in p)
            )
        ):
            raise ValueError(
                f"{path}, row {i}: 'prompt' must be text or a list of {{role, content}} messages"
            )
    return rows

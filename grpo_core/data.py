"""Prompt datasets: JSONL, JSON, Parquet, or a ``datasets`` dataset saved to disk.

Rows need a ``prompt`` (text or chat messages); SFT rows also a ``completion``. Other
columns (``answer``, ``tests``, ...) are passed by name to reward functions, as in TRL.
Every problem is a ``UserError`` that names the file, the row and the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpo_core.errors import UserError

# passed to reward functions as keywords of their own: a column of that name cannot be
RESERVED_COLUMNS = ("prompts", "completions")


def _read(path: Path) -> list:
    if path.is_dir():
        from datasets import load_from_disk

        try:
            return [dict(r) for r in load_from_disk(str(path))]
        except (FileNotFoundError, ValueError) as e:
            raise UserError(
                f"{path}: a folder, but not a dataset saved with datasets' save_to_disk ({e})"
            ) from None
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as e:
            raise UserError(f"{path}: not a readable Parquet file ({e})") from None
    if path.suffix == ".jsonl":
        rows = []
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise UserError(
                        f"{path}, line {n}: not valid JSON ({e.msg}, column {e.colno})"
                    ) from None
        return rows
    if path.suffix == ".json":
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise UserError(
                f"{path}, line {e.lineno}, column {e.colno}: not valid JSON ({e.msg})"
            ) from None
        if not isinstance(rows, list):
            raise UserError(f"{path}: expected a JSON list of rows, got {type(rows).__name__}")
        return rows
    raise UserError(
        f"{path}: unsupported data format {path.suffix!r} (use .jsonl, .json, .parquet or a "
        "datasets dir)"
    )


def prompt_chars(prompt: Any) -> int:
    """Characters of a prompt: its text, or the text of all its messages."""
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(m["content"]) if isinstance(m["content"], str) else 0 for m in prompt) + sum(
        len(p.get("text") or "")
        for m in prompt
        if isinstance(m["content"], list)
        for p in m["content"]
        if isinstance(p, dict)
    )


def _prompt_problem(p: Any) -> str | None:
    """What is wrong with a ``prompt`` value, or None."""
    if isinstance(p, str):
        return None if p.strip() else "is empty"
    if not isinstance(p, list) or not p:
        return (
            f"must be text or a non-empty list of {{role, content}} messages, "
            f"got {type(p).__name__}"
        )
    for j, m in enumerate(p):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            return f"message {j} must be an object with 'role' and 'content'"
        if not isinstance(m["role"], str):
            return f"message {j}: 'role' must be text, got {type(m['role']).__name__}"
        c = m["content"]
        if not (
            isinstance(c, str) or (isinstance(c, list) and all(isinstance(x, dict) for x in c))
        ):
            return (
                f"message {j}: 'content' must be text (or a list of parts), got {type(c).__name__}"
            )
    return None


def _kind(v: Any) -> str:
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int | float):
        return "a number"
    if isinstance(v, str):
        return "text"
    if isinstance(v, list | tuple):
        return "a list"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


def load_rows(
    path: str | Path,
    *,
    required: tuple[str, ...] = ("prompt",),
    max_prompt_chars: int | None = None,
) -> list[dict]:
    """Read rows and check each one; errors name the file, row and field.

    Checks: the ``required`` columns are there; ``prompt`` is non-empty text or chat messages
    (``{role, content}``) of at most ``max_prompt_chars`` characters; ``completion``, when
    required, is text; no column is named ``prompts``/``completions``; and a column holds
    the same kind of value in every row (the rollout Parquet needs one type per column).
    """
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: data file does not exist")
    try:
        rows = _read(path)
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except PermissionError:
        raise UserError(f"{path}: cannot read the data file (permission denied)") from None
    if not rows:
        raise UserError(f"{path}: no rows")
    kinds: dict[str, tuple[str, int]] = {}  # column -> (kind of its first non-null value, row)
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise UserError(
                f"{path}, row {i}: expected an object with columns, got {type(row).__name__}"
            )
        missing = [c for c in required if c not in row or row[c] is None]
        if missing:
            raise UserError(
                f"{path}, row {i}: missing column(s) {', '.join(missing)}; "
                f"has {', '.join(sorted(map(str, row))) or 'none'}"
            )
        if "prompt" in row:
            problem = _prompt_problem(row["prompt"])
            if problem:
                raise UserError(f"{path}, row {i}, field 'prompt': {problem}")
            n = prompt_chars(row["prompt"])
            if max_prompt_chars is not None and n > max_prompt_chars:
                raise UserError(
                    f"{path}, row {i}, field 'prompt': {n:,} characters, above the limit of "
                    f"{max_prompt_chars:,} (data.max_prompt_chars); shorten or drop the row, or "
                    "raise data.max_prompt_chars"
                )
        if "completion" in required and not isinstance(row["completion"], str):
            raise UserError(
                f"{path}, row {i}, field 'completion': must be text, "
                f"got {type(row['completion']).__name__}"
            )
        for col, v in row.items():
            if col in RESERVED_COLUMNS:
                raise UserError(
                    f"{path}, row {i}: column {col!r} is reserved (reward functions get it as "
                    "their own argument); rename the column"
                )
            if v is None:
                continue
            first = kinds.setdefault(col, (_kind(v), i))
            if first[0] != _kind(v):
                raise UserError(
                    f"{path}, row {i}, field {col!r}: {_kind(v)}, but row {first[1]} has "
                    f"{first[0]}; give the column one type in every row"
                )
    return rows

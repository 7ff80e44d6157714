"""Prompt datasets: JSONL, JSON, Parquet, CSV/TSV, or a ``datasets`` dataset on disk.

Rows need a ``prompt`` (text or chat messages); SFT rows also a ``completion``. Other
columns (``answer``, ``tests``, ...) are passed by name to reward functions, as in TRL.
A dataset with other column names goes through a ``grpo_core.contracts.columns.RowMapping`` first.
Every problem is a ``UserError`` that names the file, the row and the field.

Paths: a file (``.jsonl``, ``.json``, ``.parquet``, ``.csv``, ``.tsv``), a folder written by
``datasets``' ``save_to_disk`` (a ``Dataset`` or a ``DatasetDict``), or a folder of data files
``datasets.load_dataset`` reads (a downloaded hub dataset repository). A split of a
``DatasetDict`` or of such a folder is named after ``::``: ``data/gsm8k::test``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_core.contracts.conversation import conversation_problem, is_conversation
from grpo_core.contracts.text import is_conversational
from grpo_core.errors import UserError

if TYPE_CHECKING:
    from grpo_core.contracts.columns import RowMapping

# passed to reward functions as keywords of their own: a column of that name cannot be
RESERVED_COLUMNS = ("prompts", "completions")
SPLIT_SEP = "::"


def split_path(path: str | Path) -> tuple[Path, str | None]:
    """``"dir::test"`` -> ``(Path("dir"), "test")``; a path without ``::`` has no split."""
    text = str(path)
    if SPLIT_SEP in text:
        base, split = text.rsplit(SPLIT_SEP, 1)
        return Path(base), split or None
    return Path(text), None


def _pick_split(dd, path: Path, split: str | None):
    names = list(dd.keys())
    if split is None:
        if len(names) == 1:
            return dd[names[0]]
        raise UserError(
            f"{path}: a dataset with splits {', '.join(names)}; name one as "
            f"{path}{SPLIT_SEP}{names[0]}"
        )
    if split not in dd:
        raise UserError(
            f"{path}{SPLIT_SEP}{split}: no split {split!r}; the dataset has {', '.join(names)}"
        )
    return dd[split]


def _read_datasets(path: Path, split: str | None) -> list:
    import datasets

    saved = any((path / f).exists() for f in ("dataset_dict.json", "state.json"))
    try:
        if saved:
            ds = datasets.load_from_disk(str(path))
        else:
            ds = datasets.load_dataset(str(path), split=None)
    except (FileNotFoundError, ValueError, datasets.exceptions.DatasetGenerationError) as e:
        raise UserError(
            f"{path}: a folder, but neither a dataset saved with datasets' save_to_disk nor a "
            f"folder of data files datasets.load_dataset reads ({str(e).splitlines()[0]})"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        ds = _pick_split(ds, path, split)
    elif split is not None:
        raise UserError(f"{path}: a single dataset, it has no split {split!r}; drop '::{split}'")
    return [dict(r) for r in ds]


def _read_csv(path: Path) -> list:
    import datasets

    try:
        ds = datasets.load_dataset(
            "csv",
            data_files=str(path),
            split="train",
            delimiter="\t" if path.suffix == ".tsv" else ",",
        )
    except (ValueError, datasets.exceptions.DatasetGenerationError) as e:
        cause = e.__cause__ or e
        raise UserError(f"{path}: not a readable CSV file ({str(cause).splitlines()[0]})") from None
    return [dict(r) for r in ds]


def _read(path: Path, split: str | None = None) -> list:
    if path.is_dir():
        return _read_datasets(path, split)
    if split is not None:
        raise UserError(f"{path}: a file has no splits; drop '{SPLIT_SEP}{split}'")
    if path.suffix in (".csv", ".tsv"):
        return _read_csv(path)
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
        f"{path}: unsupported data format {path.suffix!r} (use .jsonl, .json, .parquet, .csv, "
        ".tsv or a datasets folder)"
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


def _completion_problem(c: Any, prompt: Any) -> str | None:
    """What is wrong with an SFT ``completion``: text, or chat messages (the assistant's
    turns and the ``tool`` messages answering them) after a prompt of chat messages."""
    if isinstance(c, str):
        return None
    if not is_conversation(c):
        return (
            "must be text or a non-empty list of {role, content} messages, "
            f"got {type(c).__name__}"
        )
    if not is_conversational(prompt):
        return "chat messages follow a prompt given as chat messages, not as text"
    return conversation_problem(c)


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
    mapping: RowMapping | None = None,
) -> list[dict]:
    """Read rows and check each one; errors name the file, row and field.

    Checks: the ``required`` columns are there; ``prompt`` is non-empty text or chat messages
    (``{role, content}``) of at most ``max_prompt_chars`` characters; ``completion``, when
    required, is text or chat messages (grpo_core/contracts/conversation.py); no column is named ``prompts``/``completions``; and a column holds
    the same kind of value in every row (the rollout Parquet needs one type per column).
    ``mapping`` turns a plain dataset's columns into those first (SFT rows when ``required``
    has ``completion``).
    """
    source = str(path)
    path, split = split_path(path)
    if not path.exists():
        raise UserError(f"{path}: data file does not exist")
    try:
        rows = _read(path, split)
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except PermissionError:
        raise UserError(f"{path}: cannot read the data file (permission denied)") from None
    if not rows:
        raise UserError(f"{source}: no rows")
    if mapping is not None:
        rows = mapping.apply(rows, source, sft="completion" in required)
    path = source
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
        if "completion" in required:
            problem = _completion_problem(row["completion"], row.get("prompt"))
            if problem:
                raise UserError(f"{path}, row {i}, field 'completion': {problem}")
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

"""Pre-flight checks of the data: data files parse and have the required fields, a Parquet
file has the rollout contract's columns, and a scored file's token ids fit the policy."""

from __future__ import annotations

import json
from pathlib import Path

from flows.preflight._util import first_line
from grpo_core.errors import UserError


def check_data(
    path, field: str, required: tuple[str, ...], max_prompt_chars: int, mapping=None
) -> list[dict]:
    """The rows of ``path`` after ``mapping`` (a ``grpo_core.contracts.columns.RowMapping``: the data
    section's column mapping, template, preset and system prompt)."""
    from grpo_core.contracts.prompts import load_rows

    if not path:
        raise UserError(f"{field}: not set")
    try:
        return load_rows(
            path, required=required, max_prompt_chars=max_prompt_chars, mapping=mapping
        )
    except UserError as e:
        raise UserError(f"{field}: {e}") from None


def check_parquet(path, field: str, required: dict):
    """The Parquet file's schema (footer only: nothing else is read); it must parse and
    have the contract's columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = Path(path)
    if not p.is_file():
        raise UserError(f"{field} {path}: no such file")
    try:
        schema = pq.read_schema(p)
    except (pa.ArrowException, OSError) as e:
        raise UserError(
            f"{field} {path}: not a readable Parquet file ({first_line(e)}); it may be "
            "truncated: write it again"
        ) from None
    missing = [c for c in required if "<" not in c and c != "group_idx" and c not in schema.names]
    if missing:
        raise UserError(
            f"{field} {path}: missing column(s) {', '.join(missing)} of the rollout contract "
            "(docs/architecture.md, 'Data contracts')"
        )
    return schema


def check_scored_rows(scored) -> None:
    """The scored file has rows, and every advantage is a finite number (a NaN or an empty
    value would turn every weight NaN in the first step)."""
    import math

    import pyarrow.parquet as pq

    meta = pq.read_metadata(scored)
    if meta.num_rows == 0:
        raise UserError(f"--scored {scored}: the file has no rows; score a rollout file with rows")
    advantages = pq.read_table(scored, columns=["advantage"]).column("advantage").to_pylist()
    for row, a in enumerate(advantages):
        if not isinstance(a, int | float) or not math.isfinite(a):
            raise UserError(
                f"--scored {scored}, row {row}, field 'advantage': {a!r}, expected a finite "
                "number (re-score the rollouts with grpo score)"
            )


def check_token_ids(scored, schema, policy, config: dict) -> None:
    """The scored file's token ids index the policy's embedding, and were made by the
    policy's tokenizer (the fingerprint recorded at rollout time, when there is one)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from grpo_core.contracts.rollouts import META_KEY, tokenizer_fingerprint

    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if isinstance(vocab, int):
        table = pq.read_table(scored, columns=["prompt_ids", "completion_ids"])
        for col in ("prompt_ids", "completion_ids"):
            flat = pc.list_flatten(table[col])
            if len(flat) == 0:
                continue
            lo, hi = pc.min(flat).as_py(), pc.max(flat).as_py()
            if lo is not None and (lo < 0 or hi >= vocab):
                for row, ids in enumerate(table[col].to_pylist()):
                    bad = next((t for t in ids or () if t < 0 or t >= vocab), None)
                    if bad is not None:
                        raise UserError(
                            f"--scored {scored}, row {row}, field {col!r}: token id {bad} is "
                            f"outside --policy {policy}'s vocabulary (vocab_size {vocab}); the "
                            "file was written with another tokenizer: sample and score rollouts "
                            "with this policy"
                        )
    try:
        recorded = json.loads((schema.metadata or {}).get(META_KEY, b"{}")).get("tokenizer")
    except (json.JSONDecodeError, AttributeError):
        recorded = None
    tok_file = Path(policy) / "tokenizer.json"
    if recorded and tok_file.is_file():
        from tokenizers import Tokenizer

        try:
            mine = tokenizer_fingerprint(Tokenizer.from_file(str(tok_file)))
        except Exception as e:  # a tokenizer.json the tokenizers library cannot read
            raise UserError(f"{tok_file}: cannot be read ({first_line(e)})") from None
        if recorded != mine:
            raise UserError(
                f"--scored {scored}: its token ids come from another tokenizer (fingerprint "
                f"{recorded}) than --policy {policy}'s ({mine}); sample and score rollouts with "
                "this policy, or update the policy that wrote them"
            )

"""Rejection sampling (R1, section 2.3.3): keep sampled completions that pass the reward
threshold, dedupe, cap per prompt, and emit an SFT dataset of prompt/completion rows."""

from __future__ import annotations

from collections import defaultdict


def select_completions(
    rows: list[dict],
    *,
    min_reward: float,
    max_per_prompt: int,
    require: dict[str, float] | None = None,
) -> list[dict]:
    """Filter scored rollout rows into SFT rows.

    rows: dicts with ``prompt_id``, ``prompt``, ``completion``, ``reward`` and any
    ``reward_<fn>`` columns. A row is kept when ``reward >= min_reward`` and every
    ``reward_<fn>`` named in ``require`` is at least its value; exact duplicate
    completions of a prompt are dropped; at most ``max_per_prompt`` per prompt.
    """
    require = require or {}
    kept: list[dict] = []
    seen: set[tuple[str, str]] = set()
    per_prompt: dict[str, int] = defaultdict(int)
    for r in rows:
        if r.get("reward") is None or r["reward"] < min_reward:
            continue
        if any((r.get(f"reward_{k}") or 0.0) < v for k, v in require.items()):
            continue
        key = (r["prompt_id"], r["completion"].strip())
        if key in seen or per_prompt[r["prompt_id"]] >= max_per_prompt:
            continue
        seen.add(key)
        per_prompt[r["prompt_id"]] += 1
        kept.append(r)
    return kept


def to_sft_rows(kept: list[dict]) -> list[dict]:
    """SFT rows: ``prompt``, ``completion`` and the data's passthrough columns (``answer``...)."""
    return [{k: v for k, v in r.items() if not _is_rollout_only(k)} for r in kept]


_ROLLOUT_ONLY = {
    "sample_idx",
    "prompt_text",
    "prompt_ids",
    "completion_ids",
    "completion_logprobs",
    "completion_length",
    "finish_reason",
    "iteration",
    "advantage",
    "prompt_id",
    "policy_id",
}


def _is_rollout_only(col: str) -> bool:
    return col in _ROLLOUT_ONLY or col.startswith(("error_", "reward"))

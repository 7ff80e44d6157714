"""Rejection sampling (R1, section 2.3.3): keep sampled completions that pass the reward
threshold, dedupe, cap per prompt, and emit an SFT dataset of prompt/completion rows."""

from __future__ import annotations

import random
from collections import defaultdict

FAILED = "failed"  # below ``min_reward`` or a required reward short of its value
DUPLICATE = "duplicate"  # passed, but the prompt already has a passing completion with this text
OVER_CAP = "over_cap"  # passed and distinct, but the prompt already has ``max_per_prompt`` kept
KEPT = "kept"  # written to the SFT data


def classify_completions(
    rows: list[dict],
    *,
    min_reward: float,
    max_per_prompt: int,
    require: dict[str, float] | None = None,
) -> list[str]:
    """What :func:`select_completions` does with each row, in order: :data:`FAILED`,
    :data:`DUPLICATE`, :data:`OVER_CAP` or :data:`KEPT`. Every row that is not ``FAILED``
    passed (met the requirements); a duplicate of a completion that was over the cap is
    still a duplicate."""
    require = require or {}
    out: list[str] = []
    seen: set[tuple[str, str]] = set()
    per_prompt: dict[str, int] = defaultdict(int)
    for r in rows:
        if (
            r.get("reward") is None
            or r["reward"] < min_reward
            or any((r.get(f"reward_{k}") or 0.0) < v for k, v in require.items())
        ):
            out.append(FAILED)
            continue
        key = (r["prompt_id"], r["completion"].strip())
        if key in seen:
            out.append(DUPLICATE)
            continue
        seen.add(key)
        if per_prompt[r["prompt_id"]] >= max_per_prompt:
            out.append(OVER_CAP)
            continue
        per_prompt[r["prompt_id"]] += 1
        out.append(KEPT)
    return out


def select_completions(rows: list[dict], **rules) -> list[dict]:
    """Filter scored rollout rows into SFT rows.

    rows: dicts with ``prompt_id``, ``prompt``, ``completion``, ``reward`` and any
    ``reward_<fn>`` columns. A row passes when ``reward >= min_reward`` and every
    ``reward_<fn>`` named in ``require`` is at least its value; of the passing rows, exact
    duplicate completions of a prompt are dropped; at most ``max_per_prompt`` per prompt
    are kept. ``rules`` are :func:`classify_completions`'s keywords (``min_reward``,
    ``max_per_prompt``, ``require``); it says which reason dropped each row.
    """
    status = classify_completions(rows, **rules)
    return [r for r, s in zip(rows, status, strict=True) if s == KEPT]


def to_sft_rows(kept: list[dict]) -> list[dict]:
    """SFT rows: ``prompt``, ``completion`` and the data's passthrough columns (``answer``...).
    The prompt is the one the model saw: with what an environment's ``reset()`` added
    (``episode_prompt``), where it added something.

    An episode with tool turns (a row with ``loss_mask``) also keeps the ids it was sampled
    as, ``prompt_ids``, ``completion_ids`` and ``loss_mask`` (:data:`SAMPLED_IDS`), and re-SFT
    trains those (:func:`grpo_core.training.sft_examples.encode_examples`), never the decoded text:
    that text has lost the special tokens (a chat template's role markup, markers that are
    special tokens), and what a tool printed (``<|im_end|>``, a closing marker) would read
    as markup when it is tokenised again. ``completion`` stays, for people and for dedupe."""
    return [
        {
            **{k: v for k, v in r.items() if not _is_rollout_only(k)},
            **({"prompt": r["episode_prompt"]} if r.get("episode_prompt") is not None else {}),
            **({k: r[k] for k in SAMPLED_IDS} if r.get("loss_mask") is not None else {}),
        }
        for r in kept
    ]


# the columns of an SFT row that trains the ids an episode was sampled as
SAMPLED_IDS = ("prompt_ids", "completion_ids", "loss_mask")


def mix_sft_rows(sft_rows: list[dict], n: int, seed: int) -> list[dict]:
    """``n`` rows of the cold-start SFT data (all of them when it has fewer), drawn without
    replacement with ``seed``: what goes into the re-SFT set beside the kept completions
    (``rejection_sampling.mix_sft_rows``). R1 mixed about 200k SFT rows it already had with
    its 600k rejection-sampled ones; a policy that has stopped sampling some kind of answer
    right (nothing of it passes) relearns it from these."""
    return random.Random(seed).sample(sft_rows, min(n, len(sft_rows)))


_ROLLOUT_ONLY = {
    "sample_idx",
    "prompt_text",
    "prompt_ids",
    "completion_ids",
    "completion_logprobs",
    "completion_policy_logprobs",
    "episode_prompt",
    "completion_length",
    "finish_reason",
    "iteration",
    "advantage",
    "prompt_id",
    "policy_id",
}


def _is_rollout_only(col: str) -> bool:
    return col in _ROLLOUT_ONLY or col.startswith(("error_", "reward"))

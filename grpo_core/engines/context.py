"""Prompt + completion against the model's context: refused in one line, before generating.

A prompt longer than the model's positions (a 10k-character row against a 256-position
model) does not fail on its own: generation goes on past the positions the model knows and
its memory grows with every row of the batch until the machine runs out. These checks turn
that into a ``UserError`` naming the setting, or the row and its length, before anything is
generated (``flows/preflight`` runs them before any stage; the rollout and eval stages run
them again on the prompts they tokenise).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from grpo_core.errors import UserError

_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def model_context(config: Any) -> int | None:
    """Positions of a model: ``max_position_embeddings`` (or GPT-2's ``n_positions``, ...)
    of its config (a ``PretrainedConfig`` or config.json's dict; a multimodal config's
    ``text_config``); None when it names none."""
    get = config.get if isinstance(config, Mapping) else lambda k: getattr(config, k, None)
    text = get("text_config")
    if text is not None:
        found = model_context(text)
        if found is not None:
            return found
    for key in _KEYS:
        value = get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def check_completion_length(max_new_tokens: int, context: int | None, field: str) -> None:
    """``field`` (a ``max_completion_length``) must leave room for a prompt."""
    if context is not None and max_new_tokens >= context:
        raise UserError(
            f"{field}={max_new_tokens}: the model has {context:,} positions (its config's "
            f"max_position_embeddings), and a completion must leave room for the prompt; set "
            f"{field} below {context:,}"
        )


def check_prompt_lengths(
    prompt_ids: Sequence[Sequence[int]],
    *,
    context: int | None,
    max_new_tokens: int,
    field: str,
    source: str,
    unit: str = "prompt",
) -> None:
    """Every prompt's tokens + ``max_new_tokens`` fit in ``context``, else a ``UserError``
    naming the first row over (``source`` row N, its token count) and how many are."""
    if context is None:
        return
    check_completion_length(max_new_tokens, context, field)
    limit = context - max_new_tokens
    over = [i for i, ids in enumerate(prompt_ids) if len(ids) > limit]
    if not over:
        return
    i = over[0]
    raise UserError(
        f"{source}, {unit} {i}: a prompt of {len(prompt_ids[i]):,} tokens does not fit with "
        f"{field}={max_new_tokens} in the model's {context:,} positions ({len(over)} of "
        f"{len(prompt_ids)} prompts are over {limit:,} tokens); drop or shorten those rows, "
        f"lower data.max_prompt_chars to refuse them when the data loads, or lower {field}"
    )

"""Length-shaping rewards: DAPO's soft overlong penalty, cosine length scaling, n-gram
repetition penalty. Each has a factory with explicit parameters (pass the result to
``score_completions(functions=...)``) and a registered instance with the defaults, whose
parameters may also be given as keyword arguments (a scalar, or one value per row).

Lengths are in tokens when a ``completion_ids`` column is passed (TRL passes it; so do our
rollouts), else in characters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from grpo_core.rewards.accuracy import _score as _answer_score
from grpo_core.rewards.accuracy import extract_tag
from grpo_core.rewards.base import RewardFn, Scores, completion_text, register
from grpo_core.rewards.mathverify import CheckFailed


def _lengths(completions: Sequence[Any], completion_ids: Sequence[Any] | None) -> list[int]:
    if completion_ids is not None and len(completion_ids) == len(completions):
        return [len(ids) if ids is not None else 0 for ids in completion_ids]
    return [len(completion_text(c)) for c in completions]


def _param(value: Any, i: int, default: Any) -> Any:
    if value is None:
        return default
    if isinstance(value, list | tuple):
        return value[i] if value[i] is not None else default
    return value


def soft_overlong_penalty(max_completion_length: int, overlong_buffer: int) -> RewardFn:
    """DAPO (Yu et al. 2025, eq. 13): 0 up to ``L_max - L_cache``, then linear down to -1 at
    ``L_max``, and -1 beyond. ``L_max = max_completion_length``, ``L_cache = overlong_buffer``."""
    if not 0 < overlong_buffer <= max_completion_length:
        raise ValueError("need 0 < overlong_buffer <= max_completion_length")

    def soft_overlong(
        prompts: list, completions: list, completion_ids=None, **_: Any
    ) -> list[float]:
        return [
            _overlong(n, max_completion_length, overlong_buffer)
            for n in _lengths(completions, completion_ids)
        ]

    return soft_overlong


def _overlong(n: int, l_max: int, l_cache: int) -> float:
    expected = l_max - l_cache
    if n <= expected:
        return 0.0
    if n <= l_max:
        return (expected - n) / l_cache
    return -1.0


@register("soft_overlong")
def soft_overlong(
    prompts: list,
    completions: list,
    completion_ids=None,
    max_completion_length=None,
    overlong_buffer=None,
    **_: Any,
) -> list[float]:
    """DAPO soft overlong penalty with ``max_completion_length`` (default 1024) and
    ``overlong_buffer`` (default a quarter of it), given as keyword arguments."""
    out = []
    for i, n in enumerate(_lengths(completions, completion_ids)):
        l_max = int(_param(max_completion_length, i, 1024))
        l_cache = int(_param(overlong_buffer, i, max(1, l_max // 4)))
        out.append(_overlong(n, l_max, l_cache))
    return out


def cosine_scaled(
    *,
    max_len: int = 1000,
    min_value_wrong: float = -1.0,
    max_value_wrong: float = -0.5,
    min_value_correct: float = 0.5,
    max_value_correct: float = 1.0,
) -> RewardFn:
    """Cosine length scaling (Yeo et al. 2025, "Demystifying Long CoT"; open-r1 defaults):
    a correct answer earns ``max_value_correct`` at length 0 falling to ``min_value_correct``
    at ``max_len``; a wrong one ``min_value_wrong`` at length 0 rising to ``max_value_wrong``
    (short wrong answers are punished most). Correctness is ``accuracy``'s; ``None`` when
    the gold answer is unusable."""

    def cosine(
        prompts: list, completions: list, answer=None, completion_ids=None, **_: Any
    ) -> list[float | None]:
        if answer is None:
            raise ValueError("reward 'cosine' needs an 'answer' column")
        out: list[float | None] = []
        errors: list[str | None] = []
        for c, gold, n in zip(
            completions, answer, _lengths(completions, completion_ids), strict=True
        ):
            try:
                correct = _answer_score(
                    extract_tag(completion_text(c)), gold, gold_required_parse=False
                )
                errors.append(None)
            except CheckFailed as e:  # not checkable within the bounds: scored as wrong
                correct = 0.0
                errors.append(f"CheckFailed: {e}")
            if correct is None:
                out.append(None)
                continue
            lo, hi = (
                (min_value_correct, max_value_correct)
                if correct
                else (max_value_wrong, min_value_wrong)
            )
            progress = min(n, max_len) / max_len
            out.append(lo + 0.5 * (hi - lo) * (1.0 + math.cos(progress * math.pi)))
        return Scores(out, errors)

    return cosine


register("cosine")(cosine_scaled())


def repetition_penalty(ngram_size: int = 3, max_penalty: float = -1.0) -> RewardFn:
    """n-gram repetition penalty (Yeo et al. 2025; open-r1): ``max_penalty * (1 - distinct
    n-grams / n-grams)`` over whitespace-separated words; 0 for texts shorter than one n-gram."""
    if max_penalty > 0:
        raise ValueError("max_penalty must be <= 0")

    def repetition(prompts: list, completions: list, **_: Any) -> list[float]:
        out = []
        for c in completions:
            words = completion_text(c).lower().split()
            if len(words) < ngram_size:
                out.append(0.0)
                continue
            grams = [tuple(words[i : i + ngram_size]) for i in range(len(words) - ngram_size + 1)]
            out.append((1.0 - len(set(grams)) / len(grams)) * max_penalty + 0.0)
        return out

    return repetition


register("repetition")(repetition_penalty())

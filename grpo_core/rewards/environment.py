"""The environment's own reward (TRL's ``environments=`` argument to reward functions, verl's
``calc_reward``): an episode whose object has ``reward()`` is asked once it has ended, in the
process that ran it (grpo_core/engines/turns.py); the number lands in the rollout file's
``env_reward`` column (its error in ``env_reward_error``), and ``environment`` pays it. Scoring
reads the file only: a re-score (``grpo score``) needs no environment."""

from __future__ import annotations

import math
from typing import Any

from grpo_core.rewards.base import Scores, register

NO_COLUMN = (
    "the rollouts have no env_reward column: the environment's episodes define no reward() "
    "(docs/tools.md, 'Your own environment')"
)


@register("environment")
def environment_reward(
    prompts: list, completions: list, env_reward=None, env_reward_error=None, **_: Any
) -> Scores:
    """The episode's ``reward()`` as recorded; None (unscorable, with the reason) where the
    episode gave none or its ``reward()`` failed."""
    n = len(completions)
    if env_reward is None:
        return Scores([None] * n, [NO_COLUMN] * n)
    errors = list(env_reward_error) if env_reward_error is not None else [None] * n
    values = []
    for i, v in enumerate(env_reward):
        bad = v is None or (isinstance(v, float) and math.isnan(v))
        values.append(None if bad else float(v))
        if bad and errors[i] is None:
            errors[i] = "the episode's reward() gave no number"
    return Scores(values, errors)

"""What the RL iteration tasks return: small typed records, not mixed dicts.

``metrics`` holds only numbers with TRL's names (what goes to MLflow); whether the result
came from the stage cache is ``cached``, never a metric. The cache (tasks/cache.py) records
each result as JSON and rebuilds the same type on a hit.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RolloutResult:
    path: str  # the rollouts Parquet
    metrics: dict[str, float]  # completions/*, timing/rollout_s, rollout/tokens_per_s
    cached: bool = False


@dataclass(frozen=True)
class ScoreResult:
    path: str  # the scored Parquet
    metrics: dict[str, float]  # reward, reward_std, rewards/<fn>/*, frac_reward_zero_std, ...
    cached: bool = False


@dataclass(frozen=True)
class UpdateResult:
    checkpoint: str  # the policy after the update
    global_step: int  # optimizer steps so far in the stage
    history: list[dict[str, float]] = field(default_factory=list)  # one entry per step
    seconds: float = 0.0  # wall time of the optimizer steps
    cached: bool = False

"""Score task: reward functions + advantages on a rollouts Parquet -> a new scored Parquet.

The rollout file is read, never rewritten. A reward function that fails is recorded per
row (``error_<fn>``) and scoring goes on.
"""

from __future__ import annotations

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from grpo_core import advantages, rewards
from grpo_core.io import write_parquet
from grpo_core.rollouts import ROLLOUT_COLUMNS, group_ids, read_rollouts, scored_table
from tasks.common import logger, timer


def score_file(
    rollouts_path: str,
    out_path: str,
    weights: dict[str, float],
    *,
    advantage_estimator: str = "grpo",
    scale_rewards: str = "group",
) -> dict:
    """Score every completion of ``rollouts_path``; returns path and TRL-named metrics."""
    with timer() as t:
        table = read_rollouts(rollouts_path)
        cols = table.to_pydict()
        extra = {k: v for k, v in cols.items() if k not in ROLLOUT_COLUMNS or k == "completion_ids"}
        result = rewards.score_completions(cols["prompt"], cols["completion"], extra, weights)
        gids = torch.tensor(group_ids(table))
        total = torch.tensor(result.total, dtype=torch.float64)
        opts = (
            {} if advantage_estimator in ("dr_grpo", "rloo") else {"scale_rewards": scale_rewards}
        )
        adv = advantages.compute(advantage_estimator, total, gids, **opts)
        scored = scored_table(
            table,
            result.per_function,
            result.errors,
            result.total,
            adv.tolist(),
            metadata={
                "rewards": weights,
                "advantage_estimator": advantage_estimator,
                "scale_rewards": scale_rewards,
            },
        )
        write_parquet(scored, out_path)
    metrics = {
        **result.metrics(),
        **advantages.group_stats(total, gids),
        "timing/score_s": t["seconds"],
    }
    n_err = sum(e is not None for errs in result.errors.values() for e in errs)
    if n_err:
        logger(__name__).warning("%s: %d reward errors (see error_<fn> columns)", out_path, n_err)
    return {"path": out_path, **metrics}


@task(name="score", task_run_name="{stage}-score-{iteration}", cache_policy=NO_CACHE)
def score(
    stage: str,
    iteration: int,
    rollouts_path: str,
    out_path: str,
    weights: dict[str, float],
    rl: dict,
) -> dict:
    out = score_file(
        rollouts_path,
        out_path,
        weights,
        advantage_estimator=rl["advantage_estimator"],
        scale_rewards=rl["scale_rewards"],
    )
    logger(__name__).info(
        "%s iteration %d: reward %.3f, zero-std groups %.2f",
        stage,
        iteration,
        out["reward"],
        out["frac_reward_zero_std"],
    )
    return out

"""Score task: reward functions + advantages on a rollouts Parquet -> a new scored Parquet.

The rollout file is read, never rewritten. A reward function that fails is recorded per
row (``error_<fn>``) and scoring goes on.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from grpo_core import rewards
from grpo_core.io import write_parquet
from grpo_core.rollouts import ROLLOUT_COLUMNS, group_ids, read_rollouts, scored_table
from tasks.cache import cached, stage_key
from tasks.common import logger, timer


def score_file(
    rollouts_path: str,
    out_path: str,
    weights: dict[str, float],
    *,
    advantage_estimator: str = "grpo",
    scale_rewards: str = "group",
    multi_objective_aggregation: str = "sum_then_normalize",
    overlong_buffer_length: int | None = None,
    overlong_penalty_factor: float = 1.0,
    max_completion_length: int | None = None,
) -> dict:
    """Score every completion of ``rollouts_path``; returns path and TRL-named metrics.

    ``reward`` is the weighted sum of the reward functions (plus DAPO's soft overlong
    penalty when ``overlong_buffer_length`` is set); advantages come from that sum, or from
    GDPO's per-reward normalisation when ``multi_objective_aggregation`` says so.
    """
    import torch  # here, not at the top: a cached rerun never loads torch

    from grpo_core import advantages
    from grpo_core.advantages import compute_multi, weighted_reward_sum
    from grpo_core.sampling_filters import overlong_penalty

    with timer() as t:
        table = read_rollouts(rollouts_path)
        cols = table.to_pydict()
        extra = {k: v for k, v in cols.items() if k not in ROLLOUT_COLUMNS or k == "completion_ids"}
        result = rewards.score_completions(cols["prompt"], cols["completion"], extra, weights)
        gids = torch.tensor(group_ids(table))
        per_func = {k: v for k, v in result.per_function.items()}
        names = list(per_func)
        if overlong_buffer_length:
            lengths = torch.tensor(cols["completion_length"])
            penalty = overlong_penalty(
                lengths, max_completion_length, overlong_buffer_length
            )  # [N]
            per_func["overlong_penalty"] = penalty.tolist()
            result.errors["overlong_penalty"] = [None] * len(penalty)
            names.append("overlong_penalty")
        w = torch.tensor(
            [weights.get(n, overlong_penalty_factor) for n in names], dtype=torch.float64
        )
        matrix = torch.tensor(
            [[float("nan") if v is None else v for v in per_func[n]] for n in names],
            dtype=torch.float64,
        ).T  # [N, K]
        total = weighted_reward_sum(matrix, w).nan_to_num(0.0)  # [N]
        adv = compute_multi(
            matrix,
            gids,
            weights=w,
            aggregation=multi_objective_aggregation,
            name=advantage_estimator,
            scale_rewards=scale_rewards,
        )
        scored = scored_table(
            table,
            per_func,
            result.errors,
            total.tolist(),
            adv.tolist(),
            metadata={
                "rewards": weights,
                "advantage_estimator": advantage_estimator,
                "scale_rewards": scale_rewards,
                "multi_objective_aggregation": multi_objective_aggregation,
                "overlong_buffer_length": overlong_buffer_length,
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
    force: bool = False,
) -> dict:
    opts = {k: rl[k] for k in SCORE_KNOBS}
    key = stage_key("score", {"rewards": weights, **opts}, [rollouts_path])

    def compute() -> dict:
        out = score_file(rollouts_path, out_path, weights, **opts)
        logger(__name__).info(
            "%s iteration %d: reward %.3f, zero-std groups %.2f",
            stage,
            iteration,
            out["reward"],
            out["frac_reward_zero_std"],
        )
        return out

    return cached(f"{stage} iteration {iteration} score", out_path, key, compute, force=force)


SCORE_KNOBS = (
    "advantage_estimator",
    "scale_rewards",
    "multi_objective_aggregation",
    "overlong_buffer_length",
    "overlong_penalty_factor",
    "max_completion_length",
)

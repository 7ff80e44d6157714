"""Score task: reward functions + advantages (``grpo_core.algorithm.iteration.score``) on a rollouts
Parquet -> a new scored Parquet, cached by its inputs.

The rollout file is read, never rewritten. A reward function that fails is recorded per
row (``error_<fn>``) and scoring goes on, unless it failed on (at least
``rl.rewards_max_error_rate`` of) every row: then the stage stops with the function's first
error and no scored file is written (a run whose rewards all failed is not a success).
With ``cluster.backend: ray`` the reward functions run as Ray tasks over shards of whole
groups (``cluster/scoring.py``); the scored file is the same.
"""

from __future__ import annotations

import dataclasses

from prefect import task
from prefect.cache_policies import NO_CACHE

from cluster import runtime
from grpo_core.config.settings import Scoring, settings_or_knobs
from grpo_core.config.stages import RLConfig
from grpo_core.contracts.io import write_parquet
from grpo_core.contracts.rollouts import read_rollouts
from tasks.cache import cached, stage_key
from tasks.results import ScoreOutcome
from tasks.run_log import logger, timer


def score_file(
    rollouts_path: str,
    out_path: str,
    weights: dict[str, float],
    scoring: Scoring | None = None,
    *,
    max_error_rate: float = 1.0,
    label: str | None = None,
    sandbox_isolation: str | None = None,
    **knobs,
) -> ScoreOutcome:
    """``grpo_core.algorithm.iteration.score`` on ``rollouts_path``, written to ``out_path``; returns
    path and TRL-named metrics.

    ``scoring``: a ``grpo_core.config.settings.Scoring``, or its fields as keywords
    (``advantage_estimator``, ``scale_rewards``, ...; not both). ``reward`` is the weighted
    sum of the reward functions (null where every function gave ``None``), plus DAPO's soft
    overlong penalty as a reward column ``overlong_penalty`` of weight
    ``overlong_penalty_factor`` when ``overlong_buffer_length`` is set; advantages come from
    that sum, or from GDPO's per-reward normalisation when ``multi_objective_aggregation``
    says so. Groups without variance get advantage exactly 0.

    A reward function that fails on ``max_error_rate`` or more of the rows (default: on
    every row) raises a ``UserError`` with its first error, naming ``label`` (default: the
    rollouts file), before anything is written.
    """
    from grpo_core.algorithm import iteration

    scoring = settings_or_knobs(Scoring, scoring, knobs)
    with timer() as t:
        scored = iteration.score(
            read_rollouts(rollouts_path),
            weights,
            scoring,
            scorer=runtime.executor().score,  # here, or Ray tasks over whole groups
            sandbox_isolation=sandbox_isolation,
            max_error_rate=max_error_rate,
            label=label or rollouts_path,
        )
        write_parquet(scored.table, out_path)
    if scored.errors:
        logger(__name__).warning(
            "%s: %d reward errors (see error_<fn> columns)", out_path, scored.errors
        )
    return ScoreOutcome(out_path, {**scored.metrics, "timing/score_s": t["seconds"]})


@task(name="score", task_run_name="{stage}-score-{iteration}", cache_policy=NO_CACHE)
def score(
    stage: str,
    iteration: int,
    rollouts_path: str,
    out_path: str,
    weights: dict[str, float],
    rl: RLConfig,
    force: bool = False,
) -> ScoreOutcome:
    key = score_key(weights, rl, rollouts_path)

    def compute() -> ScoreOutcome:
        out = score_file(
            rollouts_path,
            out_path,
            weights,
            rl.scoring,
            max_error_rate=rl.rewards_max_error_rate,
            label=rollouts_path if stage == "offline" else f"{stage} iteration {iteration}",
        )
        logger(__name__).info(
            "%s iteration %d: reward %.3f, zero-std groups %.2f",
            stage,
            iteration,
            out.metrics["reward"],
            out.metrics["frac_reward_zero_std"],
        )
        return out

    return cached(f"{stage} iteration {iteration} score", out_path, key, compute, force=force)


def score_key(weights: dict[str, float], rl: RLConfig, rollouts_path: str) -> str:
    """The score stage's cache key: the reward weights, the scoring settings and the
    rollout file's content."""
    config = {"rewards": weights, **score_options(rl)}
    return stage_key("score", config, [rollouts_path], code=tuple(weights))


def score_options(rl: RLConfig) -> dict:
    """The RL section's scoring settings as a dict: the score stage's cache key, and the tag
    of a re-scored file's name (``flows/stages.py``)."""
    return dataclasses.asdict(rl.scoring)

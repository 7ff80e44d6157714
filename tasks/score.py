"""Score task: reward functions + advantages on a rollouts Parquet -> a new scored Parquet.

The rollout file is read, never rewritten. A reward function that fails is recorded per
row (``error_<fn>``) and scoring goes on, unless it failed on (at least
``rl.rewards_max_error_rate`` of) every row: then the stage stops with the function's first
error and no scored file is written (a run whose rewards all failed is not a success).
With ``cluster.backend: ray`` the reward functions run as Ray tasks over shards of whole
groups (``cluster/scoring.py``); the scored file is the same.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from prefect import task
from prefect.cache_policies import NO_CACHE

from cluster import runtime
from grpo_core import rewards
from grpo_core.config import RLConfig
from grpo_core.errors import UserError
from grpo_core.io import write_parquet
from grpo_core.rollouts import ROLLOUT_COLUMNS, group_ids, read_rollouts, scored_table
from grpo_core.settings import Scoring, settings_or_knobs
from tasks.cache import cached, stage_key
from tasks.results import ScoreOutcome
from tasks.run_log import logger, timer

OVERLONG = "overlong_penalty"


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
    """Score every completion of ``rollouts_path``; returns path and TRL-named metrics.

    ``scoring``: a ``grpo_core.settings.Scoring``, or its fields as keywords
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
    import torch  # here, not at the top: a cached rerun never loads torch

    from grpo_core import advantages

    scoring = settings_or_knobs(Scoring, scoring, knobs)
    build = functools.partial(reward_functions, weights, sandbox_isolation, scoring)
    all_weights = dict(weights)
    if scoring.overlong_buffer_length:
        all_weights[OVERLONG] = scoring.overlong_penalty_factor
    with timer() as t:
        table = read_rollouts(rollouts_path)
        cols = table.to_pydict()
        extra = {k: v for k, v in cols.items() if k not in ROLLOUT_COLUMNS or k == "completion_ids"}
        gid_list = group_ids(table, rollouts_path)
        # here, or as Ray tasks over shards of whole groups (cluster/scoring.py)
        result = runtime.executor().score(
            cols["prompt"], cols["completion"], extra, all_weights, group_ids=gid_list, build=build
        )
        check_reward_failures(result, max_error_rate, label or rollouts_path)
        gids = torch.tensor(gid_list)  # [N]
        adv, informative = _advantages(result, gids, table.num_rows, scoring)
        metadata = {
            "rewards": all_weights,
            "advantage_estimator": scoring.advantage_estimator,
            "scale_rewards": scoring.scale_rewards,
            "multi_objective_aggregation": scoring.multi_objective_aggregation,
            "overlong_buffer_length": scoring.overlong_buffer_length,
            "sandbox": rewards.isolation_label(weights, sandbox_isolation),
        }
        scored = scored_table(
            table, result.per_function, result.errors, result.total, adv.tolist(), metadata=metadata
        )
        write_parquet(scored, out_path)
    total = torch.tensor([math.nan if v is None else v for v in result.total], dtype=torch.float64)
    metrics = {
        **result.metrics(),
        **advantages.group_stats(total, gids, informative),
        "timing/score_s": t["seconds"],
    }
    n_err = sum(e is not None for errs in result.errors.values() for e in errs)
    if n_err:
        logger(__name__).warning("%s: %d reward errors (see error_<fn> columns)", out_path, n_err)
    return ScoreOutcome(out_path, metrics)


def _advantages(result, gids, n_rows: int, scoring: Scoring):
    """The advantages [N] of the scored rows and which groups carry a signal."""
    from grpo_core import advantages
    from grpo_core.rewards.scoring import reward_matrix

    matrix, w = reward_matrix(result.per_function, result.weights, n_rows)  # [N, K]
    aggregation = scoring.multi_objective_aggregation
    adv = advantages.compute_multi(
        matrix,
        gids,
        weights=w,
        aggregation=aggregation,
        name=scoring.advantage_estimator,
        scale_rewards=scoring.scale_rewards,
    )  # [N]
    return adv, advantages.informative_groups(matrix, gids, w, aggregation)


def reward_functions(
    weights: dict[str, float], sandbox_isolation: str | None, scoring: Scoring
) -> dict:
    """The functions ``score_completions`` takes besides the registry's: the code rewards
    bound to the sandbox isolation (None: sandbox.isolation / auto), which is resolved now,
    so a machine that cannot isolate stops here (SandboxUnavailable), and DAPO's soft
    overlong penalty under ``OVERLONG`` when ``scoring.overlong_buffer_length`` is set."""
    from grpo_core.rewards.length import soft_overlong_penalty

    functions = rewards.sandboxed(weights, sandbox_isolation)
    if scoring.overlong_buffer_length:
        if OVERLONG in weights:
            raise ValueError(
                f"rewards: {OVERLONG!r} is the name of rl.overlong_buffer_length's penalty; "
                "rename your reward function"
            )
        functions[OVERLONG] = soft_overlong_penalty(
            scoring.max_completion_length, scoring.overlong_buffer_length
        )
    return functions


def check_reward_failures(result, max_error_rate: float, label: str) -> None:
    """Raise when a reward function failed (raised, or returned no number, on a row: score
    ``None`` with an error) on at least ``max_error_rate`` of the rows. Rows a function
    scored while reporting an error (e.g. a sandbox timeout scored 0.0) do not count."""
    for name, scores in result.per_function.items():
        errors = result.errors.get(name) or [None] * len(scores)
        failed = [i for i, (s, e) in enumerate(zip(scores, errors, strict=True)) if s is None and e]
        n = len(scores)
        if not failed or len(failed) < max_error_rate * n:
            continue
        first = failed[0]
        if len(failed) == n:
            share = f"all {n} rows"
        else:
            share = (
                f"{len(failed)} of {n} rows ({len(failed) / n:.0%}, rl.rewards_max_error_rate="
                f"{max_error_rate:g})"
            )
        raise UserError(
            f"reward {name!r} failed on {share} of {label}: {errors[first]} (first row {first})"
        )


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
    return stage_key("score", {"rewards": weights, **score_options(rl)}, [rollouts_path])


def score_options(rl: RLConfig) -> dict:
    """The RL section's scoring settings as a dict: the score stage's cache key, and the tag
    of a re-scored file's name (``flows/stages.py``)."""
    return dataclasses.asdict(rl.scoring)

"""Reward scoring as Ray tasks: the rows of a rollout file cut into ``cluster.scoring.workers``
contiguous shards of whole groups, each scored by ``grpo_core.rewards.score_completions`` in
a Ray task with ``cluster.scoring``'s resources, and gathered back in row order.

A shard holds whole groups (the rows of one ``(iteration, group_idx)``), so a reward
function sees each group's completions together, as in one process. The gathered
:class:`ScoreResult` equals the one-process result row for row: a reward that fails on a
row is recorded in that row's ``error_<fn>`` as before, and the caller applies the same
error-rate check. An exception that stops scoring in one process (``RewardUnavailable``, a
bad column) stops it here too, re-raised as its own type. A task whose worker process dies
is run once more by Ray (``max_retries=1``); a second death stops the stage.

The reward functions are rebuilt in each task from ``build`` (a picklable callable
returning ``{name: function}``, e.g. a ``functools.partial`` of a module function), so
user functions given as ``"file.py:function"`` load from the shared filesystem there."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from cluster import resources
from cluster.config import ClusterConfig
from grpo_core.rewards.scoring import ScoreRequest

log = logging.getLogger(__name__)


def group_shards(group_ids: Sequence[Any], n_shards: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` row ranges of whole groups (a group is a run of equal
    ids), at most ``n_shards``, with group counts differing by at most one."""
    from cluster.rollout_workers import shards

    starts = [i for i, g in enumerate(group_ids) if i == 0 or g != group_ids[i - 1]]
    bounds = [*starts, len(group_ids)]
    return [(bounds[a], bounds[b]) for a, b in shards(len(starts), n_shards)]


def _score_shard(request: ScoreRequest):
    """One Ray task's shard, scored in its worker process."""
    return request.score_here()


def score_sharded(cfg: ClusterConfig, request: ScoreRequest):
    """``request`` scored over ``cfg.scoring.workers`` Ray tasks; returns the gathered
    ``grpo_core.rewards.scoring.ScoreResult``."""
    from cluster.ray_session import ensure_ray
    from grpo_core.rewards.scoring import ScoreResult, weighted_total

    ray = ensure_ray(cfg)
    resources.check(ray, "scoring", cfg.scoring, 1)  # one task at least must fit
    ranges = group_shards(list(request.group_ids), cfg.scoring.workers)
    remote = ray.remote(_score_shard).options(
        num_cpus=cfg.scoring.num_cpus, num_gpus=cfg.scoring.num_gpus, max_retries=1
    )  # a task whose worker process died runs once more (scoring is deterministic)
    calls = [remote.remote(request.rows(a, b)) for a, b in ranges]
    parts = []
    for call in calls:
        try:
            parts.append(ray.get(call))
        except ray.exceptions.RayTaskError as e:  # the task's own exception, as its type
            cause = e.as_instanceof_cause()
            raise cause from None
    names, n_rows = list(request.weights), len(request.completions)
    per_function = {n: [s for p in parts for s in p.per_function[n]] for n in names}
    errors = {n: [s for p in parts for s in p.errors[n]] for n in names}
    w = {k: float(v) for k, v in request.weights.items()}
    log.info("scored %d rows in %d Ray tasks", n_rows, len(ranges))
    return ScoreResult(per_function, errors, weighted_total(per_function, w, n_rows), w)

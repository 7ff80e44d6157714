"""What this process's Ray roles hold, and the check that a new worker can ever start.

The rollout replicas and the trainer group are actors that live for the whole run, holding
their CPUs and GPUs; scoring tasks come and go. A worker that asks for more than the cluster
has left beside the long-lived roles would wait forever, so it is refused at once with the
settings to change. A local Ray started for the run (no ``cluster.address``) is sized to
hold every role at once (:func:`local_num_cpus`)."""

from __future__ import annotations

import math
import os
import sys

from cluster.config import ClusterConfig, WorkerSettings
from grpo_core.errors import UserError

RESOURCES = ("CPU", "GPU")


def _each(group: WorkerSettings, res: str) -> float:
    return group.num_cpus if res == "CPU" else group.num_gpus


def held(*, besides: str) -> dict[str, float]:
    """CPUs and GPUs reserved by this process's long-lived roles other than ``besides``
    (``rollout``: the replicas; ``trainer``: the trainer group's actors)."""
    out = dict.fromkeys(RESOURCES, 0.0)
    replicas = sys.modules.get("cluster.rollout_workers")
    if besides != "rollout" and replicas is not None:
        for g in replicas.groups():
            for res in RESOURCES:
                out[res] += len(g.actors) * _each(g.group, res)
    trainers = sys.modules.get("cluster.trainer_group")
    if besides != "trainer" and trainers is not None:
        group = trainers.running()
        if group is not None:
            for res in RESOURCES:
                out[res] += len(group.actors) * _each(group.cfg.trainer, res)
    return out


def shortfall(ray, role: str, group: WorkerSettings, n: int) -> str | None:
    """Why ``n`` workers of ``group`` could never run at once on this Ray cluster beside the
    other roles of this process, or None when they fit."""
    total = ray.cluster_resources()
    others = held(besides=role)
    for res in RESOURCES:
        each = _each(group, res)
        need, have = n * each, total.get(res, 0.0)
        if need > have - others[res] + 1e-9:
            return (
                f"cluster.{role}: {n} worker(s) x num_{res.lower()}s={each:g} need {need:g} "
                f"{res}s; the Ray cluster has {have:g} and this run's other roles hold "
                f"{others[res]:g}; lower cluster.{role}.workers or cluster.{role}."
                f"num_{res.lower()}s (fractions work), or give Ray more (cluster.num_cpus)"
            )
    return None


def check(ray, role: str, group: WorkerSettings, n: int) -> None:
    """:func:`shortfall` as a :class:`UserError`."""
    why = shortfall(ray, role, group, n)
    if why:
        raise UserError(why)


def local_num_cpus(cfg: ClusterConfig) -> int:
    """CPUs of a local Ray started for the run: ``cluster.num_cpus`` when set, else this
    machine's CPUs or, when more, what every role asks for at once (Ray's CPUs are a count
    for placement; the roles share the cores either way)."""
    if cfg.num_cpus is not None:
        return cfg.num_cpus
    demand = sum(g.workers * g.num_cpus for g in (cfg.rollout, cfg.trainer, cfg.scoring))
    return max(os.cpu_count() or 1, math.ceil(demand - 1e-9))

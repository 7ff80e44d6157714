"""The trainer group: N Ray actors that run the GRPO update data-parallel, as one process does.

With ``cluster.backend: ray``, the update task (``tasks/update.py: run_update``) hands its
call to :func:`trainer_group`. The group is ``cluster.trainer.workers`` actors, each reserving
``num_cpus`` / ``num_gpus`` in one placement group (all of them or none are placed). Each actor
is one rank of a ``torch.distributed`` process group (``cluster.trainer.dist_backend``; the
address is rank 0's node IP and a port rank 0 found free there) and runs the function it is
given with that rank's ``grpo_core.training.distributed.DataParallel`` (``None`` for a single worker).

The actors live as long as the group: it is created on the first update and reused by every
later one while the ``cluster:`` settings and the Ray connection stay the same, so a model an
actor trained stays in that actor's memory (its learner: cluster/policies.py) for the next iteration.
:func:`release` (or the end of the process) stops them.

A rank that dies or raises ends the whole group (the others would wait in a collective
forever): every actor is killed and :class:`TrainerGroupError` names the role, the rank and
what was running (``rl_1 iteration 3 update``). The next call starts a fresh group; the
executor (cluster/executor.py: ``OnRay.update``) makes that call itself, up to
``cluster.trainer.max_restarts`` times, when the rank died (``lost``) rather than raised.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from cluster.config import ClusterConfig
from cluster.ray_session import ensure_ray

ROLE = "trainer"
PLACEMENT_TIMEOUT_S = 300.0  # how long the actors' resources may take to appear (autoscaling)
STRICT_WAIT_S = 10.0  # how long the strict placement is waited for before Ray's preference
REMOVAL_TIMEOUT_S = 30.0  # how long a closed group's placement may take to be given back
# process environment the actors get from the driver when it has them (a remote node does not
# inherit the driver's environment); OMP_NUM_THREADS is set from the worker's num_cpus
FORWARDED_ENV = (
    "HF_HUB_OFFLINE",
    "HF_HOME",
    "HF_HUB_DISABLE_PROGRESS_BARS",
    "TOKENIZERS_PARALLELISM",
    "TRANSFORMERS_VERBOSITY",
)

log = logging.getLogger(__name__)


class TrainerGroupError(RuntimeError):
    """A trainer rank died or failed; the group was stopped. ``lost``: the rank died (its
    process or node is gone), so the same work on a new group may succeed; else it raised."""

    def __init__(self, message: str, *, lost: bool = False) -> None:
        super().__init__(message)
        self.lost = lost


class TrainerWorker:
    """One rank of the trainer group (the class a Ray actor runs)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        dist_backend: str,
        strategy: str = "ddp",
        param_dtype: str | None = None,
    ):
        import torch

        self.rank, self.world_size, self.backend = rank, world_size, dist_backend
        self.strategy, self.param_dtype = strategy, param_dtype
        self.data_parallel = None
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    def address(self) -> tuple[str, int]:
        """This node's IP and a port free on it (rank 0: the process group's rendezvous)."""
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            return ip, s.getsockname()[1]

    def join(self, master_addr: str, master_port: int) -> int:
        """Join the process group (a single worker needs none); returns this process's id."""
        if self.world_size > 1:
            import torch
            import torch.distributed as dist

            from grpo_core.training.distributed import make_data_parallel

            if self.backend == "nccl":
                torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
            dist.init_process_group(
                self.backend,
                init_method=f"tcp://{master_addr}:{master_port}",
                rank=self.rank,
                world_size=self.world_size,
            )
            self.data_parallel = make_data_parallel(self.strategy, param_dtype=self.param_dtype)
        return os.getpid()

    def node_id(self) -> str:
        """The Ray node this rank runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def run(self, fn: Callable, kwargs: dict) -> Any:
        """``fn(data_parallel, **kwargs)``; rank 0 returns its result, the others ``None``."""
        out = fn(self.data_parallel, **kwargs)
        return out if self.rank == 0 else None


def _bundle(cfg: ClusterConfig) -> dict[str, float]:
    g = cfg.trainer
    return {k: v for k, v in (("CPU", g.num_cpus), ("GPU", g.num_gpus)) if v > 0}


def _env(cfg: ClusterConfig) -> dict[str, str]:
    threads = max(1, int(cfg.trainer.num_cpus))
    forwarded = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    from cluster import storage  # the run's shared store, where ranks pull and publish

    return {**forwarded, **storage.env(), "OMP_NUM_THREADS": str(threads)}


def _check_fits(ray, cfg: ClusterConfig) -> None:
    """A Ray started for this run (no ``address``) has no autoscaler: a request larger than
    it (beside the run's rollout replicas) is an error now rather than after the placement
    timeout."""
    from cluster.resources import shortfall

    why = None if cfg.address else shortfall(ray, ROLE, cfg.trainer, cfg.trainer.workers)
    if why:
        raise TrainerGroupError(why)


class TrainerGroup:
    """``cluster.trainer.workers`` actors joined in one process group."""

    def __init__(self, cfg: ClusterConfig):
        ray = ensure_ray(cfg)
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        g = cfg.trainer
        self.cfg, self.size = cfg, g.workers
        self.job = ray.get_runtime_context().get_job_id()
        bundle = _bundle(cfg)
        self.placement = None
        options: dict = {
            "num_cpus": g.num_cpus,
            "num_gpus": g.num_gpus,
            "max_restarts": 0,
            "runtime_env": {"env_vars": _env(cfg)},
        }
        if bundle:
            _check_fits(ray, cfg)
            self.placement = _strictly(ray, g.placement, bundle, g.workers)
            if self.placement is None:
                self.placement = placement_group([bundle] * g.workers, strategy=g.placement.upper())
            ready, _ = ray.wait([self.placement.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                _remove(self.placement)
                raise TrainerGroupError(
                    f"{ROLE} group: {g.workers} worker(s) of {bundle} (cluster.trainer.workers, "
                    f"num_cpus, num_gpus) could not be placed in {PLACEMENT_TIMEOUT_S:.0f} s; "
                    f"the cluster has {ray.cluster_resources()}, free "
                    f"{ray.available_resources()}: lower them or add nodes"
                )
        actor = ray.remote(TrainerWorker)
        self.actors = []
        for rank in range(g.workers):
            strategy = (
                PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=rank)
                if self.placement is not None
                else None
            )
            opts = {**options, **({"scheduling_strategy": strategy} if strategy else {})}
            self.actors.append(
                actor.options(**opts).remote(
                    rank, g.workers, g.dist_backend, g.strategy, g.fsdp_param_dtype
                )
            )
        try:
            addr, port = ray.get(self.actors[0].address.remote())
            self.pids = ray.get([a.join.remote(addr, port) for a in self.actors])
            self.nodes = ray.get([a.node_id.remote() for a in self.actors])
        except Exception as e:
            self.close()
            raise TrainerGroupError(
                f"{ROLE} group: starting {g.workers} worker(s) failed: {e}"
            ) from e
        log.info(
            "%s group: %d worker(s) of %s, %s, %s process group at %s:%d",
            ROLE,
            g.workers,
            bundle,
            g.strategy,
            g.dist_backend,
            addr,
            port,
        )

    def matches(self, cfg: ClusterConfig) -> bool:
        import ray

        same = (cfg.trainer, cfg.address) == (self.cfg.trainer, self.cfg.address)
        return (
            same
            and self.actors != []
            and ray.is_initialized()
            and ray.get_runtime_context().get_job_id() == self.job
        )

    def run(self, fn: Callable, kwargs: dict, *, what: str) -> Any:
        """``fn(data_parallel, **kwargs)`` on every rank; rank 0's result. ``what`` names the
        work in errors (``rl_1 iteration 3 update``). Any rank failing stops the group."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        refs = [a.run.remote(fn, kwargs) for a in self.actors]
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except (RayActorError, RayTaskError) as e:
                rank = refs.index(done[0])
                self.close()
                if isinstance(e, RayTaskError):
                    cause = e.cause if isinstance(e.cause, BaseException) else e
                    why = f"raised {type(cause).__name__}: {cause}"
                else:
                    why = "died (killed, out of memory, or its node was lost)"
                raise TrainerGroupError(
                    f"{what}: {ROLE} worker rank {rank} of {self.size} (pid "
                    f"{self.pids[rank]}, node {self.nodes[rank][:8]}) {why}; the {ROLE} "
                    "group was stopped",
                    lost=not isinstance(e, RayTaskError),
                ) from e
        return ray.get(refs[0])

    def close(self) -> None:
        """Kill the actors and free their placement group."""
        import ray

        # a group of an earlier Ray connection ended with it (there is nothing to kill)
        if ray.is_initialized() and ray.get_runtime_context().get_job_id() == self.job:
            for a in self.actors:
                ray.kill(a, no_restart=True)
            if self.placement is not None:
                _remove(self.placement)
        self.actors, self.placement = [], None


def _strictly(ray, placement: str, bundle: dict[str, float], workers: int):
    """The group placed as ``placement`` says without exception (Ray's STRICT_PACK: all
    ranks on one node; STRICT_SPREAD: one rank per node), when the cluster's nodes are big
    and many enough for it and it is placed within ``STRICT_WAIT_S``; else None, and the
    caller asks for Ray's PACK / SPREAD, which are preferences: Ray places against them
    when the resources are taken at that moment (by the other roles, or a group still being
    removed), so what a run gets would depend on timing."""
    from ray.util.placement_group import placement_group

    if workers < 2:
        return None
    need = {k: v * workers for k, v in bundle.items()} if placement == "pack" else bundle
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    fit = [n for n in nodes if all(n.get(k, 0) >= v for k, v in need.items())]
    if len(fit) < (1 if placement == "pack" else workers):
        return None
    group = placement_group([bundle] * workers, strategy=f"STRICT_{placement.upper()}")
    ready, _ = ray.wait([group.ready()], timeout=STRICT_WAIT_S)
    if ready:
        return group
    _remove(group)
    log.info("%s group: %d ranks could not be placed strictly %s in %.0f s; placing them "
             "as Ray prefers", ROLE, workers, placement, STRICT_WAIT_S)  # fmt: skip
    return None


def _remove(placement) -> None:
    """Remove a placement group and wait until Ray has given its bundles back. Ray removes
    one asynchronously: a group placed at once after (a restart, a new ``cluster:`` setting)
    would otherwise see the old one's CPUs still taken, and ``spread``, which Ray treats as a
    preference, would put its ranks on the nodes left free instead of one per node."""
    from ray.util import placement_group_table
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(placement)
    deadline = time.monotonic() + REMOVAL_TIMEOUT_S
    while placement_group_table(placement).get("state") != "REMOVED":
        if time.monotonic() > deadline:
            log.warning("%s group: its placement group was not removed in %.0f s",
                        ROLE, REMOVAL_TIMEOUT_S)  # fmt: skip
            return
        time.sleep(0.05)


_GROUP: dict[str, TrainerGroup] = {}


def trainer_group(cfg: ClusterConfig) -> TrainerGroup:
    """The process's trainer group for ``cfg``: the running one when its settings and Ray
    connection are unchanged, else a new one (the old one is stopped)."""
    group = _GROUP.get(ROLE)
    if group is not None and group.matches(cfg):
        return group
    release()
    _GROUP[ROLE] = TrainerGroup(cfg)
    return _GROUP[ROLE]


def running() -> TrainerGroup | None:
    """The process's trainer group, if one is up."""
    return _GROUP.get(ROLE)


def release() -> None:
    """Stop the trainer group, if any (its actors and their models go)."""
    group = _GROUP.pop(ROLE, None)
    if group is not None:
        group.close()

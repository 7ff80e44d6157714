"""The driver's side of the weight bus (cluster/weight_bus.py): bring the rollout replicas to
the policy the trainer group just trained, device to device.

:func:`broadcast` asks the trainer ranks whether they hold the policy (after an update they
do: the learner keeps it in memory) and for its tensors' names, shapes and dtypes; opens
the bus when there is none for these members (the first sync, a replica replaced, a new
trainer group); then starts every replica's receive and the trainer ranks' send together. It
returns False when the trainer group does not hold the policy (a stage's first policy, a
resumed run) or the setting does not ask for the bus: the replicas then read the checkpoint. A
member that fails during the transfer leaves the bus closed: every replica is started again
from the checkpoint (it exists: the trainer group wrote it before the sync), and the run goes
on. Each sync is recorded on the group (``RolloutGroup.weight_syncs``: how, bytes, seconds)."""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING

from cluster import weight_bus

if TYPE_CHECKING:
    from cluster.rollout_workers import RolloutGroup
    from cluster.trainer_group import TrainerGroup

log = logging.getLogger(__name__)


def _trainer() -> TrainerGroup | None:
    from cluster.trainer_group import running

    group = running()
    return group if group is not None and group.matches(group.cfg) else None


def wanted(setting: str, cfg) -> bool:
    """Whether ``cluster.rollout.weight_sync`` asks for the bus (``auto``: when the trainer
    ranks and the replicas have GPUs: ``benchmarks/bench_weight_sync.py`` measured gloo on
    CPU 7x slower than the replicas reading a local checkpoint)."""
    if setting == "auto":
        return cfg.trainer.num_gpus > 0 and cfg.rollout.num_gpus > 0
    return setting == "broadcast"


def backend(trainer: TrainerGroup, replicas: RolloutGroup) -> str:
    """NCCL when the trainer ranks and the replicas have GPUs, else gloo."""
    gpus = trainer.cfg.trainer.num_gpus > 0 and replicas.group.num_gpus > 0
    return "nccl" if gpus else "gloo"


def _open(trainer: TrainerGroup, replicas: RolloutGroup) -> str:
    """The bus of these members (trainer rank 0 and every replica), opened if needed."""
    members = (trainer.job, tuple(trainer.pids), replicas.replaced, len(replicas.actors))
    if replicas.bus is not None and replicas.bus[0] == members:
        return replicas.bus[1]
    ray = replicas.ray
    key = uuid.uuid4().hex[:12]
    addr, port = ray.get(trainer.actors[0].address.remote())
    world, how = 1 + len(replicas.actors), backend(trainer, replicas)
    joins = [
        a.join_bus.remote(key, addr, port, k + 1, world, how) for k, a in enumerate(replicas.actors)
    ]
    kwargs = {"key": key, "addr": addr, "port": port, "world": world, "backend": how}
    trainer.run(weight_bus.join_on_rank, kwargs, what="joining the weight bus")
    ray.get(joins)
    replicas.bus = (members, key)
    log.info("weight bus %s: trainer rank 0 and %d replica(s), %s", key, world - 1, how)
    return key


def _replace_dead(replicas: RolloutGroup, checkpoint: str, policy_id: str) -> None:
    """Start again, from ``checkpoint``, each replica that no longer answers."""
    from ray.exceptions import GetTimeoutError, RayActorError

    for k, actor in enumerate(replicas.actors):
        try:
            replicas.ray.get(actor.pid.remote(), timeout=weight_bus.TIMEOUT_S)
        except (RayActorError, GetTimeoutError) as e:
            log.warning("rollout replica %d is gone (%s); starting a fresh one from %s",
                        k, type(e).__name__, checkpoint)  # fmt: skip
            replicas.replace(k, checkpoint, policy_id)


def broadcast(replicas: RolloutGroup, checkpoint: str, policy_id: str) -> bool:
    """Every replica takes ``policy_id`` from trainer rank 0; False when the trainer group
    does not hold it (the caller loads ``checkpoint`` instead)."""
    from cluster.trainer_group import TrainerGroupError

    trainer = _trainer()
    if trainer is None or not wanted(replicas.group.weight_sync, trainer.cfg):
        return False
    what = f"weight sync to policy {policy_id}"
    try:
        entries = trainer.run(weight_bus.describe_on_rank, {"policy_id": policy_id}, what=what)
    except TrainerGroupError as e:
        log.warning("%s: %s; the replicas read %s", what, e, checkpoint)
        return False
    if entries is None:
        return False
    plan = weight_bus.buckets(entries, replicas.group.weight_sync_bucket_mb << 20)
    start = time.perf_counter()
    _replace_dead(replicas, checkpoint, policy_id)  # a dead member would stall the others
    try:
        key = _open(trainer, replicas)
        calls = [a.receive_weights.remote(key, plan, policy_id) for a in replicas.actors]
        kwargs = {"key": key, "policy_id": policy_id, "plan": plan}
        sent = trainer.run(weight_bus.send_on_rank, kwargs, what=what)
        replicas.ray.get(calls)
    except Exception as e:  # a member died or failed: the others may be mid-collective
        log.warning("%s on the weight bus failed (%s); the replicas restart from %s",
                    what, str(e).splitlines()[0], checkpoint)  # fmt: skip
        replicas.bus = None
        for k in range(len(replicas.actors)):
            replicas.replace(k, checkpoint, policy_id)
        replicas.weight_syncs.append({"how": "restart", "policy_id": policy_id})
        return True
    seconds = time.perf_counter() - start
    replicas.synced = [policy_id] * len(replicas.actors)
    replicas.weight_syncs.append(
        {"how": "broadcast", "policy_id": policy_id, "bytes": sent, "seconds": seconds,
         "buckets": len(plan)}
    )  # fmt: skip
    log.info("%s: %.1f MiB in %d bucket(s) to %d replica(s) over the weight bus in %.2f s",
             what, sent / 2**20, len(plan), len(replicas.actors), seconds)  # fmt: skip
    return True

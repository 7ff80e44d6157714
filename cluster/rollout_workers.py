"""Rollout replicas: ``cluster.rollout.workers`` Ray actors, each holding a rollout engine.

The prompts of a call are cut into contiguous shards (sizes differ by at most one prompt),
one per replica; each replica samples its shard with the same :class:`SamplingParams` except
the seed (:func:`shard_seed`), and the samples are gathered back in prompt order, so the
caller writes the same rollout Parquet as a local run: same columns, prompt-major rows.

Replicas start once per process (per engine spec and worker group) from the checkpoint the
first call names, which every worker must see (a local Ray, or a shared filesystem). When a
later call names another policy, trainer rank 0 broadcasts it to them device to device
(cluster/weight_sync.py), or each reads the checkpoint the trainer group wrote; with
``check_sync`` the driver holds the model, its weights are put in Ray's object store once
(``ray.put`` of the state dict) and every replica loads them, and the driver's greedy
completion of the probe prompt is compared with each replica's (``rollout.check_sync``): a
replica that differs raises ``WeightSyncError`` naming it.

A replica that dies during a call (its process killed, its node lost) is replaced by a fresh
one, started from the checkpoint being sampled, which redoes that shard with the same seed
(``retries`` times, default once); then :class:`RolloutWorkerError` names the worker and the
call. Nothing is written here: the caller writes the gathered rows atomically.

Ray is imported only inside the functions (``cluster.ray_session.ensure_ray``)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

from cluster import resources
from cluster.config import ClusterConfig, RolloutSettings
from cluster.replica import Replica, actor_options, takes_adapters

if TYPE_CHECKING:
    from grpo_core.engines.generation import Sample
    from grpo_core.engines.turns import SampleRequest

log = logging.getLogger(__name__)


class RolloutWorkerError(RuntimeError):
    """A rollout replica died and its shard could not be redone."""


def shards(n_items: int, n_shards: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` ranges over ``n_items``, at most ``n_shards`` of them,
    sizes differing by at most one (no empty range)."""
    n_shards = max(1, min(n_shards, n_items))
    base, extra = divmod(n_items, n_shards)
    out, start = [], 0
    for k in range(n_shards):
        end = start + base + (k < extra)
        out.append((start, end))
        start = end
    return [r for r in out if r[1] > r[0]]


def shard_seed(seed: int | None, shard: int) -> int | None:
    """The sampling seed of shard ``shard``: shard 0 keeps ``seed`` (so one replica samples
    exactly what the local engine samples), shard k > 0 takes the first 63 bits of
    ``sha256("<seed>/<k>")``. ``None`` (unseeded) stays ``None``."""
    if seed is None or shard == 0:
        return seed
    digest = hashlib.sha256(f"{seed}/{shard}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class RolloutGroup:
    """``workers`` replicas of one engine spec, kept for the life of the process."""

    def __init__(
        self,
        ray,
        group: RolloutSettings,
        *,
        engine: str,
        engine_options: Mapping | None,
        load_options: Mapping | None,
        checkpoint: str,
        policy_id: str,
        tokenizer,
    ) -> None:
        self.ray = ray
        self.group = group
        self.engine = engine
        self._init = (engine, dict(engine_options or {}), dict(load_options or {}), tokenizer)
        resources.check(ray, "rollout", group, group.workers)
        self.actors = [self._start(checkpoint, policy_id) for _ in range(group.workers)]
        self.synced = [policy_id] * group.workers
        self.replaced = 0  # replicas started again after one died
        self.served: list[str] = []  # each generate call's ``desc`` (rollouts, evals, ...)
        self._dtype: str | None = None  # what the replicas sample in (asked once)
        self.inflight: list = []  # object refs of the call in progress (for tests and logs)
        self.bus: tuple | None = None  # (members, key) of the weight bus (cluster/weight_sync.py)
        self.weight_syncs: list[dict] = []  # how each new policy reached the replicas
        log.info("started %d %s rollout replicas on %s", group.workers, engine, checkpoint)

    def _start(self, checkpoint: str, policy_id: str):
        engine, opts, load, tokenizer = self._init
        cls = self.ray.remote(Replica).options(**actor_options(self.group))
        return cls.remote(str(checkpoint), policy_id, engine, opts, load, tokenizer)

    def sync(
        self,
        checkpoint: str,
        policy_id: str,
        model,
        tokenizer,
        *,
        check: bool = False,
        bus: bool = True,
    ) -> None:
        """Bring every replica to ``policy_id``'s weights. ``model`` None (the driver holds
        no weights): trainer rank 0 broadcasts them (``cluster.rollout.weight_sync``,
        cluster/weight_sync.py) or each replica reads ``checkpoint``. Else one
        ``ray.put`` of ``model``'s state dict, loaded by each replica that holds other
        weights; with ``check``, each one's greedy probe completion must equal ``model``'s.
        A replica found dead is started again from ``checkpoint`` (which holds those
        weights)."""
        stale = [i for i, pid in enumerate(self.synced) if pid != policy_id]
        if not stale:
            return
        adapters = takes_adapters(self._init[1])  # LoRA: the checkpoint's adapter/ folder
        if model is None or adapters:  # the driver sends no weights
            from cluster import weight_sync

            if bus and not adapters and weight_sync.broadcast(self, checkpoint, policy_id):
                return
            self._load_from(checkpoint, policy_id, stale)
            how = "adapter" if adapters else "checkpoint"
            self.weight_syncs.append({"how": how, "policy_id": policy_id})
            if check and model is not None:
                self._check_probe(model, tokenizer, policy_id)
            return
        from grpo_core.engines import WeightSyncError, default_probe, trainer_probe
        from grpo_core.training import lora

        state = lora.merged_state_dict(model) if lora.is_peft(model) else model.state_dict()
        ref = self.ray.put({k: v.detach().cpu() for k, v in state.items()})
        probe = expected = None
        if check:
            probe = default_probe(tokenizer)
            expected = trainer_probe(model, tokenizer, probe)  # as grpo_core.engines.probe_sync
        calls = {i: self.actors[i].load_weights.remote(ref, policy_id, probe) for i in stale}
        for i, call in calls.items():
            try:
                got = self._get(call, i, f"weight sync to policy {policy_id}", fatal=False)
            except _ReplicaDied as died:
                log.warning("rollout replica %d died (%s); starting a fresh one", i, died)
                self.replace(i, checkpoint, policy_id)
                got = None
                if check:
                    call = self.actors[i].load_weights.remote(ref, policy_id, probe)
                    got = self._get(call, i, f"weight sync to policy {policy_id}")
            if check and got != expected:
                raise WeightSyncError(
                    f"rollout replica {i} ({self.engine} engine) after weight sync to policy "
                    f"{policy_id}: greedy probe gave {got}, the trainer's model {expected}"
                )
            self.synced[i] = policy_id

    def _load_from(self, checkpoint: str, policy_id: str, stale: list[int]) -> None:
        calls = {i: self.actors[i].load_checkpoint.remote(checkpoint, policy_id) for i in stale}
        for i, call in calls.items():
            what = f"loading policy {policy_id} from {checkpoint}"
            try:
                if not self._get(call, i, what, fatal=False):  # an adapter on another base
                    log.info("rollout replica %d: %s sits on another base; restarting it", i,
                             checkpoint)  # fmt: skip
                    self.replace(i, checkpoint, policy_id)
            except _ReplicaDied as died:
                log.warning("rollout replica %d died (%s); starting a fresh one", i, died)
                self.replace(i, checkpoint, policy_id)  # starts from that checkpoint
            self.synced[i] = policy_id

    def _check_probe(self, model, tokenizer, policy_id: str) -> None:
        """Each replica's greedy probe completion must equal ``model``'s."""
        from grpo_core.engines import WeightSyncError, default_probe, trainer_probe

        probe = default_probe(tokenizer)
        expected = trainer_probe(model, tokenizer, probe)
        for i, actor in enumerate(self.actors):
            got = self._get(actor.probe.remote(probe), i, f"probing policy {policy_id}")
            if got != expected:
                raise WeightSyncError(
                    f"rollout replica {i} ({self.engine} engine) after weight sync to policy "
                    f"{policy_id}: greedy probe gave {got}, the trainer's model {expected}"
                )

    def dtype(self) -> str:
        if self._dtype is None:
            self._dtype = self._get(self.actors[0].dtype.remote(), 0, "asking its dtype")
        return self._dtype

    def generate(
        self,
        prompt_ids: list[list[int]],
        request: SampleRequest,
        *,
        checkpoint: str,
        policy_id: str,
        retries: int = 1,
    ) -> list[Sample]:
        """``request.params.n`` samples per prompt from the replicas (already synced to
        ``policy_id``), in prompt-major order; shard k samples with ``shard_seed(seed, k)``."""
        desc, params = request.desc, request.params
        self.served.append(desc)
        ranges = shards(len(prompt_ids), len(self.actors))
        shard_requests = [
            request.shard(a, b, dataclasses.replace(params, seed=shard_seed(params.seed, k)))
            for k, (a, b) in enumerate(ranges)
        ]
        calls = [
            self.actors[k].generate.remote(prompt_ids[a:b], shard_requests[k])
            for k, (a, b) in enumerate(ranges)
        ]
        self.inflight = calls
        out: list[Sample] = []
        try:
            for k, ((a, b), call) in enumerate(zip(ranges, calls, strict=True)):
                for attempt in range(retries + 1):
                    try:
                        part = self._get(call, k, desc, fatal=attempt == retries, tries=attempt)
                        break
                    except _ReplicaDied as died:
                        log.warning(
                            "%s: rollout replica %d died (%s); redoing its %d prompts on a "
                            "fresh replica",
                            desc,
                            k,
                            died,
                            b - a,
                        )
                        self.replace(k, checkpoint, policy_id)
                        call = self.actors[k].generate.remote(prompt_ids[a:b], shard_requests[k])
                out.extend(dataclasses.replace(s, prompt_index=s.prompt_index + a) for s in part)
        finally:
            self.inflight = []
        return out

    def replace(self, k: int, checkpoint: str, policy_id: str) -> None:
        with contextlib.suppress(Exception):  # already gone
            self.ray.kill(self.actors[k])
        self.actors[k] = self._start(checkpoint, policy_id)
        self.synced[k] = policy_id
        self.replaced += 1

    def _get(self, call, k: int, what: str, *, fatal: bool = True, tries: int = 0):
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        try:
            return self.ray.get(call)
        except (RayActorError, ActorDiedError, ActorUnavailableError) as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if not fatal:
                raise _ReplicaDied(reason) from e
            again = f" (after {tries} retries on a fresh replica)" if tries else ""
            raise RolloutWorkerError(
                f"rollout replica {k} of {len(self.actors)} ({self.engine} engine) died during "
                f"{what}{again}: {reason}; nothing was written"
            ) from e

    def close(self) -> None:
        for a in self.actors:
            with contextlib.suppress(Exception):
                self.ray.kill(a)
        self.actors = []


class _ReplicaDied(Exception):
    pass


_GROUPS: dict[str, RolloutGroup] = {}
_LOCK = threading.Lock()


def _key(cfg: ClusterConfig, engine: str, engine_options, load_options, config) -> str:
    """What a group of replicas is: resources, engine spec, load options, architecture."""
    arch = config.to_dict()
    for k in ("_name_or_path", "transformers_version"):
        arch.pop(k, None)
    spec = [cfg.rollout.model_dump(), engine, engine_options or {}, load_options or {}, arch]
    return json.dumps(spec, sort_keys=True, default=str)


def sample(
    cfg: ClusterConfig,
    prompt_ids: list[list[int]],
    request: SampleRequest,
    *,
    checkpoint: str,
    policy_id: str,
    model,
    tokenizer,
    config=None,
    retries: int = 1,
    bus: bool = True,
) -> list[Sample]:
    """Sample ``request`` (grpo_core/engines/turns.py) on the process's rollout replicas (started on
    first use, then synced to ``model``'s weights whenever ``policy_id`` changes; ``model``
    None: they load ``checkpoint`` themselves, ``config`` its config); a replica that dies
    is replaced and its shard redone ``retries`` times."""
    from cluster.ray_session import ensure_ray

    ray = ensure_ray(cfg)
    engine, engine_options = request.engine, request.engine_options
    load_options = request.load_options
    key = _key(
        cfg, engine, engine_options, load_options, model.config if config is None else config
    )
    with _LOCK:
        group = _GROUPS.get(key)
        if group is None:
            for old in _GROUPS.values():  # one group at a time: replicas hold their resources
                old.close()
            _GROUPS.clear()
            group = _GROUPS[key] = RolloutGroup(
                ray,
                cfg.rollout,
                engine=engine,
                engine_options=engine_options,
                load_options=load_options,
                checkpoint=str(checkpoint),
                policy_id=policy_id,
                tokenizer=tokenizer,
            )
        group.sync(str(checkpoint), policy_id, model, tokenizer, check=request.check_sync, bus=bus)
        return group.generate(
            prompt_ids, request, checkpoint=str(checkpoint), policy_id=policy_id, retries=retries
        )


def groups() -> list[RolloutGroup]:
    return list(_GROUPS.values())


def replica_dtype() -> str:
    """What the current replica group samples in (the group the last sample call used)."""
    with _LOCK:
        (group,) = _GROUPS.values()
    return group.dtype()


def close_all() -> None:
    """Stop every replica of this process (before Ray shuts down)."""
    with _LOCK:
        for g in _GROUPS.values():
            g.close()
        _GROUPS.clear()

"""Where a stage's heavy work runs, behind one interface: this process (:class:`Local`) or
the Ray cluster (:class:`OnRay`), chosen by ``cluster.backend`` (``cluster/runtime.py:
executor()``). The tasks hand their work to the executor and never ask which one it is:

- ``sample``: completions for prompt ids from a policy (the warm engine of this process, or
  the rollout replicas, ``cluster/rollout_workers.py``);
- ``score``: the reward functions over rows (here, or Ray tasks over shards of whole
  groups, ``cluster/scoring.py``);
- ``update``: a training call (here, or on every rank of the trainer group,
  ``cluster/trainer_group.py``);
- ``rollout_shards``: how many replicas share an iteration's prompts (part of a rollout's
  cache key: each shard samples with its own seed).

Both keep this process's rollout engines (``engines``). With ``rl.async_level`` > 0 the
schedule (flows/rl_schedule.py) calls ``hold`` on the policy it names for a rollout before
the next update changes it: :class:`Local` freezes those weights for its engine process
(cluster/engine_process.py), :class:`OnRay` makes its replicas read the checkpoints the
trainer group writes (the group is busy with the next update, so no weight bus). The
held-out evaluation samples where the rollouts do (``eval_run``): with this process's
engine (or HF generate) locally, on the rollout replicas on Ray.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from cluster.config import ClusterConfig
from cluster.engines_here import engine_for, sample_here, with_lora_rank
from cluster.policies import Policies
from grpo_core.engines import WarmEngines
from grpo_core.engines.turns import SampleRequest
from grpo_core.rewards.scoring import ScoreRequest

__all__ = ["Local", "OnRay", "for_config", "trainer_threads", "with_lora_rank"]

log = logging.getLogger(__name__)


class Policy(Protocol):
    """The policy to sample from: its weights in memory and the checkpoint they came from
    (a read-only handle: tasks/policies/trainer.py)."""

    checkpoint: Path
    policy_id: str
    model: Any
    tokenizer: Any


class Local:
    """Everything in this process."""

    remote_sampling = False  # samples with this process's engines (OnRay: on the replicas)

    def __init__(self, cfg: ClusterConfig | None = None) -> None:
        self.cfg = cfg or ClusterConfig()
        self.engines = WarmEngines()  # kept alive across iterations, weights synced in memory
        self.policies = Policies()  # the learner the stages train, models loaded to sample
        self.held: dict[str, Any] = {}  # policy_id -> engine_process.Snapshot
        self._engine_process = None  # started with the first snapshot sampled
        self._threads: int | None = None  # torch threads before an overlapping stage

    def recoveries(self) -> dict[str, float]:
        """Lost workers replaced so far (:class:`OnRay`); one process has none to lose."""
        return {}

    def hold(self, policy_id: str, load: Callable[[], Policy], source: str | Path) -> None:
        """Freeze the weights of ``policy_id`` (``load()``: a handle on them)
        now, for a rollout that runs while the trainer goes on (``source``: a checkpoint
        folder of their architecture, the stage's initial one)."""
        from cluster import engine_process

        if policy_id not in self.held:
            self.held[policy_id] = engine_process.snapshot(load(), source, policy_id)

    def held_policy(self, policy_id: str):
        """The snapshot :meth:`hold` took of ``policy_id``, or None."""
        return self.held.get(policy_id)

    def release(self, policy_id: str) -> None:
        """The snapshot's rollouts are done: free its memory."""
        self.held.pop(policy_id, None)

    def overlap(self, on: bool) -> None:
        """An RL stage starts (``on``) or ends overlapping rollouts with updates. While on,
        this process keeps the cores the engine process does not take (its torch threads are
        set back at the end)."""
        import torch

        if on and self._threads is None:
            self._threads = torch.get_num_threads()
            torch.set_num_threads(trainer_threads(self.cfg, self._threads))
        if not on:
            self.held.clear()
            if self._threads is not None:
                torch.set_num_threads(self._threads)
                self._threads = None

    def wants_weights(self, request: SampleRequest) -> bool:
        """Whether sampling ``request`` needs the policy's weights in this process (else a
        handle on its checkpoint will do: ``tasks/policies/files.py``)."""
        return True

    def eval_run(self, policy: Policy, request: SampleRequest):
        """How a held-out eval samples ``policy`` (``run(prompt_ids, request)``, the hook of
        grpo_core/algorithm/evaluation.py: ``evaluate``): None, HF generate on the policy in
        memory in this process (the hf engine, no environment), or this process's warm engine
        running the request (with an environment, ``request.tools``, through the turn loop)."""
        if request.engine == "hf" and not request.tools:
            return None
        eng = self.engine(
            policy, request.engine, request.engine_options, check_sync=request.check_sync
        )
        return functools.partial(_run_on, eng)

    def served_here(self) -> tuple | None:
        """``(start, end)`` (``time.monotonic``) of the engine process's work on this
        thread's last snapshot sampled, or None."""
        proc = self._engine_process
        return getattr(proc.served, "span", None) if proc is not None else None

    def _elsewhere(self):
        from cluster import engine_process
        from cluster.state import STATE

        if self._engine_process is None:
            self._engine_process = engine_process.EngineProcess(
                threads=self.cfg.rollout.num_cpus, model_section=STATE.model.model_dump()
            )
        return self._engine_process

    def rollout_shards(self, n_prompts: int) -> int:
        return 1

    def sampled_dtype(self, policy: Policy) -> str:
        """The dtype of the model that samples ``policy`` (a rollout file records it)."""
        from grpo_core.training.checkpoint import dtype_name

        if policy.model is None:  # a snapshot, sampled by the engine process
            return policy.dtype
        return dtype_name(policy.model)

    def engine(self, policy: Policy, name: str, options: Mapping | None, *, check_sync: bool):
        """This process's engine ``name`` holding ``policy``'s weights (kept across calls);
        with ``lora_sync: adapter`` and ``model.lora``, one taking adapters of that rank."""
        return engine_for(self.engines, policy, name, options, check_sync=check_sync)

    def sample(self, policy: Policy, prompt_ids: list[list[int]], request: SampleRequest) -> list:
        """``request`` (grpo_core/engines/turns.py) for each prompt, through the turn loop, with this
        process's engine; a held snapshot's with the engine process."""
        if policy.model is None:  # a snapshot (:meth:`hold`): the engine process samples it
            return self._elsewhere().sample(policy, prompt_ids, request)
        offload = self.policies.optimizer_to_cpu
        return sample_here(self.engines, policy, prompt_ids, request, offload=offload)

    def score(self, request: ScoreRequest):
        """``request`` (grpo_core/rewards/scoring.py) scored in this process."""
        return request.score_here()

    def update(
        self,
        run: Callable[..., Any],
        on_rank: Callable[..., Any],
        kwargs: dict,
        *,
        what: str,
        out_checkpoint: str,
    ):
        """``run(**kwargs)``; ``on_rank`` is the per-rank form :class:`OnRay` uses."""
        return run(**kwargs)

    def close(self) -> None:
        self.policies.clear()  # the learner's queued checkpoint writes finish
        self.engines.close()
        if self._engine_process is not None:
            self._engine_process.close()
            self._engine_process = None


class OnRay(Local):
    """Rollouts (and held-out evals) on the rollout replicas, scoring as Ray tasks, updates
    on the trainer group."""

    remote_sampling = True
    overlapped = False  # rollouts run beside the trainer group's update (:meth:`overlap`)
    trainer_restarts = 0  # trainer groups started again after a rank died (:meth:`update`)
    seconds_lost = 0.0  # wall time of the failed attempts and the new groups' start

    def recoveries(self) -> dict[str, float]:
        """What this process has recovered from so far: trainer groups started again after
        a rank died, rollout replicas started again after one died (a stage logs the
        difference over its run: flows/rl.py)."""
        from cluster import rollout_workers

        replaced = sum(g.replaced for g in rollout_workers.groups())
        return {"trainer_restarts": self.trainer_restarts, "replicas_replaced": replaced,
                "trainer_seconds_lost": self.seconds_lost}  # fmt: skip

    def overlap(self, on: bool) -> None:
        """While on, the replicas read each policy's checkpoint (the trainer group wrote
        it): the weight bus would wait for the trainer group, busy with the next update.
        This process's threads stay: it samples nothing."""
        self.overlapped = on

    def hold(self, policy_id, load, source) -> None:
        """Nothing to freeze: the replicas read the checkpoint."""

    def wants_weights(self, request: SampleRequest) -> bool:
        """The replicas load the checkpoint; the driver's copy only for the sync probe."""
        return request.check_sync

    def eval_run(self, policy, request: SampleRequest):
        """On the rollout replicas, as the rollouts (the driver, often on a node without a
        GPU, holds no engine)."""
        return functools.partial(self.sample, policy)

    def rollout_shards(self, n_prompts: int) -> int:
        return min(self.cfg.rollout.workers, n_prompts)

    def sampled_dtype(self, policy) -> str:
        from cluster import rollout_workers

        return rollout_workers.replica_dtype()

    def sample(self, policy, prompt_ids, request: SampleRequest) -> list:
        """On the replicas; ``policy.model`` None (``tasks/policies/files.py``): they load the
        weights from ``policy.checkpoint`` themselves."""
        from cluster import rollout_workers
        from cluster.state import STATE

        options = with_lora_rank(request.engine_options, STATE.model)
        return rollout_workers.sample(
            self.cfg,
            prompt_ids,
            dataclasses.replace(request, engine_options=options),
            checkpoint=str(policy.checkpoint),
            policy_id=policy.policy_id,
            model=policy.model,
            config=policy.config,
            tokenizer=policy.tokenizer,
            bus=not self.overlapped,
        )

    def score(self, request: ScoreRequest):
        from cluster.scoring import score_sharded

        return score_sharded(self.cfg, request)

    def update(
        self,
        run: Callable[..., Any],
        on_rank: Callable[..., Any],
        kwargs: dict,
        *,
        what: str,
        out_checkpoint: str,
    ):
        """``on_rank(data_parallel, **kwargs)`` on every rank of the trainer group; rank 0
        writes ``out_checkpoint`` (maybe on another node) and shares it through the store. A
        failed group leaves no temporary checkpoint beside it. A group that lost a rank is
        started again and the work redone, up to ``cluster.trainer.max_restarts`` times:
        the new ranks hold nothing, so the update's ``learner_for`` loads the policy version
        it starts from explicitly (tasks/policies/trainer.py), as a resumed run does."""
        from cluster import storage
        from cluster.trainer_group import ROLE, TrainerGroupError, trainer_group

        restarts = self.cfg.trainer.max_restarts
        failed_at = None  # when the first failed attempt began
        for attempt in range(restarts + 1):
            began = time.perf_counter()
            try:
                group = trainer_group(self.cfg)
                redo = time.perf_counter()  # the work itself starts: the rest was lost
                result = group.run(on_rank, kwargs, what=what)
            except TrainerGroupError as e:
                out = Path(out_checkpoint)
                for tmp in out.parent.glob(f".{out.name}.tmp-*"):  # rank 0 killed mid-save
                    shutil.rmtree(tmp, ignore_errors=True)
                if not e.lost or attempt == restarts:
                    raise
                self.trainer_restarts += 1
                failed_at = began if failed_at is None else failed_at
                log.warning("%s; starting a new %s group (restart %d of %d): its ranks load "
                            "the policy again and redo the work", e, ROLE, attempt + 1,
                            restarts)  # fmt: skip
                continue
            if failed_at is not None:
                lost = redo - failed_at
                self.seconds_lost += lost
                log.warning("%s: redone on a new %s group (ranks on nodes %s), %.1f s lost",
                            what, ROLE, ", ".join(n[:8] for n in group.nodes), lost)  # fmt: skip
            for path in storage.pull(out_checkpoint):
                log.info("pulled %s from the shared store", path)
            storage.mark_synced(out_checkpoint)
            return result


def trainer_threads(cfg: ClusterConfig, now: int) -> int:
    """This process's torch threads beside the engine process: ``cluster.trainer.num_cpus``
    when set, else the cores the engine's ``cluster.rollout.num_cpus`` leave (at most
    ``now``)."""
    if "num_cpus" in cfg.trainer.model_fields_set:
        return max(1, int(cfg.trainer.num_cpus))
    engine = max(1, int(cfg.rollout.num_cpus))
    return max(1, min(now, (os.cpu_count() or 1) - engine))


def for_config(cfg: ClusterConfig) -> Local:
    return OnRay(cfg) if cfg.uses_ray else Local(cfg)


def _run_on(engine, prompt_ids: list[list[int]], request: SampleRequest) -> list:
    """``request`` for each prompt with ``engine`` (a held-out eval's, kept warm)."""
    return request.run(engine, prompt_ids, progress=True)

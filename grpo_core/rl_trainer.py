"""The RL trainer: one GRPO update of a policy from a scored file's rows.

It owns what an RL stage's update needs besides the policy: the stage's optimizer (its
identity and how to build it fresh: :class:`RLOptimization`; resumed by
``grpo_core/trainer.py: continue_train_state``), where the old log-probs come from
(:func:`old_logprobs_for`), and the update itself (:func:`train_on_scored`: the RNG states
set from the train state, the kept rows' batch, ``grpo_update`` under a parallel strategy,
the train state advanced). One process or N ranks run the same code: the strategy
(``grpo_core/parallel.py``) is where they differ.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from grpo_core.checkpoint import compute_dtype_name, policy_id
from grpo_core.config import RLConfig
from grpo_core.loss_config import BehaviourWeight
from grpo_core.memory import PeakMemory
from grpo_core.old_logprobs import engine_correction_choice, old_logprobs_source
from grpo_core.parallel import LOCAL, LocalParallel
from grpo_core.precision import new_scaler
from grpo_core.rollouts import read_metadata_of
from grpo_core.scored_batch import ScoredRows
from grpo_core.trainer import TrainState
from grpo_core.trainer_state import rng_state, set_rng_state
from grpo_core.update import grpo_update

log = logging.getLogger(__name__)


@dataclass
class RLOptimization:
    """An RL stage's optimizer and schedule: ``key`` says what a saved state belongs to (it
    is reused only under the same key), :meth:`build` makes a fresh one."""

    rl: RLConfig
    key: dict
    total_steps: int

    @classmethod
    def of_stage(
        cls,
        rl: RLConfig,
        *,
        stage: str,
        init_checkpoint: str,
        global_step: int,
        total_steps: int | None = None,
        sharded: bool = False,
    ) -> RLOptimization:
        """The optimizer of ``stage``, which started from ``init_checkpoint``; its schedule
        runs over ``total_steps`` (default: this update's steps after ``global_step``)."""
        per_update = rl.optimizer_steps_per_generation * rl.num_iterations
        total = total_steps or (global_step + per_update)
        key = {
            "stage": stage,
            "init_policy_id": policy_id(init_checkpoint),
            "learning_rate": rl.learning_rate,
            "weight_decay": rl.weight_decay,
            "warmup_steps": rl.warmup_steps,
            "lr_scheduler_type": rl.lr_scheduler_type,
            "total_steps": total,
            # the default is left out so that trainer states saved before the choice existed match
            **({"optim": rl.optim} if rl.optim != "adamw_torch" else {}),
            # a sharded optimizer's saved state is keyed by parameter name, a replica's by index
            **({"strategy": "fsdp"} if sharded else {}),
        }
        return cls(rl, key, total)

    def build(self, model):
        """A fresh ``(optimizer, scheduler)`` over ``model`` at step 0."""
        return self.rl.optimization.build(model, total_steps=self.total_steps, section="rl")


def engine_correction_for(
    rows: ScoredRows, rl: RLConfig, model, *, quantized: bool = False, policy: str | None = None
):
    """``rl`` with ``vllm_importance_sampling_correction`` decided for these rows
    (``auto``: grpo_core/old_logprobs.py, ``engine_correction_choice``; ``policy``: the id of
    the weights being updated, against the rows' sampling policies), and the reason. Rows
    that get a behaviour weight (:func:`behaviour_weight_for`) get no engine correction: the
    behaviour weight divides by the same sampler's log-probs, the engine's mismatch included."""
    if behaviour_weight_for(rows, rl, policy) is not None:
        why = (
            f"off: rows sampled by an older policy get rl.behaviour_weight={rl.behaviour_weight} "
            "(pi_prox / mu per token, the engine's mismatch included)"
        )
        return rl.model_copy(update={"vllm_importance_sampling_correction": False}), why
    on, why = engine_correction_choice(
        rl.vllm_importance_sampling_correction,
        file_meta=read_metadata_of(rows.table),
        model_dtype=compute_dtype_name(model),
        bf16=rl.bf16,
        fp16=rl.fp16,
        quantized=quantized,
        old_logprobs=rl.old_logprobs,
    )
    return rl.model_copy(update={"vllm_importance_sampling_correction": on}), why


def behaviour_weight_for(rows: ScoredRows, rl: RLConfig, policy: str | None):
    """The behaviour weight of these rows (a ``BehaviourWeight``), or None: on when an older
    policy than ``policy`` sampled them (``rl.async_level``), ``rl.behaviour_weight`` is not
    ``none`` and old log-probs are recomputed (with ``old_logprobs: sampler`` the ratio itself
    is against the sampler: plain off-policy PPO)."""
    if policy is None or rl.behaviour_weight == "none" or rl.old_logprobs == "sampler":
        return None
    if set(rows.table.column("policy_id").unique().to_pylist()) == {policy}:
        return None
    return BehaviourWeight(mode=rl.behaviour_weight, cap=rl.behaviour_weight_cap)


def old_logprobs_for(
    rows: ScoredRows, rl: RLConfig, model, *, policy: str, quantized: bool = False
) -> tuple[str, str]:
    """``rl.old_logprobs`` resolved for these rows and the policy being updated (``model``,
    whose weights are ``policy``; ``quantized``: loaded in 4 bits): ``(source, reason)``."""
    return old_logprobs_source(
        rl.old_logprobs,
        file_meta=read_metadata_of(rows.table),
        policy_ids=set(rows.table.column("policy_id").unique().to_pylist()),
        policy_id=policy,
        temperature=rl.temperature,
        model_dtype=compute_dtype_name(model),
        bf16=rl.bf16,
        fp16=rl.fp16,
        quantized=quantized,
        disable_dropout=rl.disable_dropout,
        engine_correction=rl.vllm_importance_sampling_correction is True
        or behaviour_weight_for(rows, rl, policy) is not None,
    )


@dataclass
class RLUpdate:
    """What one update did: one metrics dict per optimizer step, the stage's step after it,
    the seconds and peak memory of the optimizer steps."""

    history: list[dict]
    global_step: int
    seconds: float
    peak_memory_gib: float


def train_on_scored(
    model,
    train: TrainState,
    rows: ScoredRows,
    rl: RLConfig,
    *,
    old_logprobs: str,
    pad_id: int,
    reference: Callable[[], object] | None = None,
    on_step: Callable[[dict], None] | None = None,
    parallel: LocalParallel = LOCAL,
    logger: logging.Logger | logging.LoggerAdapter | None = None,
    behaviour_weight: BehaviourWeight | None = None,
) -> RLUpdate:
    """GRPO steps on ``rows``' kept rows from ``train`` (the stage's state at its
    ``global_step``), which is advanced in place: step count and RNG states, as the
    checkpoint written next saves them.

    ``old_logprobs``: ``"sampler"`` or ``"recompute"`` (:func:`old_logprobs_for`);
    ``reference()``: the reference model, asked for only when rows are trained on;
    ``parallel``: this process's strategy (a rank of N, or the default one process);
    ``behaviour_weight``: stale rows' weights (:func:`behaviour_weight_for`). Every
    step's metrics get the rows' metrics (dynamic sampling) and ``peak_memory_gib``.
    """
    logger = logger or log
    set_rng_state(train.rng)  # as saved with the policy checkpoint, resumed or not
    cfg = dataclasses.replace(
        rl.update_config(), old_logprobs=old_logprobs, behaviour_weight=behaviour_weight
    )
    history: list[dict] = []
    seconds = 0.0
    mem = PeakMemory(model.device)
    if rows.keep:
        sampler = (
            rl.vllm_importance_sampling_correction is True
            or old_logprobs == "sampler"
            or behaviour_weight is not None
        )
        batch = rows.batch(
            pad_id, mask_truncated=rl.mask_truncated_completions, sampling_logprobs=sampler
        )
        ref = reference() if reference is not None else None
        if rl.fp16 and train.scaler is None:  # the stage's loss scaler, kept with its state
            train.scaler = new_scaler(next(model.parameters()).device.type)
        start = time.perf_counter()
        with mem:
            history = grpo_update(
                model,
                train.optimizer,
                train.scheduler,
                batch,
                cfg,
                ref_model=ref,
                on_step=on_step,
                data_parallel=parallel,
                scaler=train.scaler,
            )
        seconds = time.perf_counter() - start
    else:
        logger.warning("%s: no group with reward variance; no update this iteration", rows.path)
    train.global_step, train.rng = train.global_step + len(history), rng_state()
    bad = [h for h in history if not math.isfinite(h["loss"])]
    if bad:
        logger.warning("%d update steps had a non-finite loss", len(bad))
    extra = {**rows.metrics, "peak_memory_gib": mem.gib}
    for h in history:
        h.update(extra)
    return RLUpdate(history, train.global_step, seconds, mem.gib)

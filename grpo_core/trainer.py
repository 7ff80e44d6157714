"""The training state that SFT and the RL update share: the optimizer and learning-rate
schedule (:func:`build_optimization`, by Hugging Face ``TrainingArguments`` names), and an
RL stage's :class:`TrainState` (AdamW, schedule, RNG states after ``global_step`` steps),
which :func:`continue_train_state` resumes exactly: from memory when it is the state saved
with the checkpoint, else from the checkpoint's ``trainer_state.pt``, fresh at the stage's
first step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from grpo_core.checkpoint import load_trainer_state
from grpo_core.optim import build_optimizer
from grpo_core.precision import restore_scaler
from grpo_core.schedule import lr_lambda
from grpo_core.trainer_state import rng_state, seed_all

log = logging.getLogger(__name__)


def build_optimization(
    model,
    optim: str,
    *,
    learning_rate: float,
    weight_decay: float,
    warmup_steps: int,
    total_steps: int,
    lr_scheduler_type: str = "constant",
    section: str = "rl",
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """A fresh optimizer over ``model``'s trainable parameters and its schedule at step 0
    (warmup, then ``lr_scheduler_type`` over ``total_steps``); ``section`` names the config
    section in errors."""
    opt = build_optimizer(
        model, optim, lr=learning_rate, weight_decay=weight_decay, section=section
    )
    schedule = lr_lambda(warmup_steps, total_steps, lr_scheduler_type)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule)


@dataclass
class TrainState:
    """An RL stage's optimizer, LR scheduler and RNG states after ``global_step`` steps:
    what ``trainer_state.pt`` of the checkpoint written at that step holds."""

    key: dict  # the stage's identity: stage, init policy_id, optimizer and schedule settings
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    global_step: int
    rng: dict  # grpo_core.trainer_state.rng_state() as saved with the checkpoint
    scaler: torch.amp.GradScaler | None = None  # fp16's loss scaler (grpo_core/precision.py)

    def state_dict(self) -> dict:
        out = {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "optimizer_key": self.key,
            "global_step": self.global_step,
            "rng": self.rng,
        }
        if self.scaler is not None:
            out["grad_scaler"] = self.scaler.state_dict()
        return out


def continue_train_state(
    model: torch.nn.Module,
    checkpoint: Path,
    live: TrainState | None,
    *,
    key: dict,
    global_step: int,
    build: Callable[[torch.nn.Module], tuple[torch.optim.Optimizer, object]],
    seed: int = 0,
    load_optimizer: Callable | None = None,
    logger: logging.Logger | logging.LoggerAdapter | None = None,
) -> TrainState:
    """The optimizer, scheduler and RNG states to continue a stage at ``global_step``.

    ``build(model)`` makes a fresh ``(optimizer, scheduler)`` positioned at step 0. At
    ``global_step`` 0 the state is fresh and the RNGs are seeded from ``seed``. Later, it is
    the in-memory state when that is the one saved at ``checkpoint`` (same ``key`` and
    step), else the checkpoint's ``trainer_state.pt`` (same key and step). When neither
    exists (pruned, or written by other settings), a warning says so and the optimizer
    starts fresh with the schedule positioned at ``global_step``: the result then differs
    from an uninterrupted run's. ``load_optimizer(model, optimizer, state)`` loads a saved
    optimizer state where ``optimizer.load_state_dict`` cannot (a sharded model's).
    ``logger``: where the resume is said (default: this module's logger).
    """
    logger = logger or log
    if global_step > 0 and live is not None and live.key == key and live.global_step == global_step:
        return live
    opt, sched = build(model)
    if global_step > 0:
        saved = load_trainer_state(checkpoint)
        if (
            isinstance(saved, dict)
            and saved.get("optimizer_key") == key
            and saved.get("global_step") == global_step
            and saved.get("optimizer")
            and saved.get("scheduler")
        ):
            if load_optimizer is not None:
                load_optimizer(model, opt, saved["optimizer"])
            else:
                opt.load_state_dict(saved["optimizer"])  # after the scheduler set step 0's lr
            sched.load_state_dict(saved["scheduler"])
            logger.info("%s: optimizer state at step %d from disk", checkpoint, global_step)
            device = next(model.parameters()).device.type
            scaler = restore_scaler(saved.get("grad_scaler"), device)
            return TrainState(key, opt, sched, global_step, saved["rng"], scaler)
        logger.warning(
            "%s has no trainer state for %s at step %d (pruned or other settings): AdamW "
            "starts fresh, so this stage will not match an uninterrupted run; rerun it with "
            "--force %s to retrain it exactly",
            checkpoint,
            key.get("stage"),
            global_step,
            key.get("stage"),
        )
        for _ in range(global_step):  # the schedule still follows the stage's step count
            sched.step()
    seed_all(seed)
    return TrainState(key, opt, sched, global_step, rng_state())

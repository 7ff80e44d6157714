"""The train state the core owns: what a training run needs, besides the weights, to go
on exactly where it stopped. :class:`TrainState` holds the optimizer, the learning-rate
schedule, fp16's loss scaler, the RNG states, the step, the model it trains and the id of
those weights; :meth:`TrainState.resume` continues a run from memory, from a checkpoint's
``trainer_state.pt`` or fresh. An RL stage's optimizer is identified by
:class:`RLOptimization` (a saved state is reused only under the same key). The RL update
(grpo_core/algorithm/iteration.py) advances a ``TrainState``; SFT (grpo_core/training/sft.py) saves the same
pieces in its resume checkpoints, as TRL/accelerate save ``rng_state.pth`` beside
``optimizer.pt`` and ``scheduler.pt``.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from grpo_core.logprobs.precision import restore_scaler
from grpo_core.training.checkpoint import load_trainer_state

if TYPE_CHECKING:
    from grpo_core.config.stages import RLConfig

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """A training run's state after ``global_step`` optimizer steps: the optimizer, LR
    scheduler, fp16 loss scaler and RNG states, the ``model`` they train and the id of its
    weights when known. An RL stage's is what ``trainer_state.pt`` of the checkpoint written
    at that step holds (:meth:`state_dict`, :meth:`resume`); SFT keeps its own in its resume
    checkpoints (grpo_core/training/sft.py)."""

    key: dict  # the stage's identity: stage, init policy_id, optimizer and schedule settings
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    global_step: int
    rng: dict  # rng_state() as saved with the checkpoint
    scaler: torch.amp.GradScaler | None = (
        None  # fp16's loss scaler (grpo_core/logprobs/precision.py)
    )
    model: torch.nn.Module | None = None  # what the optimizer steps
    policy_id: str | None = None  # the id of ``model``'s weights at ``global_step``, if known

    @classmethod
    def fresh(cls, model, rl, *, seed: int = 0, stage: str = "rl", init_policy_id: str = "",
              total_steps: int | None = None) -> TrainState:  # fmt: skip
        """Step 0 of an RL run over ``model`` (a notebook's, or a stage's first update):
        the RNGs seeded from ``seed``, a fresh optimizer and schedule of ``rl``'s settings."""
        optimization = RLOptimization.of(rl, stage=stage, init_policy_id=init_policy_id,
                                         global_step=0, total_steps=total_steps)  # fmt: skip
        return cls.resume(model, None, None, key=optimization.key, global_step=0,
                          build=optimization.build, seed=seed)  # fmt: skip

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

    @classmethod
    def resume(
        cls,
        model: torch.nn.Module,
        checkpoint: Path | None,
        live: TrainState | None,
        *,
        key: dict,
        global_step: int,
        build: Callable[[torch.nn.Module], tuple[torch.optim.Optimizer, object]],
        seed: int = 0,
        load_optimizer: Callable | None = None,
        logger: logging.Logger | logging.LoggerAdapter | None = None,
    ) -> TrainState:
        """The state to continue a run over ``model`` at ``global_step``.

        ``build(model)`` makes a fresh ``(optimizer, scheduler)`` positioned at step 0. At
        ``global_step`` 0 the state is fresh and the RNGs are seeded from ``seed``. Later, it
        is ``live`` (the state in memory) when that is the one saved at ``checkpoint`` (same
        ``key`` and step), else the checkpoint's ``trainer_state.pt`` (same key and step).
        When neither exists (pruned, or written by other settings), a warning says so and
        the optimizer starts fresh with the schedule positioned at ``global_step``: the
        result then differs from an uninterrupted run's. ``load_optimizer(model, optimizer,
        state)`` loads a saved optimizer state where ``optimizer.load_state_dict`` cannot (a
        sharded model's). ``logger``: where the resume is said (default: this module's).
        """
        state = _resume(model, checkpoint, live, key=key, global_step=global_step, build=build,
                        seed=seed, load_optimizer=load_optimizer, logger=logger or log)  # fmt: skip
        state.model = model
        return state


@dataclass
class RLOptimization:
    """An RL stage's optimizer and schedule at ``global_step``: ``key`` says what a saved
    state belongs to (it is reused only under the same key), :meth:`build` makes a fresh
    one."""

    rl: RLConfig
    key: dict
    total_steps: int
    global_step: int = 0

    @classmethod
    def of(
        cls,
        rl: RLConfig,
        *,
        stage: str,
        init_policy_id: str,
        global_step: int,
        total_steps: int | None = None,
        sharded: bool = False,
    ) -> RLOptimization:
        """The optimizer of ``stage``, which started from the weights ``init_policy_id``
        (``checkpoint.policy_id`` of its first checkpoint); its schedule runs over
        ``total_steps`` (default: this update's steps after ``global_step``)."""
        per_update = rl.optimizer_steps_per_generation * rl.num_iterations
        total = total_steps or (global_step + per_update)
        key = {
            "stage": stage,
            "init_policy_id": init_policy_id,
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
        return cls(rl, key, total, global_step)

    def build(self, model):
        """A fresh ``(optimizer, scheduler)`` over ``model`` at step 0."""
        return self.rl.optimization.build(model, total_steps=self.total_steps, section="rl")


def _resume(
    model, checkpoint, live, *, key, global_step, build, seed, load_optimizer, logger
) -> TrainState:
    """:meth:`TrainState.resume`."""
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


def rng_state() -> dict:
    """The global RNG states: torch (CPU and every CUDA device), Python ``random``, numpy."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        pass
    return state


def set_rng_state(state) -> None:
    """Restore what :func:`rng_state` returned (a bare tensor: torch's CPU state only, as
    trainer states written before these helpers hold)."""
    if isinstance(state, torch.Tensor):
        torch.set_rng_state(state)
        return
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def seed_all(seed: int) -> None:
    """Seed torch (all devices), Python ``random`` and numpy."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass


def load_weights_(model: torch.nn.Module, ckpt_dir: str | Path) -> None:
    """Copy a checkpoint's weights into ``model`` in place (tied weights, shards and dtype
    handled by ``from_pretrained``); the model keeps its identity, device and dtype, so an
    optimizer built on its parameters stays valid."""
    from grpo_core.training import lora
    from grpo_core.training.checkpoint import load_checkpoint

    if lora.is_peft(model):  # a LoRA policy: its adapter, saved in adapter/
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        saved = load_file(str(Path(ckpt_dir) / lora.ADAPTER_DIR / "adapter_model.safetensors"))
        with torch.no_grad():
            set_peft_model_state_dict(model, saved)
        return
    loaded, _ = load_checkpoint(ckpt_dir, device="cpu")  # copied into ``model``'s device
    with torch.no_grad():
        model.load_state_dict(loaded.state_dict(), strict=True)
    del loaded

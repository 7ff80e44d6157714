"""Mixed precision for training (TRL/``TrainingArguments`` names ``bf16`` and ``fp16``).

``bf16``: the forward runs under ``torch.autocast(dtype=torch.bfloat16)`` (CPU or CUDA); the
weights, their gradients and the optimizer state stay float32 (the master weights), and
log-probs stay float32 (``grpo_core.logprobs.lm_head`` turns autocast off for the head's math).
``fp16``: the same with float16 and a ``torch.amp.GradScaler`` (the loss is scaled before
``backward`` and the gradients unscaled before clipping), CUDA only: float16 autocast without
a scaler underflows gradients, and there is no reason to use it on a CPU. The scaler's state
(scale, growth tracker) belongs to the training run, not to one generation batch: the RL
stage keeps it in its ``TrainState`` and SFT in its resume state, and each step says whether
the scaler skipped it (``grad_scaler/skipped``: a gradient was inf/nan).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch


@dataclass
class Precision:
    bf16: bool = False
    fp16: bool = False
    device_type: str = "cpu"
    scaler: torch.amp.GradScaler | None = field(default=None, repr=False)

    @classmethod
    def for_model(
        cls,
        model,
        *,
        bf16: bool = False,
        fp16: bool = False,
        section: str = "rl",
        scaler: torch.amp.GradScaler | None = None,
    ):
        """Check the settings against the model; errors name ``<section>.bf16``/``fp16``.
        ``scaler``: the run's loss scaler, continued (default with fp16: a fresh one)."""
        if bf16 and fp16:
            raise ValueError(f"{section}.bf16 and {section}.fp16 are both true: choose one")
        device_type = next(model.parameters()).device.type
        if fp16 and device_type != "cuda":
            raise ValueError(
                f"{section}.fp16 needs a CUDA device (the model is on {device_type}): fp16 "
                f"training needs loss scaling on a GPU; use {section}.bf16 on a CPU"
            )
        if bf16 or fp16:
            low = {p.dtype for p in model.parameters() if p.requires_grad} - {torch.float32}
            if low:
                name = "bf16" if bf16 else "fp16"
                raise ValueError(
                    f"{section}.{name} keeps float32 master weights, but the trainable weights "
                    f"are {sorted(str(d) for d in low)}: load the model in float32 "
                    f"(model.dtype: float32) or turn {section}.{name} off"
                )
        if scaler is None and fp16:
            scaler = new_scaler(device_type)
        return cls(bf16=bf16, fp16=fp16, device_type=device_type, scaler=scaler)

    def autocast(self):
        """The forward pass's context: autocast to bf16/fp16, or nothing."""
        if not (self.bf16 or self.fp16):
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.bf16 else torch.float16
        return torch.autocast(self.device_type, dtype=dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def unscale_(self, optimizer) -> None:
        """Before clipping: the gradients in their true scale."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer) -> dict:
        """The optimizer step; with a scaler, the step's ``grad_scaler/*`` metrics."""
        if self.scaler is None:
            optimizer.step()
            return {}
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)  # skipped when a gradient is inf/nan
        self.scaler.update()  # ... and then the scale is lowered
        scale = self.scaler.get_scale()
        return {"grad_scaler/skipped": float(scale < before), "grad_scaler/scale": scale}


def new_scaler(device_type: str) -> torch.amp.GradScaler:
    return torch.amp.GradScaler(device_type)


def restore_scaler(state: dict | None, device_type: str) -> torch.amp.GradScaler | None:
    """A scaler from its saved ``state_dict`` (None: none was saved)."""
    if not state:
        return None
    scaler = new_scaler(device_type)
    scaler.load_state_dict(state)
    return scaler

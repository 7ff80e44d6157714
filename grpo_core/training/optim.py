"""The optimizer of the RL update and of SFT, by Hugging Face ``TrainingArguments.optim`` name.

- ``adamw_torch``: ``torch.optim.AdamW`` (the default), torch's implementation for the device:
  the multi-tensor (``foreach``) one on CUDA, a loop over the tensors on a CPU;
- ``adamw_torch_foreach``: the same, with the multi-tensor implementation forced on (how CUDA
  runs it; on a CPU, the way to run the GPU code path);
- ``adamw_torch_fused``: the same, fused (``fused=True``; CUDA, and CPU since torch 2.4);
- ``adamw_bnb_8bit``: ``bitsandbytes.optim.AdamW8bit`` (8-bit optimizer state, Dettmers et al.,
  2022, arXiv:2110.02861), CUDA only; install the ``gpu`` extra.

Only trainable parameters are handed over (with LoRA, the adapter's). Under FSDP2
(grpo_core/training/fsdp.py) some are ``DTensor`` shards and the rest plain tensors; torch's
multi-tensor and fused AdamW refuse a list that mixes the two ("got mixed torch.Tensor and
DTensor"), so each kind gets its own parameter group (same settings): the optimizer runs one
call per group. A model without shards has one group, as before.
"""

from __future__ import annotations

import torch

OPTIMIZERS = ("adamw_torch", "adamw_torch_foreach", "adamw_torch_fused", "adamw_bnb_8bit")
TORCH_ADAMW = {"adamw_torch": {}, "adamw_torch_foreach": {"foreach": True}}
TORCH_ADAMW["adamw_torch_fused"] = {"fused": True}


def param_groups(params: list[torch.nn.Parameter]) -> list[dict]:
    """The parameters in one group per kind: FSDP2's ``DTensor`` shards, then plain tensors
    (one group when there is one kind)."""
    if not torch.distributed.is_available():
        return [{"params": params}]
    from torch.distributed.tensor import DTensor

    sharded = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    return [{"params": group} for group in (sharded, plain) if group]


def build_optimizer(
    model, name: str, *, lr: float, weight_decay: float = 0.0, section: str = "rl"
) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"{section}: the model has no trainable parameter")
    if name in TORCH_ADAMW:
        groups = param_groups(params)
        return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, **TORCH_ADAMW[name])
    if name == "adamw_bnb_8bit":
        device_type = params[0].device.type
        if device_type != "cuda":
            raise ValueError(
                f"{section}.optim='adamw_bnb_8bit' needs a CUDA device (the model is on "
                f"{device_type}); use {section}.optim='adamw_torch'"
            )
        try:
            import bitsandbytes as bnb
        except ImportError as e:
            raise ImportError(
                f"{section}.optim='adamw_bnb_8bit' needs bitsandbytes: "
                "pip install 'grpo-pipeline[gpu]' (or pip install bitsandbytes)"
            ) from e
        return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"{section}.optim must be one of {OPTIMIZERS}, got {name!r}")


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
    from grpo_core.training.schedule import lr_lambda

    opt = build_optimizer(
        model, optim, lr=learning_rate, weight_decay=weight_decay, section=section
    )
    schedule = lr_lambda(warmup_steps, total_steps, lr_scheduler_type)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule)

"""The optimizer of the RL update and of SFT, by Hugging Face ``TrainingArguments.optim`` name.

- ``adamw_torch``: ``torch.optim.AdamW`` (the default);
- ``adamw_bnb_8bit``: ``bitsandbytes.optim.AdamW8bit`` (8-bit optimizer state, Dettmers et al.,
  2022, arXiv:2110.02861), CUDA only; install the ``gpu`` extra.

Only trainable parameters are handed over (with LoRA, the adapter's).
"""

from __future__ import annotations

import torch

OPTIMIZERS = ("adamw_torch", "adamw_bnb_8bit")


def build_optimizer(
    model, name: str, *, lr: float, weight_decay: float = 0.0, section: str = "rl"
) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"{section}: the model has no trainable parameter")
    if name == "adamw_torch":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
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

"""What a training loop needs, besides the weights, to resume exactly: random number
generator states and in-place weight loading. SFT (``grpo_core/sft.py``) and the RL update
(``tasks/update.py``) save these with their checkpoints, as TRL/accelerate save
``rng_state.pth`` beside ``optimizer.pt`` and ``scheduler.pt``.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch


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
    from grpo_core import lora
    from grpo_core.checkpoint import load_checkpoint

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

"""The optimizer's state off the accelerator while a colocated rollout engine generates
(``rollout.vllm.offload_optimizer``; verl calls it optimizer offload): AdamW keeps two float32
moments per trainable parameter, 8 bytes each, which sit idle on the GPU during generation
and would otherwise shrink vLLM's KV cache. :func:`offload` moves them to CPU memory and
notes where each lived; :func:`restore` moves them back before the next optimizer step (each
tensor to its own device: AdamW's ``step`` counters stay on the CPU when they were there).
Nothing happens for tensors already on the CPU.
"""

from __future__ import annotations

import torch

_WHERE = "_grpo_offloaded_from"  # attribute on the optimizer: {(param index, key): device}


def offload(optimizer: torch.optim.Optimizer) -> int:
    """Move every state tensor not on the CPU there; the bytes moved."""
    if getattr(optimizer, _WHERE, None):
        return 0  # already offloaded
    where, moved = {}, 0
    for i, state in enumerate(optimizer.state.values()):
        for key, value in state.items():
            if torch.is_tensor(value) and value.device.type != "cpu":
                where[i, key] = value.device
                moved += value.numel() * value.element_size()
                state[key] = value.to("cpu", non_blocking=False)
    setattr(optimizer, _WHERE, where)
    return moved


def restore(optimizer: torch.optim.Optimizer) -> int:
    """Move what :func:`offload` moved back to where it was; the bytes moved."""
    where = getattr(optimizer, _WHERE, None)
    if not where:
        return 0
    moved = 0
    for i, state in enumerate(optimizer.state.values()):
        for key, value in state.items():
            device = where.get((i, key))
            if device is not None:
                state[key] = value.to(device)
                moved += value.numel() * value.element_size()
    setattr(optimizer, _WHERE, {})
    return moved


def is_offloaded(optimizer: torch.optim.Optimizer) -> bool:
    return bool(getattr(optimizer, _WHERE, None))

"""The update batch of one generation: prompt and completion ids padded into an
:class:`~grpo_core.contracts.batch.UpdateBatch`, the overlong filter applied (DAPO,
``grpo_core/algorithm/sampling_filters.py``), and every advantage checked finite first."""

from __future__ import annotations

import torch

from grpo_core.algorithm.sampling_filters import mask_truncated_completions
from grpo_core.contracts.batch import UpdateBatch

MAX_ADVANTAGE = 1e8  # beyond it the squared gradients overflow float32 in the clip's norm


def check_advantages(advantages, where: str = "build_batch", hint: str = "") -> None:
    """Refuse a NaN, infinite or absurd (beyond +-``MAX_ADVANTAGE``) advantage, naming the
    first bad row: a NaN turns every weight NaN in the first step, and an advantage of 1e30
    overflows the gradient norm, so the step silently leaves the weights as they were."""
    import math

    for i, a in enumerate(advantages):
        a = float(a) if a is not None else None
        if a is None or not math.isfinite(a) or abs(a) > MAX_ADVANTAGE:
            raise ValueError(
                f"{where}: row {i}: advantage is {a!r}, expected a finite number within "
                f"+-{MAX_ADVANTAGE:g}" + (f" ({hint})" if hint else "")
            )


def build_batch(
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    advantages: list[float],
    pad_id: int,
    *,
    truncated: list[bool] | None = None,
    group_ids: list[int] | None = None,
    sampling_logprobs: list[list[float]] | None = None,
    loss_masks: list[list[int] | None] | None = None,
) -> UpdateBatch:
    """Pad rollouts into an :class:`UpdateBatch` (advantages checked: :func:`check_advantages`). ``truncated`` rows get an all-zero mask
    (TRL's ``mask_truncated_completions``); ``group_ids`` must be group-contiguous.
    ``loss_masks``: per row, which completion tokens the model wrote (1) and which an
    environment added (0: no loss, not counted in any normaliser); None: all the model's."""
    import numpy as np  # row-by-row fills in numpy: ~10x fewer tiny torch ops

    check_advantages(advantages)
    N = len(prompt_ids)
    P = max(len(p) for p in prompt_ids)
    T = max(1, max(len(c) for c in completion_ids))
    ids = np.full((N, P + T), pad_id, dtype=np.int64)
    attn = np.zeros((N, P + T), dtype=np.int64)
    comp = np.zeros((N, T), dtype=np.float32)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
        ids[i, P - len(p) : P] = p
        attn[i, P - len(p) : P + len(c)] = 1
        ids[i, P : P + len(c)] = c
        comp[i, : len(c)] = 1.0 if loss_masks is None or loss_masks[i] is None else loss_masks[i]
    ids, attn, comp_mask = torch.from_numpy(ids), torch.from_numpy(attn), torch.from_numpy(comp)
    if truncated is not None:
        comp_mask = mask_truncated_completions(comp_mask, torch.tensor(truncated, dtype=torch.bool))
    adv = torch.tensor(advantages, dtype=torch.float32)
    gids = None if group_ids is None else torch.tensor(group_ids, dtype=torch.long)
    samp = None
    if sampling_logprobs is not None:
        samp_np = np.zeros((N, T), dtype=np.float32)
        for i, lp in enumerate(sampling_logprobs):
            samp_np[i, : len(lp)] = lp
        samp = torch.from_numpy(samp_np)
    return UpdateBatch(ids, attn, ids[:, P:], comp_mask, adv, P, gids, samp)

"""Which completions and tokens count: DAPO filters, truncation and entropy masks.

- :func:`mask_truncated_completions`: DAPO (Yu et al., 2025, arXiv:2503.14476, section 3.4,
  "overlong filtering"), TRL's ``mask_truncated_completions``: a completion cut by the length
  limit contributes no token to the loss.
- :func:`dynamic_sampling_mask`: DAPO's dynamic sampling (section 3.2) as a filter: drop the
  groups whose rewards are all equal (zero advantage, no gradient). DAPO then samples more
  prompts to refill the batch; here the batch is trained smaller instead (fewer groups per
  optimizer step), and ``dynamic_sampling/kept_frac`` says how much was kept.
- :func:`top_entropy_mask`: "Beyond the 80/20 rule" (Wang et al., 2025, arXiv:2506.01939),
  TRL's ``top_entropy_quantile``: the policy gradient only flows through the highest-entropy
  ``top_entropy_quantile`` fraction of the completion tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor


def mask_truncated_completions(mask: Tensor, truncated: Tensor) -> Tensor:
    """Zero the mask rows of truncated completions (``truncated[B]`` bool, e.g. finish=length)."""
    return mask * (~truncated.bool()).unsqueeze(-1).to(mask.dtype)  # [B, T]


def dynamic_sampling_mask(advantages: Tensor, group_ids: Tensor) -> Tensor:
    """Bool ``[N]``: True for completions of groups with some non-zero advantage.

    A group without reward variance has advantages exactly 0 (``grpo_core.algorithm.advantages`` decides
    "no variance" once, by ``zero_std``), so this drops precisely the groups counted in
    ``frac_reward_zero_std``, and works on any scored file, whatever made its advantages.
    """
    if advantages.shape != group_ids.shape or advantages.dim() != 1:
        raise ValueError("advantages and group_ids must be 1-D of equal length")
    _, inverse = torch.unique(group_ids, return_inverse=True)  # [N]
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    nonzero = (advantages != 0).to(torch.long)  # [N]
    per_group = torch.zeros(n_groups, dtype=torch.long, device=advantages.device).index_add_(
        0, inverse, nonzero
    )  # [G]
    return per_group[inverse] > 0  # [N]


def top_entropy_mask(entropy: Tensor, mask: Tensor, top_entropy_quantile: float) -> Tensor:
    """Bool ``[B, T]``: completion tokens whose entropy is in the top ``top_entropy_quantile``.

    As TRL: threshold = ``quantile(entropies of mask tokens, 1 - top_entropy_quantile)``,
    keep tokens with entropy >= threshold. ``top_entropy_quantile = 1`` keeps every token.
    """
    if not 0.0 <= top_entropy_quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in [0, 1], got {top_entropy_quantile}")
    on = mask.bool()  # [B, T]
    values = entropy.detach()[on].float()  # [M]
    if values.numel() == 0:
        return torch.zeros_like(on)
    threshold = torch.quantile(values, 1.0 - top_entropy_quantile)
    return (entropy.detach() >= threshold) & on  # [B, T]

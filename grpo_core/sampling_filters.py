"""Which completions and tokens count: DAPO filters, truncation and entropy masks.

- :func:`mask_truncated_completions`: DAPO (Yu et al., 2025, arXiv:2503.14476, section 3.4,
  "overlong filtering"), TRL's ``mask_truncated_completions``: a completion cut by the length
  limit contributes no token to the loss.
- :func:`overlong_penalty`: DAPO's soft overlong punishment (eq. 13), added to the reward.
- :func:`dynamic_sampling_mask` / :class:`DynamicSamplingBuffer`: DAPO's dynamic sampling
  (section 3.2): drop groups whose rewards are all equal (zero advantage, no gradient) and keep
  sampling until the batch holds enough informative groups.
- :func:`top_entropy_mask`: "Beyond the 80/20 rule" (Wang et al., 2025, arXiv:2506.01939),
  TRL's ``top_entropy_quantile``: the policy gradient only flows through the highest-entropy
  ``top_entropy_quantile`` fraction of the completion tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_core.advantages import group_moments


def mask_truncated_completions(mask: Tensor, truncated: Tensor) -> Tensor:
    """Zero the mask rows of truncated completions (``truncated[B]`` bool, e.g. finish=length)."""
    return mask * (~truncated.bool()).unsqueeze(-1).to(mask.dtype)  # [B, T]


def overlong_penalty(
    lengths: Tensor, max_completion_length: int, overlong_buffer_length: int
) -> Tensor:
    """DAPO eq. 13, ``L_max = max_completion_length``, ``L_cache = overlong_buffer_length``::

    0                               if |y| <= L_max - L_cache
    ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
    -1                              if |y| > L_max
    """
    if not 0 < overlong_buffer_length <= max_completion_length:
        raise ValueError("need 0 < overlong_buffer_length <= max_completion_length")
    soft_start = max_completion_length - overlong_buffer_length
    n = lengths.to(torch.float32)  # [N]
    penalty = (soft_start - n) / overlong_buffer_length  # [N]
    penalty = torch.clamp(penalty, max=0.0)
    return torch.where(n > max_completion_length, torch.full_like(n, -1.0), penalty)  # [N]


def dynamic_sampling_mask(rewards: Tensor, group_ids: Tensor, *, atol: float = 0.0) -> Tensor:
    """Bool ``[N]``: True for completions of groups whose valid rewards are not all equal."""
    m = group_moments(rewards, group_ids)
    return m.std > atol  # [N]


@dataclass
class DynamicSamplingBuffer:
    """Accumulates informative groups across sampling rounds until ``target_groups`` are held.

    ``add`` takes one round's ``rewards[N]`` and ``group_ids[N]`` and returns the indices of the
    completions it keeps (those of informative groups, up to the target); the caller keeps the
    rows with those indices. ``full`` says when to stop; ``max_rounds`` bounds the resampling.
    """

    target_groups: int
    max_rounds: int = 10
    groups_kept: int = 0
    rounds: int = 0
    groups_seen: int = 0

    @property
    def full(self) -> bool:
        return self.groups_kept >= self.target_groups

    @property
    def exhausted(self) -> bool:
        return self.rounds >= self.max_rounds

    def add(self, rewards: Tensor, group_ids: Tensor) -> Tensor:
        self.rounds += 1
        keep = dynamic_sampling_mask(rewards, group_ids)  # [N]
        kept: list[Tensor] = []
        for gid in torch.unique(group_ids).tolist():
            rows = (group_ids == gid).nonzero().squeeze(-1)  # [n_g]
            self.groups_seen += 1
            if self.full or not bool(keep[rows[0]]):
                continue
            kept.append(rows)
            self.groups_kept += 1
        return torch.cat(kept) if kept else torch.zeros(0, dtype=torch.long)

    def metrics(self) -> dict[str, float]:
        seen = max(self.groups_seen, 1)
        return {
            "dynamic_sampling/rounds": float(self.rounds),
            "dynamic_sampling/kept_group_frac": self.groups_kept / seen,
        }


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

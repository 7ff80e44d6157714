"""Advantage estimators for group-based policy optimisation.

Every estimator has one signature, ``fn(rewards[N], group_ids[N], **opts) -> advantages[N]``,
and is registered by name in ``ADVANTAGE_ESTIMATORS`` (grpo_core/config/loss.py, with what the
config checks of it; call them through :func:`compute`, which also takes your own as
``"module:function"``).

- ``grpo``: DeepSeekMath (Shao et al., 2024, arXiv:2402.03300) outcome supervision,
  ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)``, with TRL's ``scale_rewards``:
  ``"group"`` (the paper), ``"batch"`` (std of all rewards in the batch, Hu et al. REINFORCE++
  style) or ``"none"`` (Dr. GRPO, Liu et al., 2025, arXiv:2503.20783).
- ``dr_grpo``: ``grpo`` with ``scale_rewards="none"``.
- ``rloo``: REINFORCE Leave-One-Out (Ahmadian et al., 2024, arXiv:2402.14740),
  ``A_i = r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean(r_group))``.

The std is the unbiased (Bessel-corrected) one, as in TRL and verl. ``NaN`` rewards (a reward
function returned ``None``) are left out of every group statistic and get advantage 0, as TRL
does. A group without reward variance gets advantage exactly 0, never NaN and never the float
residue of ``r - mean`` (eight rewards of 1.1 leave a std of ~1e-16): :func:`zero_std` decides
"no variance" for the estimators, the metrics and dynamic sampling alike, as TRL does
(``isclose(std, 0)``). Group ids are arbitrary labels: groups need not be contiguous or of
equal size.

Multi-reward aggregation (TRL's ``multi_objective_aggregation``): :func:`compute_multi` with
``"sum_then_normalize"`` (weighted sum of the reward functions, then the estimator) or
``"normalize_then_sum"`` (GDPO, group reward-decoupled normalisation: normalise each reward
function within its group, sum with weights, then normalise over the batch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from grpo_core.config.loss import ADVANTAGE_ESTIMATORS
from grpo_core.rewards.scoring import weighted_reward_sum

AdvantageFn = Callable[..., Tensor]
__all__ = ["ADVANTAGE_ESTIMATORS", "compute", "compute_multi"]
SCALE_REWARDS = ("group", "batch", "none")
MULTI_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


class GroupMoments(NamedTuple):
    """Per-sample view of NaN-aware group statistics (each entry is its sample's group value)."""

    mean: Tensor  # [N] mean of the valid rewards of the sample's group (0 when none is valid)
    std: Tensor  # [N] unbiased std of those rewards (0 when fewer than two are valid)
    count: Tensor  # [N] number of valid rewards in the group
    inverse: Tensor  # [N] long, dense group index in [0, G)
    num_groups: int


def group_moments(rewards: Tensor, group_ids: Tensor) -> GroupMoments:
    """NaN-aware per-group mean and unbiased std, broadcast back to samples."""
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must be 1-D of equal length, got {tuple(rewards.shape)} "
            f"and {tuple(group_ids.shape)}"
        )
    r = rewards.to(torch.float64)  # [N] float64 for the moments, cast back at the end
    valid = ~torch.isnan(r)  # [N]
    r0 = torch.where(valid, r, torch.zeros_like(r))  # [N]
    _, inverse = torch.unique(group_ids, return_inverse=True)  # [N]
    num_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    count = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add_(
        0, inverse, valid.to(r.dtype)
    )  # [G]
    total = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add_(
        0, inverse, r0
    )  # [G]
    mean = total / count.clamp(min=1)  # [G]
    dev2 = torch.where(valid, (r0 - mean[inverse]) ** 2, torch.zeros_like(r))  # [N]
    ss = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add_(0, inverse, dev2)  # [G]
    std = torch.where(
        count > 1, (ss / (count - 1).clamp(min=1)).sqrt(), torch.zeros_like(ss)
    )  # [G]
    dt = rewards.dtype if rewards.is_floating_point() else torch.float32
    return GroupMoments(
        mean=mean[inverse].to(dt),
        std=std[inverse].to(dt),
        count=count[inverse].to(dt),
        inverse=inverse,
        num_groups=num_groups,
    )


def zero_std(std: Tensor) -> Tensor:
    """Bool, same shape: the std is zero up to float residue (TRL's ``isclose(std, 0)``)."""
    return torch.isclose(std, torch.zeros_like(std))


def nanstd(x: Tensor) -> Tensor:
    """Unbiased std of the non-NaN entries (0 when fewer than two)."""
    x = x[~torch.isnan(x)]  # [M]
    if x.numel() < 2:
        return torch.zeros((), dtype=x.dtype, device=x.device)
    return x.std(unbiased=True)


def _check_scale(scale_rewards: str) -> None:
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")


def _finish(adv: Tensor, rewards: Tensor, informative: Tensor | None = None) -> Tensor:
    """NaN rewards (and any 0/0) give advantage 0, so do rows of groups that are not
    ``informative`` (``[N]`` bool); float dtype of the rewards."""
    dt = rewards.dtype if rewards.is_floating_point() else torch.float32
    adv = torch.nan_to_num(adv, nan=0.0)
    if informative is not None:
        adv = torch.where(informative, adv, torch.zeros_like(adv))
    return adv.to(dt)


def grpo_advantages(
    rewards: Tensor, group_ids: Tensor, *, scale_rewards: str = "group", eps: float = 1e-4
) -> Tensor:
    """GRPO outcome advantage (DeepSeekMath eq. 3 section 4.1.2), TRL's ``scale_rewards``."""
    _check_scale(scale_rewards)
    m = group_moments(rewards, group_ids)
    adv = rewards - m.mean  # [N]
    if scale_rewards == "group":
        adv = adv / (m.std + eps)  # [N]
    elif scale_rewards == "batch":
        adv = adv / (nanstd(rewards.to(m.std.dtype)) + eps)  # [N]
    return _finish(adv, rewards, ~zero_std(m.std))


def dr_grpo_advantages(
    rewards: Tensor, group_ids: Tensor, *, scale_rewards: str = "none", eps: float = 1e-4
) -> Tensor:
    """Dr. GRPO (Liu et al., 2025): centre by the group mean, no std scaling."""
    if scale_rewards != "none":
        raise ValueError(f"dr_grpo never scales rewards; got scale_rewards={scale_rewards!r}")
    return grpo_advantages(rewards, group_ids, scale_rewards="none", eps=eps)


def rloo_advantages(rewards: Tensor, group_ids: Tensor, *, scale_rewards: str = "none") -> Tensor:
    """RLOO (Ahmadian et al., 2024): baseline = mean of the *other* valid rewards of the group."""
    if scale_rewards != "none":
        raise ValueError(f"rloo never scales rewards; got scale_rewards={scale_rewards!r}")
    m = group_moments(rewards, group_ids)
    n = m.count  # [N]
    scale = torch.where(n > 1, n / (n - 1).clamp(min=1), torch.zeros_like(n))  # [N]
    return _finish((rewards - m.mean) * scale, rewards, ~zero_std(m.std))


def estimator(name: str) -> AdvantageFn:
    """A registered estimator, or a user's ``"module:function"`` imported as reward
    functions are (``grpo_core.rewards.base.load_user_function``)."""
    if name in ADVANTAGE_ESTIMATORS or ":" not in name:
        return ADVANTAGE_ESTIMATORS.get(name)
    from grpo_core.rewards.base import load_user_function

    return load_user_function(name)


def compute(name: str, rewards: Tensor, group_ids: Tensor, **opts) -> Tensor:
    """Advantages of ``rewards[N]`` grouped by ``group_ids[N]`` with estimator ``name``.

    ``name``: a registered estimator or ``"module:function"``; unknown names raise
    ``ValueError`` listing the registered ones.
    """
    return estimator(name)(rewards, group_ids, **opts)


def compute_multi(
    rewards_per_func: Tensor,
    group_ids: Tensor,
    *,
    weights: Tensor | None = None,
    aggregation: str = "sum_then_normalize",
    name: str = "grpo",
    eps: float = 1e-4,
    **opts,
) -> Tensor:
    """Advantages from ``rewards_per_func[N, K]`` (one column per reward function).

    ``"sum_then_normalize"``: weighted sum, then estimator ``name`` with ``opts``.
    ``"normalize_then_sum"`` (GDPO): each column normalised within its group by its mean and
    unbiased std (+ eps), weighted sum, then normalised over the batch (as TRL; ``name`` unused).
    """
    if aggregation == "sum_then_normalize":
        rewards = weighted_reward_sum(rewards_per_func, weights)  # [N]
        return compute(name, rewards, group_ids, **opts)
    if aggregation != "normalize_then_sum":
        raise ValueError(f"aggregation must be one of {MULTI_AGGREGATIONS}, got {aggregation!r}")
    cols = []
    for k in range(rewards_per_func.shape[1]):
        col = rewards_per_func[:, k]  # [N]
        m = group_moments(col, group_ids)
        cols.append((col - m.mean) / (m.std + eps))  # [N], NaN stays NaN
    normalised = torch.stack(cols, dim=1)  # [N, K]
    rewards = weighted_reward_sum(normalised, weights)  # [N]
    valid = rewards[~torch.isnan(rewards)]  # [M]
    mean = valid.mean() if valid.numel() else torch.zeros_like(rewards[:0].sum())
    adv = (rewards - mean) / (nanstd(rewards) + eps)  # [N]
    informative = informative_groups(rewards_per_func, group_ids, weights, aggregation)  # [N]
    return _finish(adv, rewards, informative)


def informative_groups(
    rewards_per_func: Tensor,
    group_ids: Tensor,
    weights: Tensor | None = None,
    aggregation: str = "sum_then_normalize",
) -> Tensor:
    """Bool ``[N]``: the row's group has what its advantages are computed from varying.

    ``"sum_then_normalize"``: the weighted sum varies within the group. ``"normalize_then_sum"``
    (GDPO): some reward function with a non-zero weight varies within the group, even when the
    weighted sums tie. Unscorable (all-NaN) rows are left out, as in the estimators.
    """
    if aggregation == "sum_then_normalize":
        total = weighted_reward_sum(rewards_per_func, weights)  # [N]
        return ~zero_std(group_moments(total, group_ids).std)
    if aggregation != "normalize_then_sum":
        raise ValueError(f"aggregation must be one of {MULTI_AGGREGATIONS}, got {aggregation!r}")
    k = rewards_per_func.shape[1]
    w = [1.0] * k if weights is None else weights.tolist()  # [K]
    varies = torch.zeros(
        rewards_per_func.shape[0], dtype=torch.bool, device=rewards_per_func.device
    )  # [N]
    for j in range(k):
        if float(w[j]) != 0.0:
            varies |= ~zero_std(group_moments(rewards_per_func[:, j], group_ids).std)
    return varies


def group_stats(
    rewards: Tensor, group_ids: Tensor, informative: Tensor | None = None
) -> dict[str, float]:
    """Reward metrics with TRL's names, from the (weighted-sum) rewards of one batch.

    ``reward``: mean of valid (scorable) rewards; NaN rows are left out, as TRL. ``reward_std``: unbiased std of all valid rewards of the
    batch (TRL >= 0.20 logs ``nanstd(rewards)``). ``reward_std/group_mean``: mean over groups of
    the per-group std (TRL <= 0.19's ``reward_std``). ``frac_reward_zero_std``: fraction of
    completions whose group std is zero (TRL's per-completion definition; with equal group sizes
    it is the fraction of groups), or, given ``informative`` (:func:`informative_groups`), the
    fraction of completions whose group is not informative: the groups dynamic sampling drops.
    """
    m = group_moments(rewards, group_ids)
    valid = ~torch.isnan(rewards)  # [N]
    per_group_std = torch.zeros(m.num_groups, dtype=m.std.dtype, device=m.std.device).index_copy_(
        0, m.inverse, m.std
    )
    zero = zero_std(m.std) if informative is None else ~informative  # [N]
    mean = rewards[valid].double().mean().item() if valid.any() else float("nan")
    return {
        "reward": mean,
        "reward_std": nanstd(rewards.double()).item(),
        "reward_std/group_mean": per_group_std.double().mean().item() if m.num_groups else 0.0,
        "frac_reward_zero_std": zero.double().mean().item() if zero.numel() else 0.0,
    }

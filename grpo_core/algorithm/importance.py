"""Off-policy bookkeeping: when old log-probs are needed, and the rollout-engine correction.

``num_iterations`` (mu in DeepSeekMath, Algorithm 1): each generation batch is reused for mu
policy updates. The ratio's denominator ``old_logp`` must then be the log-probs of the policy
that *sampled* the batch, computed once per generation batch (one no-grad forward) and reused
across the mu iterations. With mu = 1 and one optimizer step per generation batch the sampling
policy *is* the current one, so ``old_logp = logp.detach()`` (pass ``old_logp=None`` to
``grpo_core.algorithm.losses.policy_loss``) and no extra forward is spent.

Rollout-engine mismatch (Yao et al., "Your efficient RL framework secretly brings you off-policy
RL training", 2025; TRL's ``vllm_importance_sampling_*``): the engine's log-probs
``sampling_logp`` differ from the trainer's ``old_logp`` even for the same weights. The
correction weight ``exp(old_logp - sampling_logp)``, per token or per sequence (sum over tokens),
is truncated (``*_truncate``: clamp to [clip_min, clip_max], TIS) or masked (``*_mask``: weights
outside [clip_min, clip_max] set to 0, MIS), detached, and multiplies the per-token policy loss.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def needs_old_logprobs(
    num_iterations: int = 1,
    optimizer_steps_per_generation: int = 1,
    importance_sampling_correction: bool = False,
) -> bool:
    """Whether the update must compute ``old_logp`` with a separate forward (TRL's rule).

    False only when every sample is used once, by the policy that generated it (mu = 1, one
    optimizer step per generation batch) and no engine correction is asked for.
    """
    if num_iterations < 1 or optimizer_steps_per_generation < 1:
        raise ValueError("num_iterations and optimizer_steps_per_generation must be >= 1")
    return (
        num_iterations > 1 or optimizer_steps_per_generation > 1 or importance_sampling_correction
    )


def resolve_old_logprobs(logp: Tensor, old_logp: Tensor | None) -> Tensor:
    """``old_logp`` if given, else the detached current log-probs (mu = 1)."""
    return logp.detach() if old_logp is None else old_logp  # [B, T]


def engine_importance_weights(
    old_logp: Tensor,
    sampling_logp: Tensor,
    mask: Tensor,
    *,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> tuple[Tensor, dict[str, float]]:
    """Rollout-engine importance weights and TRL's ``sampling/*`` metrics.

    Args:
        old_logp: ``[B, T]`` trainer log-probs of the sampled tokens (no grad).
        sampling_logp: ``[B, T]`` the engine's log-probs of the same tokens.
        mask: ``[B, T]`` completion mask.
        mode: ``token_truncate`` | ``token_mask`` | ``sequence_truncate`` | ``sequence_mask``
            (TRL's default).
        clip_min, clip_max: bounds (``None`` = unbounded on that side; TRL defaults None, 3.0).

    Returns:
        ``(weights, metrics)``: weights ``[B, T]`` (token modes) or ``[B, 1]`` (sequence modes),
        detached; metrics ``sampling/sampling_logp_difference/{mean,max}`` and
        ``sampling/importance_sampling_ratio/{min,mean,max,clipped_share}`` (the share of
        tokens, or sequences, whose weight was truncated or masked).
    """
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"mode must be one of {IMPORTANCE_SAMPLING_MODES}, got {mode!r}")
    old_logp, sampling_logp = old_logp.detach(), sampling_logp.detach()
    m = mask.to(old_logp.dtype)  # [B, T]
    diff = (old_logp - sampling_logp) * m  # [B, T]
    sequence_level = mode.startswith("sequence")
    log_w = diff.sum(-1, keepdim=True) if sequence_level else diff  # [B, 1] or [B, T]
    w = torch.exp(log_w)  # [B, 1] or [B, T]
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    out = (w < lo) | (w > hi)  # [B, 1] or [B, T]: truncated or masked
    if mode.endswith("truncate"):
        w = torch.clamp(w, min=clip_min, max=clip_max)
    else:
        w = w.masked_fill(out, 0.0)

    on = mask.bool()  # [B, T]
    gap = (old_logp - sampling_logp).abs()[on]  # [M]
    rows_on = on.any(-1)  # [B] a row without a counted token has no weight to report
    flat_w = w[rows_on].flatten() if sequence_level else w[on]  # [B'] or [M]
    flat_out = out[rows_on].flatten() if sequence_level else out[on]  # [B'] or [M]
    metrics = {
        **_spread("sampling/importance_sampling_ratio", flat_w),
        "sampling/sampling_logp_difference/mean": gap.mean().item() if gap.numel() else 0.0,
        "sampling/sampling_logp_difference/max": gap.max().item() if gap.numel() else 0.0,
        "sampling/importance_sampling_ratio/min": flat_w.min().item() if flat_w.numel() else 0.0,
        "sampling/importance_sampling_ratio/mean": flat_w.mean().item() if flat_w.numel() else 0.0,
        "sampling/importance_sampling_ratio/max": flat_w.max().item() if flat_w.numel() else 0.0,
        "sampling/importance_sampling_ratio/clipped_share": (
            flat_out.float().mean().item() if flat_out.numel() else 0.0
        ),
    }
    return w, metrics


BEHAVIOUR_WEIGHT_MODES = ("token_mask", "token_truncate")
NEAR_ZERO = 0.01  # a weight under this: the token barely trains (metric near_zero_share)


def behaviour_weights(
    prox_logp: Tensor,
    sampling_logp: Tensor,
    mask: Tensor,
    *,
    mode: str = "token_mask",
    cap: float = 5.0,
) -> tuple[Tensor, dict[str, float]]:
    """Per-token behaviour weights of rows sampled by an older policy, and their metrics.

    AReaL's decoupled PPO objective (Fu et al. 2025, arXiv:2505.24298, eq. 5; its
    ``behav_imp_weight``): the clip is around the proximal policy ``pi_prox`` (the policy
    being updated, whose no-grad log-probs are ``prox_logp``), and each token's loss is
    multiplied by ``w_t = pi_prox(o_t) / mu(o_t)``, ``mu`` the sampler (``sampling_logp``).
    ``token_mask`` (AReaL's ``behav_imp_weight_cap``): tokens with ``w_t > cap`` get weight 0;
    ``token_truncate`` (truncated IS): ``min(w_t, cap)``. Token level, unlike a sequence
    product: a long completion's weight does not decay with its length.

    Returns weights ``[B, T]`` (detached, 0 on padding) and ``sampling/behaviour_weight/*``:
    ``min``, ``mean``, ``max``, ``capped_share`` (tokens above the cap), ``ess`` (the effective
    sample size over counted tokens divided by their number, ``(sum w)^2 / (n sum w^2)``: 1 when
    every weight is equal, near 0 when a few tokens carry the batch), ``near_zero_share``
    (tokens with a weight under ``NEAR_ZERO``).
    """
    if mode not in BEHAVIOUR_WEIGHT_MODES:
        raise ValueError(f"mode must be one of {BEHAVIOUR_WEIGHT_MODES}, got {mode!r}")
    if not cap > 0:
        raise ValueError(f"the behaviour weight cap must be > 0, got {cap}")
    on = mask.bool()  # [B, T]
    log_w = (prox_logp.detach().float() - sampling_logp.detach().float()).masked_fill(~on, 0.0)
    w = torch.exp(log_w)  # [B, T]
    over = (w > cap) & on  # [B, T]
    w = w.masked_fill(over, 0.0) if mode == "token_mask" else w.clamp(max=cap)
    w = w.masked_fill(~on, 0.0)  # [B, T]
    counted = w[on]  # [M]
    metrics = {
        "sampling/behaviour_weight/min": counted.min().item() if counted.numel() else 0.0,
        "sampling/behaviour_weight/mean": counted.mean().item() if counted.numel() else 0.0,
        "sampling/behaviour_weight/max": counted.max().item() if counted.numel() else 0.0,
        "sampling/behaviour_weight/capped_share": (
            over[on].float().mean().item() if counted.numel() else 0.0
        ),
        **_spread("sampling/behaviour_weight", counted),
    }
    return w, metrics


def effective_sample_share(w: Tensor) -> float:
    """``(sum w)^2 / (n sum w^2)`` of the weights ``w`` (any shape): the effective sample
    size as a share of ``n`` (Kish). 1.0 for no weights or all equal; 0.0 when all are 0."""
    w = w.double().flatten()
    if w.numel() == 0:
        return 1.0
    sq = float((w * w).sum())
    return float(w.sum()) ** 2 / (w.numel() * sq) if sq > 0 else 0.0


def ess_parts(w: Tensor, mask: Tensor) -> Tensor:
    """``[sum w, sum w^2, n]`` (float64) of the counted weights: the tokens of ``mask``, or
    for sequence weights (``w`` ``[B, 1]``) the rows with a counted token. Summed over
    data-parallel ranks they give the whole batch's :func:`effective_sample_share`."""
    on = mask.bool()  # [B, T]
    sequence_level = w.shape[-1] == 1 and on.shape[-1] != 1
    counted = w[on.any(-1)].flatten() if sequence_level else w[on]  # [B'] or [M]
    counted = counted.double()
    return torch.stack(
        [counted.sum(), (counted * counted).sum(), counted.new_tensor(counted.numel())]
    )


def _spread(prefix: str, w: Tensor) -> dict[str, float]:
    """How the weights spread: ESS share and the share of near-zero weights."""
    near = (w < NEAR_ZERO).float().mean().item() if w.numel() else 0.0
    return {f"{prefix}/ess": effective_sample_share(w), f"{prefix}/near_zero_share": near}

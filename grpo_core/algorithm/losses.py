"""The GRPO-family policy loss: ratio, clipping, KL penalty, loss aggregation.

Reading order follows the objective of DeepSeekMath (Shao et al., 2024, arXiv:2402.03300, eq. 3):

    J = E[ 1/G sum_i 1/|o_i| sum_t ( min(r_it A_i, clip(r_it, 1-eps_lo, 1+eps_hi) A_i)
                                     - beta * KL_t ) ]

1. importance ratio ``r = exp(logp - old_logp)``, per token, or per sequence as GSPO
   (Zheng et al., 2025, arXiv:2507.18071: ``exp(mean_t(logp - old_logp))`` broadcast to tokens);
2. the per-token objective, from ``POLICY_OBJECTIVES``: ``"clip"`` (PPO clip with DAPO's
   clip-higher ``epsilon_high``, Yu et al., 2025, arXiv:2503.14476; verl's dual-clip bound
   ``clip_ratio_c`` for negative advantages, Ye et al., 2020, arXiv:1912.09729; TRL's two-sided
   ``delta``, INTELLECT-2) or ``"cispo"`` (MiniMax-M1, arXiv:2506.13585);
3. optional per-token weights (top-entropy mask, vLLM importance-sampling correction);
4. ``+ beta * KL`` with an estimator from ``grpo_core.algorithm.kl`` (k3 by default);
5. aggregation over tokens by ``loss_type`` from ``LOSS_AGGREGATIONS``, as TRL defines it.

Normalisers: ``num_items_in_batch`` overrides what an aggregation divides by (tokens for
``dapo``/``bnpo``, sequences for ``grpo``/``dr_grpo``); without it, the micro-batch is the
whole batch. :func:`step_normalisers` gives TRL's choice for each ``loss_type`` under
gradient accumulation, which ``grpo_core.algorithm.update`` uses: ``dapo`` divides every micro-batch by
the completion tokens of the *whole generation batch*; ``bnpo``, ``grpo`` and ``dr_grpo``
divide the micro-batch's own mean by the number of accumulated micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import NamedTuple

import torch
from torch import Tensor

from grpo_core.algorithm.kl import kl_divergence
from grpo_core.config.loss import LOSS_AGGREGATIONS, POLICY_OBJECTIVES, LossConfig
from grpo_core.registry import Registry


class ObjectiveOut(NamedTuple):
    """A per-token policy objective and where it clipped."""

    loss: Tensor  # [B, T] or [B, 1] per-token (per-sequence for GSPO) loss, before masking
    low_clipped: Tensor  # same shape, bool: ratio < 1 - eps_lo with A < 0
    high_clipped: Tensor  # same shape, bool: ratio > 1 + eps_hi with A > 0


class ClipBounds(NamedTuple):
    """The ratio bounds an objective reads (each objective says which; ``LossConfig``'s)."""

    epsilon_low: float
    epsilon_high: float
    clip_ratio_c: float | None = None  # dual-clip cap for A < 0, > 1
    delta: float | None = None  # TRL's two-sided clip: the unclipped ratio's cap


# An objective: (log_ratio, advantages, logp, bounds) -> ObjectiveOut; an aggregation:
# (per_token, mask, *, num_items_in_batch, max_completion_length) -> scalar. Both are
# registered by name in grpo_core/config/loss.py (POLICY_OBJECTIVES, LOSS_AGGREGATIONS,
# re-exported here), with what the update needs to know of them (LossSpec).
ObjectiveFn = Callable[[Tensor, Tensor, Tensor, ClipBounds], ObjectiveOut]
AggregationFn = Callable[..., Tensor]
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def clipped_objective(
    log_ratio: Tensor, advantages: Tensor, logp: Tensor, bounds: ClipBounds
) -> ObjectiveOut:
    """PPO clipped surrogate ``-min(r A, clip(r, 1-eps_lo, 1+eps_hi) A)``.

    ``clip_ratio_c`` (dual-clip, must be > 1): for ``A < 0`` the loss is capped at ``-c A``.
    ``delta`` (TRL's two-sided clip): the unclipped ratio is capped at ``delta``.
    """
    del logp  # the ratio carries the gradient
    epsilon_low, epsilon_high, clip_ratio_c, delta = bounds
    ratio = torch.exp(log_ratio)  # [B, T] or [B, 1]
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)  # same shape
    unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
    loss = -torch.min(unclipped * advantages, clipped * advantages)  # [B, T]
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
        capped = torch.min(loss, -advantages * clip_ratio_c)  # [B, T]
        loss = torch.where(advantages < 0, capped, loss)
    low = (ratio < 1 - epsilon_low) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    return ObjectiveOut(loss, low, high)


def cispo_objective(
    log_ratio: Tensor, advantages: Tensor, logp: Tensor, bounds: ClipBounds
) -> ObjectiveOut:
    """CISPO (MiniMax-M1): ``-sg(min(r, epsilon_high)) * A * logp``; as TRL, ``epsilon_high``
    is the ratio cap itself (e.g. 5.0), not an offset from 1."""
    epsilon_high = bounds.epsilon_high
    ratio = torch.exp(log_ratio)  # [B, T]
    weight = torch.clamp(ratio, max=epsilon_high).detach()  # [B, T]
    high = (ratio > epsilon_high) & (advantages > 0)
    return ObjectiveOut(-weight * advantages * logp, torch.zeros_like(high), high)


def agg_grpo(per_token: Tensor, mask: Tensor, *, num_items_in_batch=None, **_) -> Tensor:
    """GRPO paper: token mean per sequence, then mean over sequences (``num_items`` = sequences)."""
    seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # [B]
    n = per_token.shape[0] if num_items_in_batch is None else num_items_in_batch
    return seq.sum() / n


def agg_bnpo(per_token: Tensor, mask: Tensor, *, num_items_in_batch=None, **_) -> Tensor:
    """BNPO / TRL ``bnpo``: sum over the batch's tokens / number of tokens of the batch."""
    n = mask.sum().clamp(min=1.0) if num_items_in_batch is None else num_items_in_batch
    return (per_token * mask).sum() / n


def agg_dapo(per_token: Tensor, mask: Tensor, *, num_items_in_batch=None, **_) -> Tensor:
    """DAPO token-level loss: sum over all tokens / tokens of the whole (accumulated) batch."""
    return agg_bnpo(per_token, mask, num_items_in_batch=num_items_in_batch)


def agg_dr_grpo(
    per_token: Tensor, mask: Tensor, *, num_items_in_batch=None, max_completion_length=None, **_
) -> Tensor:
    """Dr. GRPO (Liu et al., 2025): sum over tokens / (sequences x max_completion_length)."""
    if max_completion_length is None:
        raise ValueError("loss_type='dr_grpo' needs max_completion_length")
    n = per_token.shape[0] if num_items_in_batch is None else num_items_in_batch
    return (per_token * mask).sum() / (n * max_completion_length)


NormaliserFn = Callable[[Tensor, list[int], int], list]
# loss_type -> what one optimizer step's micro-batches are divided by, from their counts
LOSS_NORMALISERS: Registry[NormaliserFn] = Registry("loss_type normaliser")


@LOSS_NORMALISERS.register("dapo")
def _norm_dapo(tokens: Tensor, rows: list[int], accumulation: int) -> list:
    # the generation batch's tokens x accumulation / micro-batches: one optimizer step's
    # share of the batch, so each step is a token mean over its accumulation window
    total = (tokens.sum() * accumulation / len(rows)).clamp(min=1.0)
    return [total for _ in rows]


@LOSS_NORMALISERS.register("bnpo")
def _norm_bnpo(tokens: Tensor, rows: list[int], accumulation: int) -> list:
    return [t.clamp(min=1.0) * accumulation for t in tokens]  # the micro-batch's tokens


@LOSS_NORMALISERS.register("grpo")
@LOSS_NORMALISERS.register("dr_grpo")
def _norm_sequences(tokens: Tensor, rows: list[int], accumulation: int) -> list:
    return [r * accumulation for r in rows]  # the micro-batch's sequences


def step_normalisers(
    loss_type: str, tokens: Tensor, rows: list[int], accumulation: int
) -> list[Tensor | int]:
    """What TRL's ``GRPOTrainer._compute_loss`` (TRL 1.16) divides each micro-batch's loss by,
    for a generation batch split into micro-batches of ``tokens[j]`` completion tokens and
    ``rows[j]`` sequences, ``accumulation`` of them per optimizer step (the registered
    normaliser of ``loss_type``, beside its aggregation):

    - ``dapo``: the generation batch's tokens x ``accumulation / micro_batches`` (TRL rescales
      ``num_items_in_batch`` the same way);
    - ``bnpo``: the micro-batch's tokens x ``accumulation``;
    - ``grpo``, ``dr_grpo``: the micro-batch's sequences x ``accumulation``.

    One process counts its micro-batches; data-parallel ranks all-reduce their counts first
    (grpo_core/training/distributed.py), so both get the same values."""
    LOSS_AGGREGATIONS.get(loss_type)  # raises, listing the valid names
    return LOSS_NORMALISERS.get(loss_type)(tokens, rows, accumulation)


def micro_batch_counts(masks: list[Tensor]) -> tuple[Tensor, list[int]]:
    """Completion tokens ``[J]`` (the masks' dtype) and sequences of micro-batches ``masks``."""
    tokens = torch.stack([m.sum() for m in masks]) if masks else torch.zeros(0)
    return tokens, [int(m.shape[0]) for m in masks]


def sequence_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """GSPO's length-normalised sequence log-ratio ``mean_t(logp - old_logp)``, shape [B, 1]."""
    return ((logp - old_logp) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(
        min=1.0
    )


def masked_mean(x: Tensor, mask: Tensor) -> float:
    """Mean of ``x`` over mask tokens; a [B, 1] ``x`` (sequence level) is averaged over rows."""
    if x.shape[-1] == 1 and mask.shape[-1] != 1:
        return x.float().mean().item() if x.numel() else 0.0
    x = x.float() * mask  # [B, T]
    return (x.sum() / mask.sum().clamp(min=1.0)).item()


def policy_loss(
    logp: Tensor,
    old_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    config: LossConfig | None = None,
    *,
    ref_logp: Tensor | None = None,
    num_items_in_batch: float | Tensor | None = None,
    token_weights: Tensor | None = None,
    importance_sampling_ratio: Tensor | None = None,
    **knobs,
) -> tuple[Tensor, dict[str, float]]:
    """GRPO-family loss of one (micro-)batch and its metrics (TRL's names).

    Args:
        logp: ``[B, T]`` log-probs of the completion tokens under the policy (with grad).
        old_logp: ``[B, T]`` log-probs under the sampling policy; ``None`` means
            ``logp.detach()`` (num_iterations = 1: ratio 1, no extra forward).
        advantages: ``[B]`` (or ``[B, T]``) advantages.
        mask: ``[B, T]`` float/bool, 1 on completion tokens that count.
        config: a :class:`~grpo_core.config.loss.LossConfig`; or give its fields as keywords
            (``beta=0.04, loss_type="grpo"``), not both. Its fields:
        ref_logp: ``[B, T]`` reference log-probs, needed when ``beta != 0``.
        epsilon / epsilon_high: clip range ``[1 - epsilon, 1 + epsilon_high]``
            (``epsilon_high=None`` means ``epsilon``).
        loss_type: ``grpo`` | ``bnpo`` | ``dapo`` | ``dr_grpo`` (see module docstring).
        importance_sampling_level: ``token`` or ``sequence`` (GSPO).
        num_items_in_batch: whole-batch normaliser for gradient accumulation (module docstring).
        kl_estimator: ``k1`` | ``k2`` | ``k3``.
        objective: ``clip`` | ``cispo``.
        clip_ratio_c: dual-clip bound for negative advantages (verl, e.g. 3.0).
        delta: TRL's two-sided clip: cap of the unclipped ratio.
        token_weights: ``[B, T]`` multiplies the policy term (e.g. the top-entropy mask).
        importance_sampling_ratio: ``[B, T]`` or ``[B, 1]`` detached vLLM correction weights
            (``grpo_core.algorithm.importance``), multiplies the policy term as TRL.
        use_bias_correction_kl: multiply the KL by the (sequence or token) ratio, as TRL.

    Returns:
        ``(loss, metrics)``: scalar loss to ``backward()``; metrics ``policy_loss``,
        ``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean`` and
        ``kl`` when ``beta != 0``.
    """
    c = _loss_config(config, knobs)
    aggregate = LOSS_AGGREGATIONS.get(c.loss_type)
    mask = mask.to(logp.dtype)  # [B, T]
    old_logp = logp.detach() if old_logp is None else old_logp  # [B, T]
    if c.importance_sampling_level == "token":
        log_ratio = logp - old_logp  # [B, T]
    else:
        log_ratio = sequence_log_ratio(logp, old_logp, mask)  # [B, 1]

    out = _objective(c, log_ratio, advantages, logp)
    per_token = out.loss  # [B, T] or [B, 1]
    if token_weights is not None:
        per_token = per_token * token_weights  # [B, T]
    if importance_sampling_ratio is not None:
        per_token = per_token * importance_sampling_ratio.detach()  # [B, T]

    metrics: dict[str, float] = {}
    if c.beta != 0.0:
        per_token_kl = _kl_term(c, logp, ref_logp, log_ratio)  # [B, T]
        per_token = per_token + c.beta * per_token_kl  # [B, T]
        metrics["kl"] = masked_mean(per_token_kl.detach(), mask)

    per_token = per_token.expand_as(mask)  # [B, T] (GSPO's [B, 1] broadcast over tokens)
    loss = aggregate(
        per_token,
        mask,
        num_items_in_batch=num_items_in_batch,
        max_completion_length=c.max_completion_length,
    )
    region = out.low_clipped | out.high_clipped
    metrics["policy_loss"] = loss.detach().item()
    metrics["clip_ratio/low_mean"] = masked_mean(out.low_clipped, mask)
    metrics["clip_ratio/high_mean"] = masked_mean(out.high_clipped, mask)
    metrics["clip_ratio/region_mean"] = masked_mean(region, mask)
    return loss, metrics


def _loss_config(config: LossConfig | None, knobs: dict) -> LossConfig:
    """``policy_loss``'s config: the one given, or one built from its keywords; checked."""
    if config is not None and knobs:
        raise ValueError(f"give a LossConfig or keywords, not both (got {sorted(knobs)})")
    if config is None:
        unknown = set(knobs) - {f.name for f in fields(LossConfig)}
        if unknown:
            raise TypeError(f"policy_loss: unknown keyword(s) {sorted(unknown)}")
        config = LossConfig(**knobs)
    if config.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, "
            f"got {config.importance_sampling_level!r}"
        )
    return config


def _objective(c: LossConfig, log_ratio: Tensor, advantages: Tensor, logp: Tensor) -> ObjectiveOut:
    """The configured per-token objective, advantages broadcast to ``[B, 1]`` (or ``[B, T]``)."""
    objective_fn = POLICY_OBJECTIVES.get(c.objective)
    adv = advantages.to(logp.dtype)
    adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv  # [B, 1] or [B, T]
    eps_high = c.epsilon if c.epsilon_high is None else c.epsilon_high
    bounds = ClipBounds(c.epsilon, eps_high, c.clip_ratio_c, c.delta)
    return objective_fn(log_ratio, adv, logp, bounds)


def _kl_term(c: LossConfig, logp: Tensor, ref_logp: Tensor | None, log_ratio: Tensor) -> Tensor:
    """Per-token KL to the reference ``[B, T]``, times the ratio under bias correction."""
    if ref_logp is None:
        raise ValueError("beta != 0 needs ref_logp")
    per_token_kl = kl_divergence(logp, ref_logp, c.kl_estimator)  # [B, T]
    if c.use_bias_correction_kl:
        per_token_kl = per_token_kl * torch.exp(log_ratio)  # [B, T]
    return per_token_kl

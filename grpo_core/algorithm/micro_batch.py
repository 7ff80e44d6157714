"""One micro-batch of the GRPO update (``grpo_core.algorithm.update``): its forward and backward in
physical chunks of at most ``max_tokens_per_microbatch`` padded tokens, each divided by the
micro-batch's normaliser, and its metrics. With ``skip_zero_advantage``, the rows whose loss is
exactly 0 (:func:`live_rows`) are left out of the forward and backward passes; their entropy is
still measured, without grad, for the ``entropy`` metric.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_core.algorithm.losses import policy_loss
from grpo_core.algorithm.sampling_filters import top_entropy_mask
from grpo_core.config.loss import UpdateConfig, zero_advantage_is_zero_loss
from grpo_core.contracts.batch import UpdateBatch
from grpo_core.logprobs.batch import completion_logprobs
from grpo_core.logprobs.precision import Precision


@dataclass
class RowTensors:
    """The per-row tensors that the update computes once per generation batch and every
    micro-batch reads: old and reference log-probs ``[N, T]``, the engine's importance
    weights ``[N, T]`` or ``[N, 1]``; ``None`` when not needed."""

    old_logp: Tensor | None = None
    ref_logp: Tensor | None = None
    is_weights: Tensor | None = None

    def rows(self, idx: Tensor) -> RowTensors:
        """Rows ``idx`` of each (all on the batch's device: ``grpo_core.algorithm.update`` made them
        there)."""

        def pick(x: Tensor | None) -> Tensor | None:
            return None if x is None else x[idx]

        return RowTensors(pick(self.old_logp), pick(self.ref_logp), pick(self.is_weights))


def skips_zero_loss_rows(cfg: UpdateConfig) -> bool:
    """Whether rows with a zero advantage (or no token that counts) have a zero loss under
    ``cfg`` and ``skip_zero_advantage`` leaves them out (``grpo_core.algorithm.update``'s docstring):
    no KL term, no entropy quantile, and an objective and aggregation registered as zero at
    a zero advantage (``LossSpec.zero_advantage_is_zero_loss``; an entropy bonus is not)."""
    return (
        cfg.skip_zero_advantage
        and cfg.loss.beta == 0
        and cfg.top_entropy_quantile == 1.0
        and zero_advantage_is_zero_loss(cfg.loss)
    )


def live_rows(batch: UpdateBatch) -> Tensor:
    """Bool ``[n]``: rows with a non-zero advantage and at least one completion token that
    counts (the others have a zero loss when :func:`skips_zero_loss_rows`)."""
    adv = batch.advantages.reshape(batch.size, -1)  # [n, 1] or [n, T]
    return adv.ne(0).any(-1) & batch.completion_mask.bool().any(-1)


def micro_batch(
    model,
    mb: UpdateBatch,
    cfg: UpdateConfig,
    precision: Precision,
    fixed: RowTensors,
    norm: Tensor | int,
    *,
    skip_rows: bool = False,
) -> dict:
    """Forward and backward of one logical micro-batch, in physical chunks of at most
    ``cfg.max_tokens_per_microbatch`` padded tokens. Every chunk's loss is divided by the
    logical micro-batch's normaliser ``norm``, so the accumulated gradient is the unsplit one; the
    metrics are those of the whole micro-batch (recomputed from the chunks' detached
    log-probs when it was split). ``skip_rows``: rows with a zero loss are left out
    (module docstring); ``{"skipped": True}`` when that is all of them. Without
    ``cfg.entropy_of_skipped_rows`` the entropy is that of the trained rows, named
    ``entropy/trained_rows`` for what it is."""
    if not skip_rows:
        return _forward_backward(model, mb, cfg, precision, fixed, norm)
    if not cfg.entropy_of_skipped_rows:
        metrics = _live_rows_only(model, mb, cfg, precision, fixed, norm, skipped_entropy=False)
        if "entropy" in metrics:
            metrics["entropy/trained_rows"] = metrics.pop("entropy")
        return metrics
    return _live_rows_only(model, mb, cfg, precision, fixed, norm, skipped_entropy=True)


def _live_rows_only(
    model, mb, cfg, precision, fixed: RowTensors, norm, *, skipped_entropy: bool
) -> dict:
    """:func:`micro_batch` of the live rows of ``mb``; the clip ratios rescaled to all its
    rows, and (``skipped_entropy``) the skipped rows' entropy measured without grad."""
    live = live_rows(mb)  # [n]
    if bool(live.all()):
        return _forward_backward(model, mb, cfg, precision, fixed, norm)
    idx = live.nonzero().squeeze(-1)  # [m]
    if len(idx) == 0:
        if not skipped_entropy:
            return {"skipped": True}
        ent_sum, ent_tokens = _entropy_sum(model, mb, cfg, precision)
        return {"skipped": True, "entropy": ent_sum / max(ent_tokens, 1)}
    live_tokens = mb.completion_mask[idx].sum()
    # a clip ratio's mean is over tokens, or over rows for GSPO's sequence ratios
    sequence = cfg.loss.importance_sampling_level == "sequence"
    share = len(idx) / len(live) if sequence else float(live_tokens / mb.completion_mask.sum())
    metrics = _forward_backward(model, mb.slice(idx), cfg, precision, fixed.rows(idx), norm)
    for key in [k for k in metrics if k.startswith("clip_ratio/")]:
        metrics[key] *= share  # skipped rows are never clipped: a mean over all rows
    if not skipped_entropy:
        return metrics
    skipped = mb.slice((~live).nonzero().squeeze(-1))
    ent_sum, ent_tokens = _entropy_sum(model, skipped, cfg, precision)
    tokens = float(live_tokens) + ent_tokens
    metrics["entropy"] = (metrics["entropy"] * float(live_tokens) + ent_sum) / max(tokens, 1)
    return metrics


def _forward_backward(
    model, mb: UpdateBatch, cfg: UpdateConfig, precision: Precision, fixed: RowTensors, norm
) -> dict:
    """Every row of ``mb`` through the loss and its backward, chunk by chunk."""
    mask = mb.completion_mask  # [n, T] (on the model's device: grpo_core.algorithm.update moved it)
    adv = mb.advantages  # [n]
    parts = mb.token_chunks(cfg.max_tokens_per_microbatch)
    token_weights = None
    if cfg.top_entropy_quantile < 1.0 and len(parts) > 1:
        # the quantile is over the whole micro-batch: its entropies first, without grad
        with torch.no_grad():
            ents = [_forward(model, mb, p, cfg, precision)[1] for p in parts]
        token_weights = top_entropy_mask(torch.cat(ents), mask, cfg.top_entropy_quantile).float()
    logps, entropies = [], []
    for p in parts:
        logp, entropy = _forward(model, mb, p, cfg, precision)  # [c, T] each
        if cfg.top_entropy_quantile < 1.0 and len(parts) == 1:
            token_weights = top_entropy_mask(entropy, mask, cfg.top_entropy_quantile).float()
        weights = None if token_weights is None else token_weights[p]
        loss, metrics = _loss(logp, fixed.rows(p), adv[p], mask[p], cfg, norm, weights)
        precision.backward(loss)
        logps.append(logp.detach())
        entropies.append(entropy.detach())
    if len(parts) > 1:
        with torch.no_grad():
            loss, metrics = _loss(torch.cat(logps), fixed, adv, mask, cfg, norm, token_weights)
    entropy = torch.cat(entropies)  # [n, T]
    metrics["loss"] = float(loss.detach())
    metrics["entropy"] = float((entropy * mask).sum() / mask.sum().clamp(min=1))
    return metrics


def _loss(logp, fixed: RowTensors, adv, mask, cfg: UpdateConfig, norm, token_weights):
    """``policy_loss`` of these rows, divided by the micro-batch's normaliser ``norm``."""
    return policy_loss(
        logp,
        fixed.old_logp,
        adv,
        mask,
        cfg.loss,
        ref_logp=fixed.ref_logp,
        num_items_in_batch=norm,
        token_weights=token_weights,
        importance_sampling_ratio=fixed.is_weights,
    )


def _entropy_sum(model, mb: UpdateBatch, cfg: UpdateConfig, precision: Precision):
    """``(sum of token entropies, tokens)`` of ``mb``'s completions, without grad: the rows a
    skip leaves out of the backward still count in the ``entropy`` metric (TRL's is over the
    whole batch, and a collapse shows first in the groups without reward variance)."""
    total, tokens = 0.0, 0.0
    mask = mb.completion_mask
    with torch.no_grad():
        for p in mb.token_chunks(cfg.max_tokens_per_microbatch):
            entropy = _forward(model, mb, p, cfg, precision)[1]  # [c, T]
            m = mask[p].to(entropy.device)
            total += float((entropy * m).sum())
            tokens += float(m.sum())
    return total, tokens


def _forward(model, mb: UpdateBatch, rows: Tensor, cfg: UpdateConfig, precision: Precision):
    with precision.autocast():
        return completion_logprobs(
            model,
            mb.slice(rows),
            temperature=cfg.temperature,
            with_entropy=True,
            lm_head=cfg.lm_head,
        )

"""The GRPO update: one generation batch of scored completions -> optimizer steps.

Order of the GRPO paper (DeepSeekMath, Alg. 1), for one generation batch:
  1. old log-probs pi_old(o_t) once, without grad, in train mode like the loss's forward
     (skipped when the batch makes a single on-policy optimizer step: then
     old = current.detach(), no extra forward, as TRL; or taken from the sampler's stored
     log-probs with ``old_logprobs="sampler"``, see ``grpo_core.old_logprobs``);
  2. reference log-probs when beta > 0 (no reference model exists otherwise);
  3. ``steps_per_generation`` micro-batches of whole groups, repeated ``num_iterations`` (mu)
     times, each minimising ``grpo_core.losses.policy_loss``, with an optimizer step every
     ``gradient_accumulation_steps`` micro-batches (TRL's meaning of these names).
Memory: each micro-batch may run in physical chunks of at most ``max_tokens_per_microbatch``
padded tokens, each divided by the micro-batch's normaliser (the gradient is the unsplit one);
log-probs come from the hidden states through the LM head in chunks (``grpo_core.lm_head``);
``bf16``/``fp16`` autocast the forward (``grpo_core.precision``).
Zero-gradient rows: with ``beta = 0`` and no top-entropy mask, a completion whose advantage is
0 (every completion of a group without reward variance) or that has no token that counts has a
per-token loss of exactly 0 whatever the weights, so ``skip_zero_advantage`` (default on) leaves
it out of the forward and backward passes (and of the old log-prob pass) while the normaliser
still counts it: the gradient is the one of the full batch. An optimizer step whose rows were
all skipped still steps, on zero gradients, as the full batch would. Metrics: the clip ratios
are rescaled to the whole micro-batch's tokens (rows, for GSPO's sequence ratios); ``entropy``
covers every row, the skipped ones through a no-grad forward (a third of a training pass).
Departures from the paper: advantages come precomputed from the scored Parquet (so an
offline update can use any scored file); dropout is off by default (``disable_dropout``, TRL's
option, off by default there), so that pi_old and pi_theta are the same function at step 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

from grpo_core.batch import UpdateBatch, build_batch
from grpo_core.batch_logprobs import (
    LOGPROB_CHUNK,
    batched_logprobs,
    completion_logprobs,
    logprob_chunks,
)
from grpo_core.distributed import DataParallel
from grpo_core.importance import engine_importance_weights, needs_old_logprobs
from grpo_core.loss_config import UpdateConfig
from grpo_core.losses import micro_batch_counts, policy_loss, step_normalisers
from grpo_core.parallel import LOCAL
from grpo_core.precision import Precision
from grpo_core.sampling_filters import top_entropy_mask

__all__ = ["UpdateBatch", "batched_logprobs", "build_batch", "completion_logprobs", "grpo_update"]


def _old_logprob_forwards(batch: UpdateBatch, cfg: UpdateConfig, needed: bool) -> int:
    """How many forwards the old log-probs of ``batch`` take (as :func:`grpo_update`
    computes them)."""
    if not needed or cfg.old_logprobs == "sampler":
        return 0
    if skips_zero_loss_rows(cfg) and cfg.engine_correction is None:
        batch = batch.slice(live_rows(batch).nonzero().squeeze(-1))
        if batch.size == 0:
            return 0
    return len(logprob_chunks(batch, LOGPROB_CHUNK, cfg.max_tokens_per_microbatch))


def _loss_forwards(mb: UpdateBatch, cfg: UpdateConfig, skip_rows: bool) -> int:
    """How many forwards (each with its backward) :func:`_micro_batch` runs on ``mb``."""
    if mb.size == 0:
        return 0
    if skip_rows:
        mb = mb.slice(live_rows(mb).nonzero().squeeze(-1))
        if mb.size == 0:
            return 0
    return len(mb.token_chunks(cfg.max_tokens_per_microbatch))


def disable_dropout(model) -> None:
    """TRL's ``disable_dropout``: every ``nn.Dropout`` to p = 0, and the attention dropout
    rate that Hugging Face attention modules keep as a float attribute, to 0."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def skips_zero_loss_rows(cfg: UpdateConfig) -> bool:
    """Whether rows with a zero advantage (or no token that counts) have a zero loss under
    ``cfg`` and ``skip_zero_advantage`` leaves them out (module docstring)."""
    return cfg.skip_zero_advantage and cfg.loss.beta == 0 and cfg.top_entropy_quantile == 1.0


def live_rows(batch: UpdateBatch) -> Tensor:
    """Bool ``[n]``: rows with a non-zero advantage and at least one completion token that
    counts (the others have a zero loss when :func:`skips_zero_loss_rows`)."""
    adv = batch.advantages.reshape(batch.size, -1)  # [n, 1] or [n, T]
    return adv.ne(0).any(-1) & batch.completion_mask.bool().any(-1)


def _old_logprobs_of_live_rows(model, batch: UpdateBatch, **nograd) -> Tensor:
    """``batched_logprobs`` of the live rows only, zeros for the others (never read)."""
    live = live_rows(batch).nonzero().squeeze(-1)  # [m]
    out = torch.zeros(batch.completion_ids.shape, dtype=torch.float32)  # [N, T]
    if len(live):
        part = batched_logprobs(model, batch.slice(live), **nograd)  # [m, T]
        out = out.to(part.dtype)
        out[live] = part
    return out


def _zero_missing_grads(model) -> None:
    """Zero gradients where none were computed: a window whose rows were all skipped steps
    the optimizer as the full batch's zero gradients would (AdamW moments, weight decay)."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def _all_skipped(window: list[dict]) -> bool:
    """No micro-batch of the optimizer step ran a backward pass, and some skipped theirs
    (``{}``: a data-parallel rank without rows in that micro-batch)."""
    ran = any(m and not m.get("skipped") for m in window)
    return not ran and any(m.get("skipped") for m in window)


def _accumulation_plan(cfg: UpdateConfig, n_groups: int) -> tuple[int, int]:
    """``(micro_batches, accumulation)`` of one pass. With fewer groups than
    ``steps_per_generation`` (dynamic sampling dropped some), keep as many optimizer steps as
    the groups allow, each accumulating as many one-group-or-more micro-batches as remain."""
    steps = min(cfg.optimizer_steps_per_generation, n_groups)
    accumulation = max(1, min(cfg.gradient_accumulation_steps, n_groups // steps))
    return steps * accumulation, accumulation


def grpo_update(
    model,
    optimizer: torch.optim.Optimizer,
    scheduler,
    batch: UpdateBatch,
    config: UpdateConfig | None = None,
    *,
    ref_model=None,
    on_step: Callable[[dict], None] | None = None,
    data_parallel: DataParallel | None = None,
) -> list[dict]:
    """Optimizer steps on one generation batch; returns one metrics dict per optimizer step.

    As TRL (see :class:`~grpo_core.loss_config.UpdateConfig`): ``steps_per_generation``
    micro-batches of whole groups (rows are group-contiguous: the rollout stage writes
    prompt-major order), ``num_iterations`` passes, an optimizer step every
    ``gradient_accumulation_steps`` micro-batches. Each micro-batch's loss is divided as TRL
    does (:func:`grpo_core.losses.step_normalisers`). ``config.engine_correction``
    reweights tokens by trainer/engine probability ratios using ``batch.sampling_logp``.
    ``data_parallel``: this rank of N, each holding the whole ``batch`` and a replica of the
    model; it trains its share of every micro-batch's groups and the N ranks make the update
    of one process (:mod:`grpo_core.distributed`).
    """
    cfg = config or UpdateConfig()
    loss_cfg = cfg.loss
    if loss_cfg.beta > 0 and ref_model is None:
        raise ValueError("beta > 0 needs a reference model")
    if cfg.engine_correction is not None and batch.sampling_logp is None:
        raise ValueError("engine_correction needs the rollout engine's log-probs (sampling_logp)")
    n_groups = batch.size if batch.group_ids is None else len(torch.unique(batch.group_ids))
    micro, accumulation = _accumulation_plan(cfg, n_groups)
    slices = batch.step_slices(micro)
    dp = data_parallel or LOCAL  # one process, or this rank of N (grpo_core/parallel.py)
    cfg = dp.prepare(cfg)
    batch, slices = dp.shard(batch, slices)  # a rank: its rows only from here on
    tokens, rows = micro_batch_counts([batch.completion_mask[i] for i in slices])
    tokens, rows = dp.all_reduce_counts(tokens, rows)  # the global micro-batches' counts
    norms = step_normalisers(loss_cfg.loss_type, tokens, rows, accumulation)
    if cfg.disable_dropout:
        disable_dropout(model)
        if ref_model is not None:
            disable_dropout(ref_model)
    device = model.device
    precision = Precision.for_model(model, bf16=cfg.bf16, fp16=cfg.fp16)
    model.train()  # old log-probs see the model exactly as the loss's forward does
    reuse = needs_old_logprobs(
        cfg.num_iterations, micro // accumulation, cfg.engine_correction is not None
    )
    nograd = dict(
        temperature=cfg.temperature,
        max_tokens=cfg.max_tokens_per_microbatch,
        lm_head=cfg.lm_head,
        precision=precision,
    )
    has_rows = batch.size > 0  # a rank of a data-parallel group may have none
    sharded = dp.sharded
    if sharded:  # the ranks agree on their forwards before running them (grpo_core/fsdp.py)
        plan = [_old_logprob_forwards(batch, cfg, reuse and has_rows)]
        plan += [
            _loss_forwards(batch.slice(idx), cfg, skips_zero_loss_rows(cfg))
            for _ in range(cfg.num_iterations)
            for idx in slices
        ]
        nograd_target, *loss_targets = dp.agree(plan)
    old_logp = None  # [N, T]
    if reuse and has_rows:
        if cfg.old_logprobs == "sampler":  # the sampler's own log-probs: no forward pass
            if batch.sampling_logp is None:
                raise ValueError("old_logprobs='sampler' needs the batch's sampling_logp")
            old_logp = batch.sampling_logp
        elif skips_zero_loss_rows(cfg) and cfg.engine_correction is None:
            old_logp = _old_logprobs_of_live_rows(model, batch, **nograd)
        else:
            old_logp = batched_logprobs(model, batch, **nograd)
    ref_logp = None
    if loss_cfg.beta > 0 and has_rows:
        ref_model.eval()
        ref_logp = batched_logprobs(ref_model, batch, **nograd)  # [N, T]
    is_weights, is_metrics = None, {}
    if cfg.engine_correction is not None and has_rows:
        c = cfg.engine_correction
        is_weights, is_metrics = engine_importance_weights(
            old_logp,
            batch.sampling_logp,
            batch.completion_mask,
            mode=c.mode,
            clip_min=c.clip_min,
            clip_max=c.clip_max,
        )  # [N, T] or [N, 1]
    if sharded:  # FSDP2: as many sharded forwards as the busiest rank (grpo_core/fsdp.py)
        dp.pad_to(model, nograd_target, grad=False)
    if cfg.engine_correction is not None:
        is_metrics = dp.importance_metrics(is_metrics, float(batch.completion_mask.sum()))
    history: list[dict] = []
    window: list[dict] = []
    window_tokens: list[float] = []
    skip_rows = skips_zero_loss_rows(cfg)
    optimizer.zero_grad(set_to_none=True)
    for k in range(cfg.num_iterations):
        for j, idx in enumerate(slices):
            metrics = {}
            if len(idx):
                metrics = _micro_batch(
                    model,
                    batch.slice(idx),
                    cfg,
                    precision,
                    old_logp=_rows(old_logp, idx, device),
                    ref_logp=_rows(ref_logp, idx, device),
                    is_weights=_rows(is_weights, idx, device),
                    norm=norms[j],
                    skip_rows=skip_rows,
                )
            if sharded:
                dp.pad_to(model, loss_targets[k * len(slices) + j], grad=True)
            window.append(metrics)
            window_tokens.append(float(batch.completion_mask[idx].sum()))
            if (j + 1) % accumulation:
                continue
            if skip_rows and _all_skipped(window):
                _zero_missing_grads(model)
            dp.all_reduce_gradients(model)  # the full gradient, before scaling and clipping
            precision.unscale_(optimizer)
            grad_norm = dp.clip_grad_norm(model, cfg.max_grad_norm)
            precision.step(optimizer)
            if scheduler is not None:
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step = dp.step_metrics(window, window_tokens)
            step.update(is_metrics)
            step["grad_norm"] = float(grad_norm)
            step["learning_rate"] = optimizer.param_groups[0]["lr"]
            history.append(step)
            window, window_tokens = [], []
            if on_step is not None:
                on_step(step)
    model.eval()
    return history


def _micro_batch(
    model,
    mb: UpdateBatch,
    cfg: UpdateConfig,
    precision: Precision,
    *,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    is_weights: Tensor | None,
    norm: Tensor | int,
    skip_rows: bool = False,
    _entropy_of_skipped: bool = True,
) -> dict:
    """Forward and backward of one logical micro-batch, in physical chunks of at most
    ``cfg.max_tokens_per_microbatch`` padded tokens. Every chunk's loss is divided by the
    logical micro-batch's normaliser ``norm``, so the accumulated gradient is the unsplit one; the
    metrics are those of the whole micro-batch (recomputed from the chunks' detached
    log-probs when it was split). ``skip_rows``: rows with a zero loss are left out
    (module docstring); ``{"skipped": True}`` when that is all of them."""
    if skip_rows and not cfg.entropy_of_skipped_rows:  # the metric named for what it is
        metrics = _micro_batch(
            model, mb, dataclasses.replace(cfg, entropy_of_skipped_rows=True), precision,
            old_logp=old_logp, ref_logp=ref_logp, is_weights=is_weights, norm=norm,
            skip_rows=True, _entropy_of_skipped=False,
        )  # fmt: skip
        if "entropy" in metrics:
            metrics["entropy/trained_rows"] = metrics.pop("entropy")
        return metrics
    if skip_rows:
        live = live_rows(mb)  # [n]
        if not bool(live.all()):
            idx = live.nonzero().squeeze(-1)  # [m]
            if len(idx) == 0:
                if not _entropy_of_skipped:
                    return {"skipped": True}
                ent_sum, ent_tokens = _entropy_sum(model, mb, cfg, precision)
                return {"skipped": True, "entropy": ent_sum / max(ent_tokens, 1)}
            live_tokens = mb.completion_mask[idx].sum()
            # a clip ratio's mean is over tokens, or over rows for GSPO's sequence ratios
            sequence = cfg.loss.importance_sampling_level == "sequence"
            share = (
                len(idx) / len(live) if sequence else float(live_tokens / mb.completion_mask.sum())
            )
            on = idx.to(old_logp.device) if old_logp is not None else idx
            metrics = _micro_batch(
                model,
                mb.slice(idx),
                cfg,
                precision,
                old_logp=None if old_logp is None else old_logp[on],
                ref_logp=None if ref_logp is None else ref_logp[on],
                is_weights=None if is_weights is None else is_weights[on],
                norm=norm,
            )
            for key in [k for k in metrics if k.startswith("clip_ratio/")]:
                metrics[key] *= share  # skipped rows are never clipped: a mean over all rows
            if not _entropy_of_skipped:
                return metrics
            skipped = mb.slice((~live).nonzero().squeeze(-1))
            ent_sum, ent_tokens = _entropy_sum(model, skipped, cfg, precision)
            tokens = float(live_tokens) + ent_tokens
            metrics["entropy"] = (metrics["entropy"] * float(live_tokens) + ent_sum) / max(
                tokens, 1
            )
            return metrics
    device = model.device
    mask = mb.completion_mask.to(device)  # [n, T]
    adv = mb.advantages.to(device)  # [n]
    norm = norm.to(device) if isinstance(norm, Tensor) else norm
    parts = [p.to(device) for p in mb.token_chunks(cfg.max_tokens_per_microbatch)]
    token_weights = None
    if cfg.top_entropy_quantile < 1.0 and len(parts) > 1:
        # the quantile is over the whole micro-batch: its entropies first, without grad
        with torch.no_grad():
            ents = [_forward(model, mb, p, cfg, precision)[1] for p in parts]
        token_weights = top_entropy_mask(torch.cat(ents), mask, cfg.top_entropy_quantile).float()

    def part_of(x: Tensor | None, p: Tensor) -> Tensor | None:
        return None if x is None else x[p]

    logps, entropies = [], []
    for p in parts:
        logp, entropy = _forward(model, mb, p, cfg, precision)  # [c, T] each
        if cfg.top_entropy_quantile < 1.0 and len(parts) == 1:
            token_weights = top_entropy_mask(entropy, mask, cfg.top_entropy_quantile).float()
        loss, metrics = policy_loss(
            logp,
            part_of(old_logp, p),
            adv[p],
            mask[p],
            cfg.loss,
            ref_logp=part_of(ref_logp, p),
            num_items_in_batch=norm,
            token_weights=part_of(token_weights, p),
            importance_sampling_ratio=part_of(is_weights, p),
        )
        precision.backward(loss)
        logps.append(logp.detach())
        entropies.append(entropy.detach())
    if len(parts) > 1:
        with torch.no_grad():
            loss, metrics = policy_loss(
                torch.cat(logps),
                old_logp,
                adv,
                mask,
                cfg.loss,
                ref_logp=ref_logp,
                num_items_in_batch=norm,
                token_weights=token_weights,
                importance_sampling_ratio=is_weights,
            )
    entropy = torch.cat(entropies)  # [n, T]
    metrics["loss"] = float(loss.detach())
    metrics["entropy"] = float((entropy * mask).sum() / mask.sum().clamp(min=1))
    return metrics


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


def _rows(x: Tensor | None, idx: Tensor, device) -> Tensor | None:
    return None if x is None else x[idx].to(device)


def _forward(model, mb: UpdateBatch, rows: Tensor, cfg: UpdateConfig, precision: Precision):
    with precision.autocast():
        return completion_logprobs(
            model,
            mb.slice(rows.cpu()),
            temperature=cfg.temperature,
            with_entropy=True,
            lm_head=cfg.lm_head,
        )

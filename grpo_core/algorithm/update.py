"""The GRPO update: one generation batch of scored completions -> optimizer steps.

Order of the GRPO paper (DeepSeekMath, Alg. 1), for one generation batch:
  1. old log-probs pi_old(o_t) once, without grad, in train mode like the loss's forward
     (skipped when the batch makes a single on-policy optimizer step: then
     old = current.detach(), no extra forward, as TRL; or taken from the sampler's stored
     log-probs with ``old_logprobs="sampler"``, see ``grpo_core.logprobs.old``);
  2. reference log-probs when beta > 0 (no reference model exists otherwise);
  3. ``steps_per_generation`` micro-batches of whole groups, repeated ``num_iterations`` (mu)
     times, each minimising ``grpo_core.algorithm.losses.policy_loss``, with an optimizer step every
     ``gradient_accumulation_steps`` micro-batches (TRL's meaning of these names).
Memory: each micro-batch may run in physical chunks of at most ``max_tokens_per_microbatch``
padded tokens, each divided by the micro-batch's normaliser (the gradient is the unsplit one);
log-probs come from the hidden states through the LM head in chunks (``grpo_core.logprobs.lm_head``);
``bf16``/``fp16`` autocast the forward (``grpo_core.logprobs.precision``).
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

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_core.algorithm.batch import build_batch
from grpo_core.algorithm.importance import (
    behaviour_weights,
    engine_importance_weights,
    ess_parts,
    needs_old_logprobs,
)
from grpo_core.algorithm.losses import micro_batch_counts, step_normalisers
from grpo_core.algorithm.micro_batch import RowTensors, live_rows, micro_batch, skips_zero_loss_rows
from grpo_core.config.loss import UpdateConfig
from grpo_core.contracts.batch import UpdateBatch
from grpo_core.logprobs.batch import (
    LOGPROB_CHUNK,
    batched_logprobs,
    completion_logprobs,
    logprob_chunks,
)
from grpo_core.logprobs.precision import Precision
from grpo_core.training.distributed import DataParallel
from grpo_core.training.parallel import LOCAL, LocalParallel

__all__ = [
    "UpdateBatch",
    "batched_logprobs",
    "build_batch",
    "completion_logprobs",
    "grpo_update",
    "live_rows",
    "model_device",
    "skips_zero_loss_rows",
]


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
    scaler: torch.amp.GradScaler | None = None,
) -> list[dict]:
    """Optimizer steps on one generation batch; returns one metrics dict per optimizer step.

    As TRL (see :class:`~grpo_core.config.loss.UpdateConfig`): ``steps_per_generation``
    micro-batches of whole groups (rows are group-contiguous: the rollout stage writes
    prompt-major order), ``num_iterations`` passes, an optimizer step every
    ``gradient_accumulation_steps`` micro-batches. Each micro-batch's loss is divided as TRL
    does (:func:`grpo_core.algorithm.losses.step_normalisers`). ``config.engine_correction``
    reweights tokens by trainer/engine probability ratios using ``batch.sampling_logp``.
    ``data_parallel``: this rank of N, each holding the whole ``batch`` and a replica of the
    model; it trains its share of every micro-batch's groups and the N ranks make the update
    of one process (:mod:`grpo_core.training.distributed`). ``scaler``: the stage's loss scaler
    (fp16), which carries its scale from one generation batch to the next (default: a fresh
    one per call).
    """
    cfg = config or UpdateConfig()
    _check_inputs(batch, cfg, ref_model)
    batch = batch.to(model_device(model))  # the one crossing: everything below is made there
    n_groups = batch.size if batch.group_ids is None else len(torch.unique(batch.group_ids))
    micro, accumulation = _accumulation_plan(cfg, n_groups)
    slices = batch.step_slices(micro)
    dp = data_parallel or LOCAL  # one process, or this rank of N (grpo_core/training/parallel.py)
    cfg = dp.prepare(cfg)
    batch, slices = dp.shard(batch, slices)  # a rank: its rows only from here on
    tokens, rows = micro_batch_counts([batch.completion_mask[i] for i in slices])
    tokens, rows = dp.all_reduce_counts(tokens, rows)  # the global micro-batches' counts
    norms = step_normalisers(cfg.loss.loss_type, tokens, rows, accumulation)
    if cfg.disable_dropout:
        disable_dropout(model)
        if ref_model is not None:
            disable_dropout(ref_model)
    precision = Precision.for_model(model, bf16=cfg.bf16, fp16=cfg.fp16, scaler=scaler)
    model.train()  # old log-probs see the model exactly as the loss's forward does
    # the sampler's log-probs are the old ones whenever that mode is chosen, also with one
    # optimizer step (else old = current.detach(): stale rows would train as on-policy)
    reuse = cfg.old_logprobs == "sampler" or needs_old_logprobs(
        cfg.num_iterations, micro // accumulation, _weighs_rows(cfg)
    )
    nograd_target, loss_targets = _forward_plan(dp, batch, slices, cfg, reuse)
    fixed, is_metrics = _row_tensors(model, ref_model, batch, cfg, precision, reuse)
    if (
        dp.sharded
    ):  # FSDP2: as many sharded forwards as the busiest rank (grpo_core/training/fsdp.py)
        dp.pad_to(model, nograd_target, grad=False)
    if _weighs_rows(cfg):
        weights = fixed.is_weights
        ess = ess_parts(weights, batch.completion_mask) if weights is not None else None
        is_metrics = dp.importance_metrics(is_metrics, float(batch.completion_mask.sum()), ess)
    run = _Run(model, optimizer, scheduler, cfg, precision, dp, batch, slices, fixed, norms)
    history = _passes(run, accumulation, loss_targets, is_metrics, on_step)
    model.eval()
    return history


def model_device(model) -> torch.device:
    """Where ``model`` computes: its first parameter's device (the device of a Hugging Face
    model, a peft wrapper, an FSDP2-sharded module's local shards)."""
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    return next(model.parameters()).device


def _check_inputs(batch: UpdateBatch, cfg: UpdateConfig, ref_model) -> None:
    if cfg.loss.beta > 0 and ref_model is None:
        raise ValueError("beta > 0 needs a reference model")
    if _weighs_rows(cfg) and batch.sampling_logp is None:
        raise ValueError(
            "engine_correction and behaviour_weight need the rollout engine's log-probs "
            "(sampling_logp)"
        )
    if cfg.engine_correction is not None and cfg.behaviour_weight is not None:
        raise ValueError(
            "engine_correction and behaviour_weight both divide by the sampler's log-probs: "
            "give one (the behaviour weight of stale rows covers the engine's mismatch too)"
        )
    if cfg.behaviour_weight is not None and cfg.old_logprobs == "sampler":
        raise ValueError(
            "behaviour_weight with old_logprobs='sampler': the weight pi_old / mu would be 1"
        )


def _weighs_rows(cfg: UpdateConfig) -> bool:
    """Whether each token's loss is multiplied by a weight against the sampler's log-probs
    (the engine correction, or the behaviour weight of stale rows): old log-probs of every
    row are then needed."""
    return cfg.engine_correction is not None or cfg.behaviour_weight is not None


def _accumulation_plan(cfg: UpdateConfig, n_groups: int) -> tuple[int, int]:
    """``(micro_batches, accumulation)`` of one pass. With fewer groups than
    ``steps_per_generation`` (dynamic sampling dropped some), keep as many optimizer steps as
    the groups allow, each accumulating as many one-group-or-more micro-batches as remain."""
    steps = min(cfg.optimizer_steps_per_generation, n_groups)
    accumulation = max(1, min(cfg.gradient_accumulation_steps, n_groups // steps))
    return steps * accumulation, accumulation


def disable_dropout(model) -> None:
    """TRL's ``disable_dropout``: every ``nn.Dropout`` to p = 0, and the attention dropout
    rate that Hugging Face attention modules keep as a float attribute, to 0."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def _forward_plan(
    dp: LocalParallel, batch: UpdateBatch, slices: list[Tensor], cfg: UpdateConfig, reuse: bool
) -> tuple[int, list[int]]:
    """FSDP2 ranks agree on their forwards before running them (grpo_core/training/fsdp.py): the
    busiest rank's count of no-grad forwards, then of each micro-batch's loss forwards, in
    the order they run. ``(0, [])`` where parameters are not sharded."""
    if not dp.sharded:
        return 0, []
    plan = [_old_logprob_forwards(batch, cfg, reuse and batch.size > 0)]
    plan += [
        _loss_forwards(batch.slice(idx), cfg, skips_zero_loss_rows(cfg))
        for _ in range(cfg.num_iterations)
        for idx in slices
    ]
    nograd_target, *loss_targets = dp.agree(plan)
    return nograd_target, loss_targets


def _old_logprob_forwards(batch: UpdateBatch, cfg: UpdateConfig, needed: bool) -> int:
    """How many forwards the old log-probs of ``batch`` take (as :func:`_row_tensors`
    computes them)."""
    if not needed or cfg.old_logprobs == "sampler":
        return 0
    if skips_zero_loss_rows(cfg) and not _weighs_rows(cfg):
        batch = batch.slice(live_rows(batch).nonzero().squeeze(-1))
        if batch.size == 0:
            return 0
    return len(logprob_chunks(batch, LOGPROB_CHUNK, cfg.max_tokens_per_microbatch))


def _loss_forwards(mb: UpdateBatch, cfg: UpdateConfig, skip_rows: bool) -> int:
    """How many forwards (each with its backward) ``micro_batch`` runs on ``mb``."""
    if mb.size == 0:
        return 0
    if skip_rows:
        mb = mb.slice(live_rows(mb).nonzero().squeeze(-1))
        if mb.size == 0:
            return 0
    return len(mb.token_chunks(cfg.max_tokens_per_microbatch))


def _row_tensors(
    model, ref_model, batch: UpdateBatch, cfg: UpdateConfig, precision: Precision, reuse: bool
) -> tuple[RowTensors, dict]:
    """What every micro-batch reads, computed once for the generation batch without grad:
    old log-probs (``reuse``: more than one on-policy step, or the sampler's by choice),
    reference log-probs (beta > 0),
    the engine's importance weights; and the weights' metrics."""
    fixed = RowTensors()
    if batch.size == 0:  # a rank of a data-parallel group may have no rows
        return fixed, {}
    nograd = dict(
        temperature=cfg.temperature,
        max_tokens=cfg.max_tokens_per_microbatch,
        lm_head=cfg.lm_head,
        precision=precision,
    )
    if reuse:
        fixed.old_logp = _old_logprobs(model, batch, cfg, nograd)  # [N, T]
    if cfg.loss.beta > 0:
        ref_model.eval()
        fixed.ref_logp = batched_logprobs(ref_model, batch, **nograd).to(batch.device)  # [N, T]
    if cfg.behaviour_weight is not None:
        b = cfg.behaviour_weight
        fixed.is_weights, metrics = behaviour_weights(
            fixed.old_logp, batch.sampling_logp, batch.completion_mask, mode=b.mode, cap=b.cap
        )  # [N, T]
        return fixed, metrics
    if cfg.engine_correction is None:
        return fixed, {}
    c = cfg.engine_correction
    fixed.is_weights, metrics = engine_importance_weights(
        fixed.old_logp,
        batch.sampling_logp,
        batch.completion_mask,
        mode=c.mode,
        clip_min=c.clip_min,
        clip_max=c.clip_max,
    )  # [N, T] or [N, 1]
    return fixed, metrics


def _old_logprobs(model, batch: UpdateBatch, cfg: UpdateConfig, nograd: dict) -> Tensor:
    """pi_old of every row: the sampler's own log-probs (no forward pass), else a no-grad
    pass over the rows whose loss is not exactly 0."""
    if cfg.old_logprobs == "sampler":
        if batch.sampling_logp is None:
            raise ValueError("old_logprobs='sampler' needs the batch's sampling_logp")
        return batch.sampling_logp
    if skips_zero_loss_rows(cfg) and not _weighs_rows(cfg):
        return _old_logprobs_of_live_rows(model, batch, **nograd)
    return batched_logprobs(model, batch, **nograd)


def _old_logprobs_of_live_rows(model, batch: UpdateBatch, **nograd) -> Tensor:
    """``batched_logprobs`` of the live rows only, zeros for the others (never read)."""
    live = live_rows(batch).nonzero().squeeze(-1)  # [m]
    out = torch.zeros(batch.completion_ids.shape, dtype=torch.float32, device=batch.device)
    if len(live):
        part = batched_logprobs(model, batch.slice(live), **nograd)  # [m, T]
        out = out.to(part.dtype)
        out[live] = part
    return out


@dataclass
class _Run:
    """What the optimizer steps of one update share."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    cfg: UpdateConfig
    precision: Precision
    dp: LocalParallel
    batch: UpdateBatch
    slices: list[Tensor]  # row indices of each micro-batch
    fixed: RowTensors
    norms: list  # each micro-batch's normaliser


def _passes(
    run: _Run, accumulation: int, loss_targets: list[int], is_metrics: dict, on_step
) -> list[dict]:
    """``num_iterations`` passes over the micro-batches, an optimizer step every
    ``accumulation`` of them; one metrics dict per step."""
    model, dp, batch, slices = run.model, run.dp, run.batch, run.slices
    skip_rows = skips_zero_loss_rows(run.cfg)
    history: list[dict] = []
    window: list[dict] = []
    window_tokens: list[float] = []
    run.optimizer.zero_grad(set_to_none=True)
    for k in range(run.cfg.num_iterations):
        for j, idx in enumerate(slices):
            metrics = {}
            if len(idx):
                fixed = run.fixed.rows(idx)
                mb = batch.slice(idx)
                metrics = micro_batch(
                    model, mb, run.cfg, run.precision, fixed, run.norms[j], skip_rows=skip_rows
                )
            if dp.sharded:
                dp.pad_to(model, loss_targets[k * len(slices) + j], grad=True)
            window.append(metrics)
            window_tokens.append(float(batch.completion_mask[idx].sum()))
            if (j + 1) % accumulation:
                continue
            step = _optimizer_step(run, window, window_tokens, is_metrics)
            history.append(step)
            window, window_tokens = [], []
            if on_step is not None:
                on_step(step)
    return history


def _optimizer_step(
    run: _Run, window: list[dict], window_tokens: list[float], is_metrics: dict
) -> dict:
    """The accumulated gradients (all ranks') clipped and applied, the schedule advanced;
    the step's metrics from its micro-batches' and the importance weights'."""
    model, optimizer, dp = run.model, run.optimizer, run.dp
    if skips_zero_loss_rows(run.cfg) and _all_skipped(window):
        _zero_missing_grads(model)
    dp.all_reduce_gradients(model)  # the full gradient, before scaling and clipping
    run.precision.unscale_(optimizer)
    grad_norm = dp.clip_grad_norm(model, run.cfg.max_grad_norm)
    scaled = run.precision.step(optimizer)
    if run.scheduler is not None and not scaled.get("grad_scaler/skipped"):  # as HF Trainer
        run.scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    step = dp.step_metrics(window, window_tokens)
    step.update(is_metrics)
    step.update(scaled)
    step["grad_norm"] = float(grad_norm)
    step["learning_rate"] = optimizer.param_groups[0]["lr"]
    return step


def _all_skipped(window: list[dict]) -> bool:
    """No micro-batch of the optimizer step ran a backward pass, and some skipped theirs
    (``{}``: a data-parallel rank without rows in that micro-batch)."""
    ran = any(m and not m.get("skipped") for m in window)
    return not ran and any(m.get("skipped") for m in window)


def _zero_missing_grads(model) -> None:
    """Zero gradients where none were computed: a window whose rows were all skipped steps
    the optimizer as the full batch's zero gradients would (AdamW moments, weight decay)."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)

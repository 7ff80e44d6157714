"""The GRPO update: one generation batch of scored completions -> optimizer steps.

Order of the GRPO paper (DeepSeekMath, Alg. 1), for one generation batch:
  1. old log-probs pi_old(o_t) once, without grad, in train mode like the loss's forward
     (skipped when the batch makes a single on-policy optimizer step: then
     old = current.detach(), no extra forward, as TRL);
  2. reference log-probs when beta > 0 (no reference model exists otherwise);
  3. ``steps_per_generation`` micro-batches of whole groups, repeated ``num_iterations`` (mu)
     times, each minimising ``grpo_core.losses.policy_loss``, with an optimizer step every
     ``gradient_accumulation_steps`` micro-batches (TRL's meaning of these names).
Departures from the paper: advantages come precomputed from the scored Parquet (so an
offline update can use any scored file); dropout is off by default (``disable_dropout``, TRL's
option, off by default there), so that pi_old and pi_theta are the same function at step 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_core.importance import engine_importance_weights, needs_old_logprobs
from grpo_core.logprobs import token_logprobs
from grpo_core.loss_config import UpdateConfig
from grpo_core.losses import micro_batch_normaliser, policy_loss
from grpo_core.sampling_filters import mask_truncated_completions, top_entropy_mask


@dataclass
class UpdateBatch:
    """Padded tensors of one generation batch. N sequences, prompt width P, completion T."""

    input_ids: Tensor  # [N, P + T] left-padded prompt, right-padded completion
    attention_mask: Tensor  # [N, P + T]
    completion_ids: Tensor  # [N, T]
    completion_mask: Tensor  # [N, T] 1 on real completion tokens
    advantages: Tensor  # [N]
    prompt_width: int  # P
    group_ids: Tensor | None = None  # [N] rows of one prompt's group share an id
    sampling_logp: Tensor | None = None  # [N, T] rollout engine's log-probs (0 on padding)

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def slice(self, idx: Tensor) -> UpdateBatch:
        return UpdateBatch(
            self.input_ids[idx],
            self.attention_mask[idx],
            self.completion_ids[idx],
            self.completion_mask[idx],
            self.advantages[idx],
            self.prompt_width,
            None if self.group_ids is None else self.group_ids[idx],
            None if self.sampling_logp is None else self.sampling_logp[idx],
        )

    def step_slices(self, steps: int) -> list[Tensor]:
        """Row indices of ``steps`` micro-batches holding whole groups (as equal as possible)."""
        gids = self.group_ids if self.group_ids is not None else torch.arange(self.size)
        groups = torch.unique_consecutive(gids)  # [G] rows must be group-contiguous
        if len(groups) != len(torch.unique(gids)):
            raise ValueError(
                "the rows of a group must be contiguous (the rollout stage writes them so): "
                "a group split over two optimizer steps would train its rows twice"
            )
        if len(groups) < steps:
            raise ValueError(f"batch of {len(groups)} groups does not split into {steps} steps")
        if self.group_ids is None and self.size % steps:
            raise ValueError(f"batch of {self.size} rows does not split into {steps} steps")
        parts = torch.tensor_split(groups, steps)
        return [torch.isin(gids, part).nonzero().squeeze(-1) for part in parts]


def build_batch(
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    advantages: list[float],
    pad_id: int,
    *,
    truncated: list[bool] | None = None,
    group_ids: list[int] | None = None,
    sampling_logprobs: list[list[float]] | None = None,
) -> UpdateBatch:
    """Pad rollouts into an :class:`UpdateBatch`. ``truncated`` rows get an all-zero mask
    (TRL's ``mask_truncated_completions``); ``group_ids`` must be group-contiguous."""
    N = len(prompt_ids)
    P = max(len(p) for p in prompt_ids)
    T = max(1, max(len(c) for c in completion_ids))
    ids = torch.full((N, P + T), pad_id, dtype=torch.long)
    attn = torch.zeros((N, P + T), dtype=torch.long)
    comp_mask = torch.zeros((N, T), dtype=torch.float32)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
        ids[i, P - len(p) : P] = torch.tensor(p)
        attn[i, P - len(p) : P] = 1
        if c:
            ids[i, P : P + len(c)] = torch.tensor(c)
            attn[i, P : P + len(c)] = 1
            comp_mask[i, : len(c)] = 1.0
    if truncated is not None:
        comp_mask = mask_truncated_completions(comp_mask, torch.tensor(truncated, dtype=torch.bool))
    adv = torch.tensor(advantages, dtype=torch.float32)
    gids = None if group_ids is None else torch.tensor(group_ids, dtype=torch.long)
    samp = None
    if sampling_logprobs is not None:
        samp = torch.zeros((N, T), dtype=torch.float32)
        for i, lp in enumerate(sampling_logprobs):
            samp[i, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
    return UpdateBatch(ids, attn, ids[:, P:], comp_mask, adv, P, gids, samp)


def completion_logprobs(
    model, batch: UpdateBatch, *, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs ``[n, T]`` of the completion tokens (and entropies)."""
    device = model.device
    attn = batch.attention_mask.to(device)
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)  # [n, P+T]
    logits = model(
        input_ids=batch.input_ids.to(device), attention_mask=attn, position_ids=position_ids
    ).logits  # [n, P+T, V]
    P = batch.prompt_width
    logits = logits[:, P - 1 : -1]  # [n, T, V]: position t predicts completion token t
    return token_logprobs(
        logits, batch.completion_ids.to(device), temperature=temperature, with_entropy=with_entropy
    )


@torch.no_grad()
def batched_logprobs(model, batch: UpdateBatch, *, temperature: float, chunk: int = 64) -> Tensor:
    """No-grad log-probs of the whole batch, ``chunk`` sequences at a time, in the model's
    current train/eval mode (the old log-probs must see the model as the loss does). [N, T]"""
    out = [
        completion_logprobs(
            model, batch.slice(torch.arange(s, min(s + chunk, batch.size))), temperature=temperature
        )[0]
        for s in range(0, batch.size, chunk)
    ]
    return torch.cat(out, dim=0)


def disable_dropout(model) -> None:
    """TRL's ``disable_dropout``: every ``nn.Dropout`` to p = 0, and the attention dropout
    rate that Hugging Face attention modules keep as a float attribute, to 0."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


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
) -> list[dict]:
    """Optimizer steps on one generation batch; returns one metrics dict per optimizer step.

    As TRL (see :class:`~grpo_core.loss_config.UpdateConfig`): ``steps_per_generation``
    micro-batches of whole groups (rows are group-contiguous: the rollout stage writes
    prompt-major order), ``num_iterations`` passes, an optimizer step every
    ``gradient_accumulation_steps`` micro-batches. Each micro-batch's loss is divided as TRL
    does (:func:`grpo_core.losses.micro_batch_normaliser`). ``config.engine_correction``
    reweights tokens by trainer/engine probability ratios using ``batch.sampling_logp``.
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
    if cfg.disable_dropout:
        disable_dropout(model)
        if ref_model is not None:
            disable_dropout(ref_model)
    device = model.device
    model.train()  # old log-probs see the model exactly as the loss's forward does
    reuse = needs_old_logprobs(
        cfg.num_iterations, micro // accumulation, cfg.engine_correction is not None
    )
    temperature = cfg.temperature
    old_logp = batched_logprobs(model, batch, temperature=temperature) if reuse else None  # [N, T]
    ref_logp = None
    if loss_cfg.beta > 0:
        ref_model.eval()
        ref_logp = batched_logprobs(ref_model, batch, temperature=temperature)  # [N, T]
    is_weights, is_metrics = None, {}
    if cfg.engine_correction is not None:
        c = cfg.engine_correction
        is_weights, is_metrics = engine_importance_weights(
            old_logp,
            batch.sampling_logp,
            batch.completion_mask,
            mode=c.mode,
            clip_min=c.clip_min,
            clip_max=c.clip_max,
        )  # [N, T] or [N, 1]
    batch_tokens = batch.completion_mask.sum()  # dapo's normaliser: the generation batch's tokens
    history: list[dict] = []
    window: list[dict] = []
    optimizer.zero_grad(set_to_none=True)
    for _ in range(cfg.num_iterations):
        for j, idx in enumerate(slices):
            mb = batch.slice(idx)
            logp, entropy = completion_logprobs(
                model, mb, temperature=temperature, with_entropy=True
            )  # [n, T] each
            mask = mb.completion_mask.to(device)  # [n, T]
            token_weights = None
            if cfg.top_entropy_quantile < 1.0:
                token_weights = top_entropy_mask(entropy, mask, cfg.top_entropy_quantile).float()
            loss, metrics = policy_loss(
                logp,
                None if old_logp is None else old_logp[idx].to(device),
                mb.advantages.to(device),
                mask,
                loss_cfg,
                ref_logp=None if ref_logp is None else ref_logp[idx].to(device),
                num_items_in_batch=micro_batch_normaliser(
                    loss_cfg.loss_type, mask, batch_tokens, accumulation
                ),
                token_weights=token_weights,
                importance_sampling_ratio=None
                if is_weights is None
                else is_weights[idx].to(device),
            )
            loss.backward()
            metrics["loss"] = float(loss.detach())
            metrics["entropy"] = float((entropy.detach() * mask).sum() / mask.sum().clamp(min=1))
            window.append(metrics)
            if (j + 1) % accumulation:
                continue
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step = _window_metrics(window)
            step.update(is_metrics)
            step["grad_norm"] = float(grad_norm)
            step["learning_rate"] = optimizer.param_groups[0]["lr"]
            history.append(step)
            window = []
            if on_step is not None:
                on_step(step)
    model.eval()
    return history


SUMMED_METRICS = ("loss", "policy_loss")  # parts of one step's objective; the rest are means


def _window_metrics(window: list[dict]) -> dict:
    """One optimizer step's metrics from its micro-batches'."""
    out = {}
    for key in window[0]:
        values = [m[key] for m in window]
        out[key] = sum(values) if key in SUMMED_METRICS else sum(values) / len(values)
    return out

"""The GRPO update: one generation batch of scored completions -> optimizer steps.

Order of the GRPO paper (DeepSeekMath, Alg. 1), for one generation batch:
  1. old log-probs pi_old(o_t) once, without grad (skipped when the batch is used for a
     single on-policy step: then old = current.detach(), no extra forward, as TRL);
  2. reference log-probs when beta > 0 (no reference model exists otherwise);
  3. ``steps_per_generation`` optimizer steps over disjoint slices of whole groups, repeated
     ``num_iterations`` (mu) times, each minimising ``grpo_core.losses.policy_loss``.
Departures from the paper: advantages come precomputed from the scored Parquet (so an
offline update can use any scored file); KL is the k3 estimator against a frozen reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_core.importance import engine_importance_weights, needs_old_logprobs
from grpo_core.logprobs import token_logprobs
from grpo_core.losses import policy_loss
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
        groups = torch.unique_consecutive(gids)  # rows are group-contiguous
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
    """No-grad log-probs of the whole batch, ``chunk`` sequences at a time. [N, T]"""
    was_training = model.training
    model.eval()
    out = [
        completion_logprobs(
            model, batch.slice(torch.arange(s, min(s + chunk, batch.size))), temperature=temperature
        )[0]
        for s in range(0, batch.size, chunk)
    ]
    model.train(was_training)
    return torch.cat(out, dim=0)


def grpo_update(
    model,
    optimizer: torch.optim.Optimizer,
    scheduler,
    batch: UpdateBatch,
    *,
    steps_per_generation: int = 1,
    num_iterations: int = 1,
    ref_model=None,
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    loss_type: str = "dapo",
    max_completion_length: int | None = None,
    importance_sampling_level: str = "token",
    kl_estimator: str = "k3",
    use_bias_correction_kl: bool = False,
    objective: str = "clip",
    delta: float | None = None,
    clip_ratio_c: float | None = None,
    top_entropy_quantile: float = 1.0,
    engine_correction: dict | None = None,
    temperature: float = 1.0,
    max_grad_norm: float = 1.0,
    on_step: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Run ``steps_per_generation * num_iterations`` optimizer steps on ``batch``.

    Each step takes a slice of whole groups (rows are group-contiguous: the rollout stage
    writes prompt-major order). ``engine_correction`` (``mode``, ``clip_min``, ``clip_max``)
    reweights tokens by trainer/engine probability ratios using ``batch.sampling_logp``
    (TRL's vLLM importance-sampling correction). Returns per-step metrics.
    """
    if beta > 0 and ref_model is None:
        raise ValueError("beta > 0 needs a reference model")
    if engine_correction is not None and batch.sampling_logp is None:
        raise ValueError("engine_correction needs the rollout engine's log-probs (sampling_logp)")
    slices = batch.step_slices(steps_per_generation)
    device = model.device
    reuse = needs_old_logprobs(num_iterations, steps_per_generation, engine_correction is not None)
    old_logp = batched_logprobs(model, batch, temperature=temperature) if reuse else None  # [N, T]
    ref_logp = batched_logprobs(ref_model, batch, temperature=temperature) if beta > 0 else None
    is_weights, is_metrics = None, {}
    if engine_correction is not None:
        is_weights, is_metrics = engine_importance_weights(
            old_logp, batch.sampling_logp, batch.completion_mask, **engine_correction
        )  # [N, T] or [N, 1]
    model.train()
    history = []
    for _ in range(num_iterations):
        for idx in slices:
            mb = batch.slice(idx)
            logp, entropy = completion_logprobs(
                model, mb, temperature=temperature, with_entropy=True
            )
            mask = mb.completion_mask.to(device)  # [n, T]
            token_weights = None
            if top_entropy_quantile < 1.0:
                token_weights = top_entropy_mask(entropy, mask, top_entropy_quantile).float()
            loss, metrics = policy_loss(
                logp,
                None if old_logp is None else old_logp[idx].to(device),
                mb.advantages.to(device),
                mask,
                ref_logp=None if ref_logp is None else ref_logp[idx].to(device),
                beta=beta,
                epsilon=epsilon,
                epsilon_high=epsilon_high,
                loss_type=loss_type,
                max_completion_length=max_completion_length,
                importance_sampling_level=importance_sampling_level,
                kl_estimator=kl_estimator,
                use_bias_correction_kl=use_bias_correction_kl,
                objective=objective,
                delta=delta,
                clip_ratio_c=clip_ratio_c,
                token_weights=token_weights,
                importance_sampling_ratio=None
                if is_weights is None
                else is_weights[idx].to(device),
            )
            metrics.update(is_metrics)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            metrics["loss"] = float(loss.detach())
            metrics["entropy"] = float((entropy.detach() * mask).sum() / mask.sum().clamp(min=1))
            metrics["grad_norm"] = float(grad_norm)
            metrics["learning_rate"] = optimizer.param_groups[0]["lr"]
            history.append(metrics)
            if on_step is not None:
                on_step(metrics)
    model.eval()
    return history

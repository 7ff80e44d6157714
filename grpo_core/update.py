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

from grpo_core.logprobs import token_logprobs
from grpo_core.losses import policy_loss


@dataclass
class UpdateBatch:
    """Padded tensors of one generation batch. N sequences, prompt width P, completion T."""

    input_ids: Tensor  # [N, P + T] left-padded prompt, right-padded completion
    attention_mask: Tensor  # [N, P + T]
    completion_ids: Tensor  # [N, T]
    completion_mask: Tensor  # [N, T] 1 on real completion tokens
    advantages: Tensor  # [N]
    prompt_width: int  # P

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
        )


def build_batch(
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    advantages: list[float],
    pad_id: int,
    *,
    truncated: list[bool] | None = None,
) -> UpdateBatch:
    """Pad rollouts into an :class:`UpdateBatch`. ``truncated`` rows get an all-zero mask
    (TRL's ``mask_truncated_completions``)."""
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
        comp_mask[torch.tensor(truncated, dtype=torch.bool)] = 0.0
    adv = torch.tensor(advantages, dtype=torch.float32)
    return UpdateBatch(ids, attn, ids[:, P:], comp_mask, adv, P)


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
    temperature: float = 1.0,
    max_grad_norm: float = 1.0,
    on_step: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Run ``steps_per_generation * num_iterations`` optimizer steps on ``batch``.

    Rows must be ordered so that each of the ``steps_per_generation`` equal slices holds
    whole groups (the rollout stage writes prompt-major order). Returns per-step metrics.
    """
    if batch.size % steps_per_generation:
        raise ValueError(
            f"batch of {batch.size} rows does not split into {steps_per_generation} steps"
        )
    if beta > 0 and ref_model is None:
        raise ValueError("beta > 0 needs a reference model")
    device = model.device
    reuse = steps_per_generation > 1 or num_iterations > 1
    old_logp = batched_logprobs(model, batch, temperature=temperature) if reuse else None  # [N, T]
    ref_logp = batched_logprobs(ref_model, batch, temperature=temperature) if beta > 0 else None
    per_step = batch.size // steps_per_generation
    model.train()
    history = []
    for _ in range(num_iterations):
        for s in range(steps_per_generation):
            idx = torch.arange(s * per_step, (s + 1) * per_step)
            mb = batch.slice(idx)
            logp, entropy = completion_logprobs(
                model, mb, temperature=temperature, with_entropy=True
            )
            mask = mb.completion_mask.to(device)  # [n, T]
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
            )
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

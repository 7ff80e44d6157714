"""Per-token log-probs of a batch's completions under a policy: with grad for the loss
(:func:`completion_logprobs`), without grad in chunks for the old and reference log-probs
(:func:`batched_logprobs`). Used by the GRPO update (grpo_core/algorithm/update.py), which re-exports
them."""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_core.contracts.batch import UpdateBatch
from grpo_core.logprobs.model import model_logprobs
from grpo_core.logprobs.precision import Precision

LOGPROB_CHUNK = 64  # rows per no-grad forward of batched_logprobs without a token budget


def completion_logprobs(
    model,
    batch: UpdateBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    lm_head: str = "chunked",
) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs ``[n, T]`` of the completion tokens (and entropies), 0 on padding.

    Columns that are padding in every row are dropped before the forward; only completion
    positions go through the LM head (``grpo_core.logprobs.model``)."""
    T = batch.completion_ids.shape[1]
    b = batch.trimmed()
    P, t = b.prompt_width, b.completion_ids.shape[1]
    if P < 1:
        raise ValueError(
            "every prompt needs at least one token (the first completion token's context)"
        )
    device = model.device
    attn = b.attention_mask.to(device)  # [n, P + t]
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)  # [n, P + t]
    real = attn[:, P:].bool()  # [n, t]
    labels = torch.full_like(attn, -100)  # [n, P + t]: position P - 1 + j predicts token j
    labels[:, P - 1 : P - 1 + t] = torch.where(real, b.completion_ids.to(device), -100)
    logp, ent = model_logprobs(
        model,
        b.input_ids.to(device),
        attn,
        labels,
        position_ids=position_ids,
        temperature=temperature,
        with_entropy=with_entropy,
        lm_head=lm_head,
    )  # [n, P + t] each

    def completion(x: Tensor) -> Tensor:
        return torch.nn.functional.pad(x[:, P - 1 : P - 1 + t], (0, T - t))  # [n, T]

    return completion(logp), None if ent is None else completion(ent)


@torch.no_grad()
def batched_logprobs(
    model,
    batch: UpdateBatch,
    *,
    temperature: float,
    chunk: int = LOGPROB_CHUNK,
    max_tokens: int | None = None,
    lm_head: str = "chunked",
    precision: Precision | None = None,
) -> Tensor:
    """No-grad log-probs ``[N, T]`` of the whole batch, in chunks of at most ``max_tokens``
    padded tokens (else ``chunk`` sequences), in the model's current train/eval mode (the old
    log-probs must see the model as the loss does)."""
    parts = logprob_chunks(batch, chunk, max_tokens)
    precision = precision or Precision()
    out = []
    for part in parts:
        with precision.autocast():
            out.append(
                completion_logprobs(
                    model, batch.slice(part), temperature=temperature, lm_head=lm_head
                )[0]
            )
    return torch.cat(out, dim=0)


def logprob_chunks(batch: UpdateBatch, chunk: int, max_tokens: int | None) -> list[Tensor]:
    """Row indices of :func:`batched_logprobs`' forwards."""
    if max_tokens is not None:
        return batch.token_chunks(max_tokens)
    return [
        torch.arange(s, min(s + chunk, batch.size), device=batch.device)
        for s in range(0, batch.size, chunk)
    ]

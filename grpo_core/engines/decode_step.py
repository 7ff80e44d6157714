"""What one decode step does to the logits, shared by the hf engine's two decode loops (the
dynamic one, grpo_core/engines/generation.py, and the static one, static_decode.py): the
prompts' left padding, the repetition penalty, the logit filters, the next token, and the
prefill count. vLLM's order: repetition penalty -> temperature -> min-p -> top-k -> top-p."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from grpo_core.config.settings import SamplingParams


@dataclass
class DecodeBatch:
    """One micro-batch for a decode loop: its contexts (token ids), the sampling knobs, the
    pad and EOS ids, the seeded generator (None: unseeded), the stop-string matcher,
    ``stats`` to add the prefill and steps to, ``turn`` (the episodes' KV kept from their
    earlier turns: grpo_core/engines/turn_cache.py) and each row's own token budget."""

    prompts: list[list[int]]
    params: SamplingParams
    pad_id: int
    eos_ids: set[int]
    generator: torch.Generator | None
    stop_hits: Callable[[list[list[int]]], list[bool]] | None = None
    stats: dict | None = None
    turn: Any = None
    budgets: list[int] | None = None


def left_pad(
    prompts: list[list[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts left-padded to the longest: input ids and attention mask, [B, L] each."""
    L = max(len(p) for p in prompts)
    ids = [[pad_id] * (L - len(p)) + list(p) for p in prompts]
    attn = [[0] * (L - len(p)) + [1] * len(p) for p in prompts]
    return (
        torch.tensor(ids, dtype=torch.long, device=device),
        torch.tensor(attn, dtype=torch.long, device=device),
    )


def seen_tokens(vocab: int, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """[B, V] bool: the tokens each row's context holds, padding left out (the repetition
    penalty's record, updated as tokens are sampled).  ids, attn: [B, L]"""
    counts = torch.zeros((ids.shape[0], vocab), dtype=torch.long, device=ids.device)
    return counts.scatter_add_(1, ids, attn) > 0


def repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style penalty on seen tokens: positive logits / penalty, negative * penalty.
    logits: [B, V] float, seen: [B, V] bool"""
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)  # [B, V]
    return torch.where(seen, penalised, logits)


def filter_logits(
    logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0
) -> torch.Tensor:
    """Mask logits outside min-p / top-k / nucleus top-p with -inf.  logits: [B, V]"""
    if min_p > 0.0:
        probs = logits.softmax(-1)  # [B, V]
        keep = probs >= min_p * probs.amax(-1, keepdim=True)  # [B, V]
        logits = logits.masked_fill(~keep, float("-inf"))
    if top_k and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)  # [B, V]
        cum = sorted_logits.softmax(-1).cumsum(-1)  # [B, V]
        drop = cum - sorted_logits.softmax(-1) > top_p  # keep the token that crosses top_p
        drop = drop.scatter(-1, idx, drop)  # back to vocab order
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: the argmax (temperature 0) or a sample of the temperature-scaled,
    filtered distribution. Returns (logprobs [b, V] of that distribution, tokens [b])."""
    if params.temperature == 0:
        return logits.log_softmax(-1), logits.argmax(-1)
    scaled = filter_logits(logits / params.temperature, params.top_k, params.top_p, params.min_p)
    logprobs = scaled.log_softmax(-1)  # [b, V]
    return logprobs, torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)


def forward_takes(model, name: str) -> bool:
    """Whether the model's forward takes the keyword ``name`` (a peft wrapper passes it on
    to the model it wraps)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return name in inspect.signature(inner.forward).parameters


def keeps_last_logits(model) -> bool:
    """Whether the model's forward takes transformers' ``logits_to_keep``."""
    return forward_takes(model, "logits_to_keep")


def count_prefill(stats: dict | None, fed: torch.Tensor) -> None:
    """Add a prefill forward's tokens to ``stats``: ``prefill_tokens`` (real ones) and
    ``prefill_positions`` (padding included).  fed: [b, q] attention mask of the fed tokens"""
    if stats is not None:
        stats["prefill_tokens"] = stats.get("prefill_tokens", 0) + int(fed.sum())
        stats["prefill_positions"] = stats.get("prefill_positions", 0) + fed.numel()

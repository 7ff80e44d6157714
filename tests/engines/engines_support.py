"""Shared by the engine tests: prompts, and a slow reference for the sampling logprobs."""

from __future__ import annotations

import math

import torch

from grpo_core.contracts.text import encode_prompt
from grpo_core.engines.generation import Sample, SamplingParams


def prompts(tok, pairs) -> list[list[int]]:
    return [encode_prompt(tok, [{"role": "user", "content": f"{a}+{b}"}]) for a, b in pairs]


def _process(logits: list[float], seen: set[int], p: SamplingParams) -> list[float]:
    """One position's logits -> processed logprobs, one token at a time (vLLM's order:
    repetition penalty, temperature, min-p, top-k, top-p)."""
    x = list(logits)
    if p.repetition_penalty != 1.0:
        for t in seen:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    if p.temperature == 0:
        z = math.log(sum(math.exp(v) for v in x))
        return [v - z for v in x]
    x = [v / p.temperature for v in x]

    def probs(vals):
        m = max(vals)
        e = [math.exp(v - m) if v != -math.inf else 0.0 for v in vals]
        s = sum(e)
        return [v / s for v in e]

    if p.min_p > 0:
        pr = probs(x)
        x = [v if pr[i] >= p.min_p * max(pr) else -math.inf for i, v in enumerate(x)]
    if p.top_k:
        kth = sorted(x, reverse=True)[p.top_k - 1]
        x = [v if v >= kth else -math.inf for v in x]
    if p.top_p < 1.0:
        pr = probs(x)
        order = sorted(range(len(x)), key=lambda i: -x[i])
        cum = 0.0
        for i in order:
            if cum > p.top_p:  # mass before this token already exceeds top_p
                x[i] = -math.inf
            cum += pr[i]
    m = max(x)
    z = m + math.log(sum(math.exp(v - m) for v in x if v != -math.inf))
    return [v - z for v in x]


def reference_logprobs(model, prompt: list[int], s: Sample, params: SamplingParams) -> list[float]:
    """Logprob of each sampled token, recomputed from one full forward pass."""
    seq = torch.tensor([prompt + s.completion_ids])
    with torch.no_grad():
        logits = model(seq).logits[0].float()  # [P + C, V]
    P, out = len(prompt), []
    for j, t in enumerate(s.completion_ids):
        seen = set(prompt) | set(s.completion_ids[:j])
        out.append(_process(logits[P - 1 + j].tolist(), seen, params)[t])
    return out

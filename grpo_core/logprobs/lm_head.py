"""Per-token log-probs and entropies straight from the final hidden states, through the LM head,
without ever holding the logits of more than one chunk of positions.

The approach of Liger's fused linear cross-entropy (Hsu et al., 2024, arXiv:2410.10989): for
each chunk of ``chunk_size`` positions, ``z = (h @ W.T + b) / temperature`` is formed in float32,
reduced to ``log p(y) = z[y] - logsumexp(z)`` (and the entropy), and dropped. The backward pass
recomputes each chunk's logits and turns the softmax gradient (``grpo_core.logprobs.tokens.chunk_grad``)
into the gradients of the hidden states, ``g @ W``, and of the head, ``g.T @ h`` (and ``sum g``
for a bias), accumulated in float32. Peak memory is one ``[chunk, V]`` float32 buffer instead of
``[N, T, V]`` logits plus their float32 copies and gradient.

Autocast is off inside: under bf16 mixed precision the head's math stays float32 (the weights
are the float32 master weights). A head stored in bf16/fp16 multiplies in its own dtype (no
float32 copy of the whole matrix) and the softmax is float32. Tied embeddings need nothing
special: the head's weight is the embedding's Parameter, and autograd adds both gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_core.logprobs.tokens import chunk_grad, chunk_stats

DEFAULT_CHUNK_ELEMENTS = 1 << 23  # 32 MiB of float32 logits per chunk
LOW_PRECISION = (torch.bfloat16, torch.float16)


def _dtypes(hidden: Tensor, weight: Tensor) -> tuple[torch.dtype, torch.dtype]:
    """(matmul dtype, softmax dtype)."""
    soft = torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32
    return (weight.dtype if weight.dtype in LOW_PRECISION else soft), soft


def _logits(h: Tensor, weight: Tensor, bias: Tensor | None, mm, soft, temperature) -> Tensor:
    """Scaled logits ``[c, V]`` of hidden rows ``h[c, H]`` (a fresh tensor)."""
    z = h.to(mm) @ weight.to(mm).T  # [c, V]
    if bias is not None:
        z = z + bias.to(mm)
    z = z.to(soft)
    return z if temperature == 1.0 else z.div_(temperature)


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, chunk, with_entropy):
        mm, soft = _dtypes(hidden, weight)
        lab = labels.clamp(min=0)  # [M]
        M = lab.numel()
        logp = torch.empty(M, dtype=soft, device=hidden.device)  # [M]
        lse = torch.empty(M, dtype=soft, device=hidden.device)  # [M]
        ent = torch.zeros(M, dtype=soft, device=hidden.device)  # [M]
        with torch.autocast(hidden.device.type, enabled=False):
            for lo in range(0, M, chunk):
                z = _logits(hidden[lo : lo + chunk], weight, bias, mm, soft, temperature)
                lp, ls, h = chunk_stats(z, lab[lo : lo + chunk], with_entropy)
                logp[lo : lo + chunk], lse[lo : lo + chunk] = lp, ls
                if h is not None:
                    ent[lo : lo + chunk] = h
        valid = labels >= 0  # [M]
        logp = logp.masked_fill(~valid, 0.0)
        ctx.save_for_backward(hidden, weight, bias, lab, valid, lse)
        ctx.temperature, ctx.chunk, ctx.with_entropy = temperature, chunk, with_entropy
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, bias, lab, valid, lse = ctx.saved_tensors
        temp, chunk = ctx.temperature, ctx.chunk
        mm, soft = _dtypes(hidden, weight)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        g_lp = grad_logp.to(soft) * valid / temp  # [M]
        use_ent = ctx.with_entropy and grad_ent is not None
        g_h = grad_ent.to(soft) / temp if use_ent else None  # [M]
        grad_h = torch.empty_like(hidden) if need_h else None  # [M, H]
        grad_w = torch.zeros(weight.shape, dtype=soft, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=soft, device=weight.device) if need_b else None
        with torch.autocast(hidden.device.type, enabled=False):
            for lo in range(0, lab.numel(), chunk):
                h = hidden[lo : lo + chunk]  # [c, H]
                z = _logits(h, weight, bias, mm, soft, temp)  # [c, V]
                gh = None if g_h is None else g_h[lo : lo + chunk]
                g = chunk_grad(
                    z, lse[lo : lo + chunk], lab[lo : lo + chunk], g_lp[lo : lo + chunk], gh
                )
                if grad_b is not None:
                    grad_b += g.sum(0)
                g = g.to(mm)  # [c, V]
                if grad_h is not None:
                    grad_h[lo : lo + chunk] = g @ weight.to(mm)  # [c, H]
                if grad_w is not None:
                    if mm == soft:
                        grad_w.addmm_(g.T, h.to(mm))  # [V, H]
                    else:
                        grad_w += (g.T @ h.to(mm)).to(soft)
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None


def linear_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of each label under ``softmax((hidden @ weight.T + bias) / temperature)``.

    Args:
        hidden: ``[M, H]`` final hidden states of the positions that predict ``labels``.
        weight: ``[V, H]`` the LM head's weight; ``bias``: ``[V]`` or ``None``.
        labels: ``[M]`` long token ids; ids < 0 give log-prob 0 and no gradient.
        chunk_size: positions per chunk; ``None``: ``2**23 // V``.
        with_entropy: also return each position's entropy (differentiable).

    Returns:
        ``(logp[M], entropy[M] or None)`` in float32 (float64 for float64 inputs),
        differentiable w.r.t. hidden, weight and bias.
    """
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} does not match labels {tuple(labels.shape)}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"head weight {tuple(weight.shape)} does not take hidden size {hidden.shape[1]}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    chunk = chunk_size or max(1, DEFAULT_CHUNK_ELEMENTS // weight.shape[0])
    logp, ent = _LinearLogprobs.apply(
        hidden, weight, bias, labels, float(temperature), chunk, with_entropy
    )
    return logp, (ent if with_entropy else None)

"""Per-token log-probabilities and entropies without a float32 [B, T, V] log-softmax.

``log p(y_t) = z_t[y_t] - logsumexp(z_t)`` with ``z = logits / temperature``: a gather minus a
logsumexp, computed over chunks of ``chunk_size`` token positions so that at most one float32
``[chunk_size, V]`` buffer lives at a time (TRL's ``selective_log_softmax`` does the same row by
row for bf16). A custom autograd function keeps the memory bound in the backward pass too: it
saves only the logits (which exist anyway), the labels and the ``[B, T]`` logsumexp, and
recomputes the softmax chunk by chunk::

    d logp_t / d z_tj = 1[j = y_t] - p_tj
    d H_t / d z_tj    = -p_tj (z_tj - sum_k p_tk z_tk)        (H_t = lse_t - sum_k p_tk z_tk)

and both are divided by the temperature for the gradient with respect to the logits.
Labels below 0 (e.g. -100 padding) get log-prob 0 and no gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

DEFAULT_CHUNK_ELEMENTS = 1 << 22  # 16 MiB of float32 per chunk buffer


def _auto_chunk(vocab: int, chunk_size: int | None) -> int:
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        return chunk_size
    return max(1, DEFAULT_CHUNK_ELEMENTS // max(vocab, 1))


def _compute_dtype(logits: Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _scaled(rows: Tensor, dt: torch.dtype, temperature: float) -> Tensor:
    """``rows / temperature`` in the compute dtype (a view when nothing changes: never mutate)."""
    z = rows.to(dt)  # [c, V]
    return z if temperature == 1.0 else z / temperature


def chunk_stats(z: Tensor, labels: Tensor, with_entropy: bool):
    """Stats of one chunk: ``z[N, V]`` scaled logits, ``labels[N]`` (clamped >= 0)."""
    lse = torch.logsumexp(z, dim=-1)  # [N]
    logp = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse  # [N]
    if not with_entropy:
        return logp, lse, None
    p = (z - lse.unsqueeze(-1)).exp_()  # [N, V]
    entropy = lse - torch.einsum("nv,nv->n", p, z)  # [N]
    return logp, lse, entropy


def _row_blocks(logits: Tensor, chunk: int):
    """Yield ``(lo, hi, rows)``: ``rows[hi - lo, V]`` is a view of flat positions ``[lo, hi)``.

    Flattens ``[B, T, V]`` to ``[B*T, V]`` when that is a view; otherwise (e.g. the slice
    ``logits[:, P-1:-1]`` of a model's output) walks each sequence, so no copy is made.
    """
    B, T, V = logits.shape
    try:
        flat = logits.view(B * T, V)  # [B*T, V]
    except RuntimeError:
        flat = None
    if flat is not None:
        for lo in range(0, B * T, chunk):
            yield lo, min(lo + chunk, B * T), flat[lo : lo + chunk]
        return
    for b in range(B):
        for t in range(0, T, chunk):
            yield b * T + t, b * T + min(t + chunk, T), logits[b, t : t + chunk]  # [c, V]


def chunk_grad(z: Tensor, lse: Tensor, lab: Tensor, g_lp: Tensor, g_h: Tensor | None) -> Tensor:
    """Gradient ``[c, V]`` w.r.t. the unscaled logits of one chunk: ``z[c, V]`` scaled logits,
    ``lse[c]`` their logsumexp, ``lab[c]`` labels (clamped), ``g_lp[c]`` / ``g_h[c]`` the
    upstream gradients of log-prob and entropy, already divided by the temperature."""
    p = (z - lse.unsqueeze(-1)).exp_()  # [c, V] softmax, recomputed
    if g_h is None:
        g = p.mul_(-g_lp.unsqueeze(-1))  # [c, V] = -p * g_lp
    else:
        mean_z = torch.einsum("nv,nv->n", p, z).unsqueeze(-1)  # [c, 1]
        g = (z - mean_z).mul_(-g_h.unsqueeze(-1))  # [c, V]
        g.sub_(g_lp.unsqueeze(-1)).mul_(p)  # [c, V] = -p (g_lp + g_h (z - E z))
    return g.scatter_add_(-1, lab.unsqueeze(-1), g_lp.unsqueeze(-1))


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, temperature, chunk, with_entropy):
        dt = _compute_dtype(logits)
        lab = labels.reshape(-1)  # [B*T]
        valid = lab >= 0  # [B*T]
        lab = lab.clamp(min=0)
        n = lab.numel()
        logp = torch.empty(n, dtype=dt, device=logits.device)  # [B*T]
        lse = torch.empty(n, dtype=dt, device=logits.device)  # [B*T]
        ent = torch.zeros(n, dtype=dt, device=logits.device)  # [B*T]
        for lo, hi, rows in _row_blocks(logits, chunk):
            z = _scaled(rows, dt, temperature)  # [c, V] float32 (or float64)
            lp, ls, h = chunk_stats(z, lab[lo:hi], with_entropy)
            logp[lo:hi] = lp
            lse[lo:hi] = ls
            if h is not None:
                ent[lo:hi] = h
        logp = logp.masked_fill(~valid, 0.0)
        ctx.save_for_backward(logits, lab, valid, lse)
        ctx.temperature, ctx.chunk, ctx.with_entropy = temperature, chunk, with_entropy
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return logp.view(labels.shape), ent.view(labels.shape)

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        logits, lab, valid, lse = ctx.saved_tensors
        temp, chunk, dt = ctx.temperature, ctx.chunk, lse.dtype
        B, T, V = logits.shape
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        g_lp = grad_logp.reshape(-1).to(dt) * valid / temp  # [B*T]
        use_ent = ctx.with_entropy and grad_ent is not None
        g_h = grad_ent.reshape(-1).to(dt) / temp if use_ent else None  # [B*T]
        grad = torch.empty((B, T, V), dtype=logits.dtype, device=logits.device)  # [B, T, V]
        for lo, hi, rows in _row_blocks(logits, chunk):
            z = _scaled(rows, dt, temp)  # [c, V]
            gh = None if g_h is None else g_h[lo:hi]
            g = chunk_grad(z, lse[lo:hi], lab[lo:hi], g_lp[lo:hi], gh)  # [c, V]
            grad.view(B * T, V)[lo:hi] = g  # cast to the logits' dtype
        return grad, None, None, None, None


def token_logprobs(
    logits: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probability of each label token (and the entropy of each position's distribution).

    Args:
        logits: ``[B, T, V]`` any float dtype, position t predicts ``labels[:, t]``.
        labels: ``[B, T]`` long token ids; ids < 0 give log-prob 0.
        temperature: the sampling temperature (logits are divided by it, as in TRL).
        chunk_size: token positions per float32 chunk; ``None`` picks ``2**22 // V``.
        with_entropy: also return the per-position entropy ``[B, T]`` (differentiable).

    Returns:
        ``(logp[B, T], entropy[B, T] or None)`` in float32 (float64 for float64 logits),
        differentiable w.r.t. logits.
    """
    if logits.dim() != 3 or logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    chunk = _auto_chunk(logits.shape[-1], chunk_size)
    logp, ent = _TokenLogprobs.apply(logits, labels, float(temperature), chunk, with_entropy)
    return logp, (ent if with_entropy else None)


def naive_token_logprobs(
    logits: Tensor, labels: Tensor, *, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Reference: full float32 ``log_softmax`` over ``[B, T, V]`` (for tests and benchmarks)."""
    logps = torch.log_softmax(logits.to(_compute_dtype(logits)) / temperature, dim=-1)  # [B, T, V]
    valid = labels >= 0  # [B, T]
    lp = logps.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [B, T]
    lp = lp.masked_fill(~valid, 0.0)
    ent = -(logps.exp() * logps).sum(-1) if with_entropy else None  # [B, T]
    return lp, ent

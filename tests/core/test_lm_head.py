"""grpo_core.logprobs.lm_head: log-probs through the LM head in chunks equal the full-logits path, in
values and in the gradients of the hidden states, the head's weight and its bias."""

import pytest
import torch

from grpo_core.logprobs.lm_head import linear_token_logprobs
from grpo_core.logprobs.tokens import naive_token_logprobs


def naive_linear_token_logprobs(hidden, weight, labels, *, bias=None, **kw):
    """Reference: all logits at once, then a full log-softmax."""
    logits = torch.nn.functional.linear(hidden, weight, bias)  # [M, V]
    lp, ent = naive_token_logprobs(logits.unsqueeze(0), labels.unsqueeze(0), **kw)
    return lp[0], None if ent is None else ent[0]


def inputs(M, H, V, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(M, H, generator=g, dtype=dtype)
    weight = torch.randn(V, H, generator=g, dtype=dtype) / H**0.5 * 3
    bias = torch.randn(V, generator=g, dtype=dtype)
    labels = torch.randint(0, V, (M,), generator=g)
    labels[M // 2] = -100  # ignored: log-prob 0, no gradient through the label
    return hidden, weight, bias, labels


def run(fn, hidden, weight, bias, labels, seed, **kw):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    b = None if bias is None else bias.clone().requires_grad_()
    lp, ent = fn(h, w, labels, bias=b, with_entropy=True, **kw)
    g = torch.Generator().manual_seed(seed + 7)
    up_lp = torch.randn(lp.shape, generator=g, dtype=torch.float64).to(lp.dtype)
    up_h = torch.randn(lp.shape, generator=g, dtype=torch.float64).to(lp.dtype)
    ((lp * up_lp).sum() + (ent * up_h).sum()).backward()
    return lp, ent, h.grad, w.grad, None if b is None else b.grad


@pytest.mark.parametrize("M,H,V", [(1, 3, 2), (17, 8, 31), (40, 16, 257)])
@pytest.mark.parametrize("chunk", [1, 6, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_head_equals_full_logits(M, H, V, chunk, temperature, with_bias):
    # float32 chunked head vs float64 full logits (ground truth), values and all gradients
    hidden, weight, bias, labels = inputs(M, H, V, seed=M + V)
    bias = bias if with_bias else None
    got = run(
        linear_token_logprobs,
        hidden.float(),
        weight.float(),
        None if bias is None else bias.float(),
        labels,
        seed=0,
        temperature=temperature,
        chunk_size=chunk,
    )
    want = run(
        naive_linear_token_logprobs, hidden, weight, bias, labels, 0, temperature=temperature
    )
    for a, b in zip(got, want, strict=True):
        if b is None:
            assert a is None
            continue
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b.float(), rtol=1e-4, atol=1e-4)
    assert got[0][M // 2] == 0.0


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_gradcheck_float64(with_entropy, temperature):
    hidden, weight, bias, labels = inputs(5, 4, 7, seed=3)
    args = [x.requires_grad_() for x in (hidden, weight, bias)]

    def f(h, w, b):
        lp, ent = linear_token_logprobs(
            h, w, labels, bias=b, temperature=temperature, chunk_size=2, with_entropy=with_entropy
        )
        return (lp, ent) if with_entropy else lp

    assert torch.autograd.gradcheck(f, args)


def test_frozen_head_gets_no_gradient_and_hidden_still_does():
    hidden, weight, _, labels = inputs(9, 4, 11, seed=1, dtype=torch.float32)
    h = hidden.requires_grad_()
    lp, _ = linear_token_logprobs(h, weight, labels, chunk_size=4)
    lp.sum().backward()
    assert weight.grad is None and h.grad is not None and torch.isfinite(h.grad).all()


def test_float32_under_bf16_autocast():
    # mixed precision: the head's math stays float32 whatever autocast says
    hidden, weight, _, labels = inputs(12, 8, 50, seed=2, dtype=torch.float32)
    plain, _ = linear_token_logprobs(hidden, weight, labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto, _ = linear_token_logprobs(hidden, weight, labels)
    assert auto.dtype == torch.float32
    torch.testing.assert_close(auto, plain)


def test_bf16_head_multiplies_in_bf16_with_float32_softmax():
    hidden, weight, _, labels = inputs(12, 8, 50, seed=4, dtype=torch.float32)
    ref, _ = naive_linear_token_logprobs(hidden, weight, labels)
    w = weight.bfloat16().requires_grad_()
    h = hidden.bfloat16().requires_grad_()
    lp, _ = linear_token_logprobs(h, w, labels, chunk_size=5)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, ref, rtol=0.05, atol=0.1)
    lp.sum().backward()
    assert w.grad.dtype == torch.bfloat16 and h.grad.dtype == torch.bfloat16


def test_errors():
    hidden, weight, _, labels = inputs(4, 3, 5, seed=0, dtype=torch.float32)
    with pytest.raises(ValueError, match="temperature"):
        linear_token_logprobs(hidden, weight, labels, temperature=0.0)
    with pytest.raises(ValueError, match="does not take hidden size"):
        linear_token_logprobs(hidden, weight[:, :2], labels)
    with pytest.raises(ValueError, match="does not match labels"):
        linear_token_logprobs(hidden, weight, labels[:2])

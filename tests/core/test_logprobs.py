"""grpo_core.logprobs.tokens: chunked gather-minus-logsumexp equals the full log-softmax."""

import pytest
import torch

from grpo_core.logprobs.tokens import naive_token_logprobs, token_logprobs


def batch(B, T, V, seed, dtype=torch.float32, ignore=True):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=g) * 3).to(dtype)
    labels = torch.randint(0, V, (B, T), generator=g)
    if ignore and T > 1:
        labels[0, -1] = -100
    return logits, labels


def test_hand_value():
    # logits [0, ln 3] -> p = [1/4, 3/4]; label 1 -> log 0.75; entropy = -(.25 ln .25 + .75 ln .75)
    logits = torch.tensor([[[0.0, torch.log(torch.tensor(3.0)).item()]]])
    lp, ent = token_logprobs(logits, torch.tensor([[1]]), with_entropy=True)
    assert lp.item() == pytest.approx(torch.log(torch.tensor(0.75)).item(), abs=1e-6)
    h = -(0.25 * torch.log(torch.tensor(0.25)) + 0.75 * torch.log(torch.tensor(0.75)))
    assert ent.item() == pytest.approx(h.item(), abs=1e-6)


@pytest.mark.parametrize("B,T,V", [(1, 1, 2), (2, 7, 11), (3, 16, 50), (4, 33, 257)])
@pytest.mark.parametrize("chunk", [1, 5, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("seed", [0, 1])
def test_chunked_equals_naive_values_and_grads(B, T, V, chunk, temperature, seed):
    # float32 chunked vs the full log-softmax in float64 (ground truth for both)
    logits, labels = batch(B, T, V, seed)
    a = logits.clone().requires_grad_()
    b = logits.double().requires_grad_()
    lp, ent = token_logprobs(
        a, labels, temperature=temperature, chunk_size=chunk, with_entropy=True
    )
    lp_ref, ent_ref = naive_token_logprobs(b, labels, temperature=temperature, with_entropy=True)
    torch.testing.assert_close(lp, lp_ref.float(), rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(ent, ent_ref.float(), rtol=1e-5, atol=2e-5)
    gen = torch.Generator().manual_seed(seed + 100)
    w1, w2 = torch.randn(B, T, generator=gen), torch.randn(B, T, generator=gen)
    ((lp * w1).sum() + (ent * w2).sum()).backward()
    ((lp_ref * w1.double()).sum() + (ent_ref * w2.double()).sum()).backward()
    torch.testing.assert_close(a.grad, b.grad.float(), rtol=1e-4, atol=1e-4)


def test_float32_naive_agrees():
    logits, labels = batch(2, 9, 40, seed=0)
    lp, _ = token_logprobs(logits, labels)
    torch.testing.assert_close(lp, naive_token_logprobs(logits, labels)[0])


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_gradcheck_float64(with_entropy, temperature):
    logits, labels = batch(2, 4, 6, seed=3, dtype=torch.float64)
    logits.requires_grad_()

    def f(x):
        lp, ent = token_logprobs(
            x, labels, temperature=temperature, chunk_size=3, with_entropy=with_entropy
        )
        return (lp, ent) if with_entropy else lp

    assert torch.autograd.gradcheck(f, (logits,))


def test_ignore_index_and_dtypes():
    logits, labels = batch(2, 5, 9, seed=4, dtype=torch.bfloat16)
    logits.requires_grad_()
    lp, ent = token_logprobs(logits, labels)
    assert lp.dtype == torch.float32 and ent is None
    assert lp[0, -1] == 0.0
    lp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    assert torch.count_nonzero(logits.grad[0, -1]) == 0
    ref, _ = naive_token_logprobs(logits.detach(), labels)
    torch.testing.assert_close(lp, ref)


def test_only_entropy_gradient_and_errors():
    logits, labels = batch(1, 3, 5, seed=5)
    logits.requires_grad_()
    _, ent = token_logprobs(logits, labels, with_entropy=True)
    ent.sum().backward()
    assert torch.isfinite(logits.grad).all()
    with pytest.raises(ValueError, match="match"):
        token_logprobs(logits, labels[:, :2])
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, labels, temperature=0.0)


def test_sliced_logits_of_a_model_output():
    # update.py passes logits[:, P-1:-1] of the full [B, P+T, V] output: not viewable as [B*T, V]
    full, _ = batch(3, 10, 13, seed=6)
    labels = torch.randint(0, 13, (3, 6))
    x = full.clone().requires_grad_()
    y = full.clone().requires_grad_()
    lp, ent = token_logprobs(x[:, 3:-1], labels, chunk_size=4, with_entropy=True)
    lp_ref, ent_ref = naive_token_logprobs(y[:, 3:-1], labels, with_entropy=True)
    torch.testing.assert_close(lp, lp_ref)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-5, atol=2e-5)
    (lp.sum() + ent.sum()).backward()
    (lp_ref.sum() + ent_ref.sum()).backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-4, atol=2e-5)
    assert torch.count_nonzero(x.grad[:, :3]) == 0

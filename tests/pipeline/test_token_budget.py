"""Gradient accumulation at the token-budget micro-batching (``rl.max_tokens_per_microbatch``):
every logical micro-batch (TRL's unit) runs in physical chunks of at most the budget's padded
tokens, each divided by the logical micro-batch's normaliser, so one optimizer step's gradient,
the weights after it and the step's metrics equal the unsplit ones, for every ``loss_type``."""

import copy

import pytest
import torch

from grpo_core.algorithm.update import build_batch, grpo_update
from grpo_core.config.loss import LossConfig, UpdateConfig

PROMPTS = [[3, 12, 13, 4], [3, 12, 13, 4], [3, 14, 4], [3, 14, 4]] * 2 + [[3, 15, 16, 12, 4]] * 4
COMPLETIONS = [
    [5, 12, 6, 7, 13, 8, 2],
    [5, 13, 6, 7, 12, 8, 2],
    [5, 12, 12, 6, 2],
    [5, 6, 7, 8, 2],
    [5, 12, 6, 2],
    [5, 13, 6, 7, 12, 8, 12, 6, 2],
    [5, 6, 2],
    [5, 7, 8, 12, 13, 2],
    [5, 6, 7, 2],
    [5, 13, 13, 6, 7, 8, 12, 2],
    [5, 2],
    [5, 12, 13, 6, 7, 2],
]
ADV = [1.0, -1.0, 0.5, -0.5, 1.2, -1.2, 0.3, -0.3, 0.8, -0.8, 0.1, -0.1]
GROUPS = [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
LR = 1e-3
BUDGET = 24  # padded tokens: one to three rows per physical chunk


def _batch():
    return build_batch(PROMPTS, COMPLETIONS, ADV, 0, group_ids=GROUPS)


def _step(model, cfg, ref=None, lr=LR):
    """The update's optimizer steps (SGD); returns the gradients they applied, the weights
    after them and the steps' metrics. SGD, not AdamW: AdamW's first step is about
    lr * sign(g), so float32 rounding of a gradient near its eps moves a weight by up to
    1e-2 lr; SGD keeps the two runs' weights as close as their gradients."""
    model = copy.deepcopy(model)
    seen = []

    class Capture(torch.optim.SGD):
        def step(self, closure=None):
            seen.append(torch.cat([p.grad.flatten() for p in model.parameters()]).clone())
            return super().step(closure)

    hist = grpo_update(
        model, Capture(model.parameters(), lr=lr), None, _batch(), cfg, ref_model=ref
    )
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    return seen, weights, hist


def _assert_same(off, on):
    (g_off, w_off, h_off), (g_on, w_on, h_on) = off, on
    assert len(g_off) == len(g_on) >= 1
    for a, b in zip(g_off, g_on, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=2e-6)
    torch.testing.assert_close(w_on, w_off, rtol=0, atol=LR * 1e-4)
    assert h_on[0].keys() == h_off[0].keys()
    for key in h_off[0]:
        assert h_on[0][key] == pytest.approx(h_off[0][key], rel=1e-4, abs=1e-6), key


def _config(budget, **kw):
    loss = kw.pop("loss")
    return UpdateConfig(
        loss=loss,
        steps_per_generation=2,
        gradient_accumulation_steps=2,  # one optimizer step over two logical micro-batches
        max_grad_norm=1e9,  # no clipping: compare raw gradients
        max_tokens_per_microbatch=budget,
        **kw,
    )


def test_the_budget_really_splits_each_micro_batch():
    batch = _batch()
    for idx in batch.step_slices(2):
        mb = batch.slice(idx)
        chunks = mb.token_chunks(BUDGET)
        assert len(chunks) >= 3
        assert torch.equal(torch.cat(chunks), torch.arange(mb.size))
        for c in chunks:
            t = mb.slice(c).trimmed()
            assert c.numel() == 1 or t.input_ids.numel() <= BUDGET


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_budget_on_equals_budget_off(tiny_model, loss_type):
    model, _ = tiny_model
    loss = LossConfig(loss_type=loss_type, max_completion_length=9)
    _assert_same(_step(model, _config(None, loss=loss)), _step(model, _config(BUDGET, loss=loss)))


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_budget_with_old_and_reference_passes_and_entropy_mask(tiny_model, loss_type):
    # mu = 2 (old log-probs from a no-grad pass in chunks), beta > 0 (reference pass in chunks),
    # the top-entropy quantile over the whole logical micro-batch, GSPO's sequence ratio
    model, _ = tiny_model
    # the untrained model's next-token distributions are all near uniform: their entropies
    # differ by float32 noise, so which tokens are in the top half would depend on the
    # chunk's padding; noised weights spread them apart, and a small learning rate keeps the
    # second step's ratios away from the clip boundary
    model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    ref = copy.deepcopy(model)
    for level in ("token", "sequence"):
        loss = LossConfig(
            loss_type=loss_type, max_completion_length=9, beta=0.1, importance_sampling_level=level
        )
        kw = dict(loss=loss, num_iterations=2, top_entropy_quantile=0.5, temperature=0.8)
        _assert_same(
            _step(model, _config(None, **kw), ref, lr=1e-5),
            _step(model, _config(BUDGET, **kw), ref, lr=1e-5),
        )


def test_a_row_longer_than_the_budget_runs_alone(tiny_model):
    model, _ = tiny_model
    loss = LossConfig(loss_type="dapo")
    _assert_same(_step(model, _config(None, loss=loss)), _step(model, _config(1, loss=loss)))


def test_budget_must_be_positive():
    with pytest.raises(ValueError, match="max_tokens_per_microbatch"):
        UpdateConfig(max_tokens_per_microbatch=0)

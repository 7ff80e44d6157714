import copy

import pytest
import torch

from grpo_core.demo.task import make_splits
from grpo_core.loss_config import LossConfig, UpdateConfig
from grpo_core.sft import collate, encode_examples, train_sft
from grpo_core.update import batched_logprobs, build_batch, grpo_update


def test_collate_masks_prompt_and_padding(tiny_model):
    _, tok = tiny_model
    rows = make_splits(0, n_sft=2, n_rl=1, n_dev=1, n_eval=1).sft
    pairs = encode_examples(tok, rows)
    ids, attn, labels = collate(pairs, tok.pad_token_id)
    for i, (p, c) in enumerate(pairs):
        assert (labels[i, : len(p)] == -100).all()
        assert labels[i, len(p) : len(p) + len(c)].tolist() == c
        assert (labels[i, len(p) + len(c) :] == -100).all()
        assert attn[i].sum() == len(p) + len(c)
        assert c[-1] == tok.eos_token_id


def test_sft_reduces_completion_loss(tiny_model):
    model, tok = tiny_model
    rows = make_splits(0, n_sft=64, n_rl=1, n_dev=1, n_eval=1).sft
    res = train_sft(model, tok, rows, max_steps=40, batch_size=16, learning_rate=3e-3, seed=0)
    assert res.steps == 40
    first = sum(h["loss"] for h in res.history[:5]) / 5
    last = sum(h["loss"] for h in res.history[-5:]) / 5
    assert last < 0.7 * first


def test_sft_stops_at_dev_target(tiny_model):
    model, tok = tiny_model
    rows = make_splits(0, n_sft=8, n_rl=1, n_dev=1, n_eval=1).sft
    calls = iter([0.1, 0.2, 0.9, 0.95])
    res = train_sft(
        model,
        tok,
        rows,
        max_steps=100,
        batch_size=4,
        learning_rate=1e-3,
        dev_eval=lambda: next(calls),
        target_accuracy=0.5,
        eval_every=5,
    )
    assert res.stopped_early and res.steps == 15
    assert [d["accuracy"] for d in res.dev_history] == [0.1, 0.2, 0.9]


def _batch(tok, advantages):
    prompts = [[3, 12, 13, 4]] * len(advantages)
    completions = [
        [5, 12, 6, 7, 13, 8, 2],
        [5, 13, 6, 7, 12, 8, 2],
        [5, 12, 12, 6, 2],
        [5, 6, 7, 8, 2],
    ]
    return build_batch(prompts, completions[: len(advantages)], advantages, tok.pad_token_id)


def test_update_moves_probability_towards_positive_advantage(tiny_model):
    model, tok = tiny_model
    batch = _batch(tok, [1.0, -1.0, 1.0, -1.0])
    before = batched_logprobs(model, batch, temperature=1.0)
    seq_before = (before * batch.completion_mask).sum(-1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    cfg = UpdateConfig(steps_per_generation=1, num_iterations=3)
    hist = grpo_update(model, opt, None, batch, cfg)
    after = batched_logprobs(model, batch, temperature=1.0)
    seq_after = (after * batch.completion_mask).sum(-1)
    delta = seq_after - seq_before
    assert delta[0] > 0 and delta[2] > 0
    assert delta[1] < 0 and delta[3] < 0
    assert len(hist) == 3
    assert {
        "loss",
        "entropy",
        "grad_norm",
        "learning_rate",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
    } <= set(hist[0])


def test_zero_advantages_leave_weights_unchanged(tiny_model):
    model, tok = tiny_model
    ref = copy.deepcopy(model.state_dict())
    batch = _batch(tok, [0.0, 0.0, 0.0, 0.0])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    grpo_update(model, opt, None, batch, UpdateConfig(steps_per_generation=2))
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[k]), k


def test_update_never_splits_a_group_and_refuses_interleaved_ones(tiny_model):
    model, tok = tiny_model
    prompts, completions = [[3, 12, 13, 4]] * 6, [[5, 12, 6, 2], [5, 13, 2], [5, 6, 7, 2]] * 2
    adv = [1.0, -1.0, 0.5, -0.5, 0.3, -0.3]
    # three groups of two: two micro-batches hold whole groups, [0, 1, 2, 3] and [4, 5]
    batch = build_batch(prompts, completions, adv, tok.pad_token_id, group_ids=[0, 0, 1, 1, 2, 2])
    assert [s.tolist() for s in batch.step_slices(2)] == [[0, 1, 2, 3], [4, 5]]
    opt = torch.optim.AdamW(model.parameters())
    assert len(grpo_update(model, opt, None, batch, UpdateConfig(steps_per_generation=2))) == 2
    # a group whose rows are not contiguous would be trained in two steps: refused
    mixed = build_batch(prompts, completions, adv, tok.pad_token_id, group_ids=[0, 1, 0, 1, 2, 2])
    with pytest.raises(ValueError, match="contiguous"):
        grpo_update(model, opt, None, mixed, UpdateConfig(steps_per_generation=2))
    # without group ids every row is its own group: 3 rows do not make 2 equal steps
    with pytest.raises(ValueError, match="does not split"):
        _batch(tok, [1.0, -1.0, 0.5]).step_slices(2)
    with pytest.raises(ValueError, match="reference model"):
        grpo_update(
            model, opt, None, _batch(tok, [1.0, -1.0]), UpdateConfig(loss=LossConfig(beta=0.1))
        )


def test_kl_metric_with_reference(tiny_model):
    model, tok = tiny_model
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = _batch(tok, [1.0, -1.0, 1.0, -1.0])
    cfg = UpdateConfig(steps_per_generation=1, num_iterations=3, loss=LossConfig(beta=0.1))
    hist = grpo_update(model, opt, None, batch, cfg, ref_model=ref)
    assert hist[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # identical weights at the first step
    assert hist[-1]["kl"] > 0

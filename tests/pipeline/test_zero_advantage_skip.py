"""``skip_zero_advantage``: completions whose loss is zero whatever the weights (advantage 0
with beta 0, or no token that counts) skip the forward and backward passes, and the update is
the one of the full batch: same gradients, weights and loss metrics, for every ``loss_type``,
including an optimizer step whose rows are all skipped (it still steps, on zero gradients)."""

import copy

import pytest
import torch

from grpo_core.algorithm.update import build_batch, grpo_update, live_rows
from grpo_core.config.loss import LossConfig, UpdateConfig

PROMPTS = [[3, 12, 13, 4]] * 4 + [[3, 14, 4]] * 4 + [[3, 15, 16, 12, 4]] * 4 + [[3, 13, 4]] * 4
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
    [5, 7, 2],
    [5, 12, 6, 7, 8, 2],
    [5, 13, 2],
    [5, 6, 6, 2],
]
# groups of 2: 0 and 1 carry signal, 2..5 have none (all-equal rewards), 6 and 7 do again, so
# with 4 micro-batches of 2 groups the second and third micro-batches are all zero
ADV = [1.0, -1.0, 0.5, -0.5] + [0.0] * 8 + [0.8, -0.8, 0.0, 0.0]
GROUPS = [i // 2 for i in range(16)]
LR = 1e-3


def _batch():
    return build_batch(PROMPTS, COMPLETIONS, ADV, 0, group_ids=GROUPS)


def _run(model, cfg, opt="sgd"):
    """The update's optimizer steps; returns the gradients each step applied, the weights
    after them, the steps' metrics and the number of rows that went through the model."""
    model = copy.deepcopy(model)
    seen, rows = [], []
    embed = model.get_input_embeddings()  # one call per forward pass, on all its rows
    embed.register_forward_hook(lambda m, args, out: rows.append(out.shape[0]))
    base = torch.optim.SGD if opt == "sgd" else torch.optim.AdamW

    class Capture(base):
        def step(self, closure=None):
            seen.append(torch.cat([p.grad.flatten() for p in model.parameters()]).clone())
            return super().step(closure)

    ref = copy.deepcopy(model) if cfg.loss.beta > 0 else None
    hist = grpo_update(
        model, Capture(model.parameters(), lr=LR), None, _batch(), cfg, ref_model=ref
    )
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    return seen, weights, hist, sum(rows)


def _config(skip, loss_type="dapo", **kw):
    return UpdateConfig(
        loss=LossConfig(loss_type=loss_type, max_completion_length=9, **kw.pop("loss", {})),
        steps_per_generation=4,
        gradient_accumulation_steps=1,  # 4 optimizer steps, each on 2 groups
        num_iterations=2,  # a second pass: the ratio moves off 1 and old log-probs are needed
        max_grad_norm=1e9,  # no clipping: compare raw gradients
        old_logprobs="recompute",
        skip_zero_advantage=skip,
        **kw,
    )


def _assert_same_update(off, on):
    (g_off, w_off, h_off, _), (g_on, w_on, h_on, _) = off, on
    assert len(g_off) == len(g_on) == 8
    for a, b in zip(g_off, g_on, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=2e-6)
    torch.testing.assert_close(w_on, w_off, rtol=0, atol=LR * 1e-3)
    for step_off, step_on in zip(h_off, h_on, strict=True):
        keys = ("loss", "policy_loss", "clip_ratio/low_mean", "clip_ratio/high_mean", "entropy")
        for key in (*keys, "clip_ratio/region_mean"):
            assert step_on[key] == pytest.approx(step_off[key], rel=1e-4, abs=1e-6), key


def test_the_batch_has_zero_rows_and_whole_zero_micro_batches():
    batch = _batch()
    live = live_rows(batch)
    assert live.tolist() == [True] * 4 + [False] * 8 + [True, True, False, False]
    assert [bool(live[i].any()) for i in batch.step_slices(4)] == [True, False, False, True]


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_skipping_gives_the_full_batch_update(tiny_model, loss_type):
    model, _ = tiny_model
    off = _run(model, _config(False, loss_type))
    on = _run(model, _config(True, loss_type))
    _assert_same_update(off, on)
    # 10 of the 16 rows skip the old log-prob pass; in the 2 loss passes they still have a
    # no-grad forward, for the whole batch's entropy
    assert off[3] - on[3] == 10


def test_gspo_clip_ratios_and_entropy_are_the_full_batch_ones(tiny_model):
    """GSPO's ratios are per sequence: the clip ratios of a skip are rescaled by the share of
    rows, not of tokens (0.5217 against 0.5 before)."""
    model, _ = tiny_model
    loss = {"importance_sampling_level": "sequence", "epsilon": 1e-3}  # clips often
    off = _run(model, _config(False, "grpo", loss=loss))
    on = _run(model, _config(True, "grpo", loss=loss))
    _assert_same_update(off, on)
    assert any(step["clip_ratio/region_mean"] > 0 for step in on[2])


def test_a_step_whose_rows_are_all_skipped_still_steps_the_optimizer(tiny_model):
    """AdamW moves the weights on a zero gradient (its moments, weight decay); the skipped
    step must do so too."""
    model, _ = tiny_model
    off = _run(model, _config(False), opt="adamw")
    on = _run(model, _config(True), opt="adamw")
    for a, b in zip(off[0], on[0], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=2e-6)
    assert not off[0][1].any() and not on[0][1].any()  # step 2 had only zero rows
    torch.testing.assert_close(on[1], off[1], rtol=0, atol=LR * 1e-2)


def test_rows_without_a_token_that_counts_are_skipped_too(tiny_model):
    """A completion whose mask is all zero (e.g. a truncated one, masked) has no loss."""
    model, _ = tiny_model
    batch = _batch()
    batch.completion_mask[0] = 0
    assert not bool(live_rows(batch)[0])


def test_kl_or_an_entropy_quantile_turns_skipping_off(tiny_model):
    """With beta > 0 a zero-advantage row still has a KL term; with a top-entropy quantile the
    threshold is over every row: nothing is skipped."""
    model, _ = tiny_model
    cfg = _config(True, top_entropy_quantile=0.5)
    assert _run(model, cfg)[3] == _run(model, _config(False, top_entropy_quantile=0.5))[3]
    kl = {"beta": 0.1}
    assert _run(model, _config(True, loss=kl))[3] == _run(model, _config(False, loss=kl))[3]


def test_the_update_task_reports_a_last_step_whose_rows_were_all_skipped(tiny_checkpoint, tmp_path):
    """The second (last) optimizer step has only a group without reward variance: it steps
    on zero gradients, has loss 0 and the entropy of its rows, and the task logs it."""
    from test_score_filters import _rollouts, _weights

    from grpo_core.config.stages import RLConfig
    from tasks.score import score_file
    from tasks.update import UpdateRequest, update

    groups = [[(1.0, 0.0, 4), (0.0, 0.0, 5)], [(1.0, 0.0, 4), (1.0, 0.0, 6)]]
    scored = tmp_path / "scored.parquet"
    score_file(_rollouts(tmp_path / "r.parquet", groups), str(scored), _weights(1.0, 0.0))
    rl = RLConfig(prompts_per_iteration=2, num_generations=2, steps_per_generation=2)
    up = update.fn(
        UpdateRequest(str(tiny_checkpoint), str(scored), str(tmp_path / "ckpt"), rl, stage="rl_1"),
        0,
    )
    assert len(up.history) == 2
    assert "entropy" in up.history[0] and up.history[1]["entropy"] > 0
    assert up.history[1]["loss"] == 0.0 and up.history[1]["clip_ratio/region_mean"] == 0.0
    assert (tmp_path / "ckpt" / "model.safetensors").exists()

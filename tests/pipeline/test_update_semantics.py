"""What one GRPO update means, on a real tiny model (regressions of issue 10).

- step 0's ratio is 1: old log-probs see the model as the loss's forward does, and dropout
  is off by default (TRL's ``disable_dropout``);
- TRL's meaning of ``steps_per_generation``, ``gradient_accumulation_steps`` and each
  ``loss_type``'s normaliser.
"""

import copy

import pytest
import torch

from grpo_core.algorithm.update import build_batch, grpo_update
from grpo_core.config.loss import LossConfig, UpdateConfig

PROMPTS = [[3, 12, 13, 4]] * 8
COMPLETIONS = [
    [5, 12, 6, 7, 13, 8, 2],
    [5, 13, 6, 7, 12, 8, 2],
    [5, 12, 12, 6, 2],
    [5, 6, 7, 8, 2],
    [5, 12, 6, 2],
    [5, 13, 6, 7, 12, 8, 12, 6, 2],
    [5, 6, 2],
    [5, 7, 8, 12, 13, 2],
]
ADV = [1.0, -1.0, 0.5, -0.5, 1.2, -1.2, 0.3, -0.3]


def _batch(pad_id):
    return build_batch(PROMPTS, COMPLETIONS, ADV, pad_id, group_ids=[0, 0, 1, 1, 2, 2, 3, 3])


def _with_attention_dropout(model, p=0.5):
    for m in model.modules():
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = p
    return model


def test_first_step_ratio_is_one_with_dropout_in_the_checkpoint(tiny_model):
    model, tok = tiny_model
    model = _with_attention_dropout(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    # mu = 2 computes old log-probs in a separate no-grad pass; epsilon 1e-4 flags any ratio
    # that is not 1 at step 0 as clipped
    cfg = UpdateConfig(loss=LossConfig(epsilon=1e-4), steps_per_generation=1, num_iterations=2)
    hist = grpo_update(model, opt, None, _batch(tok.pad_token_id), cfg)
    assert hist[0]["clip_ratio/region_mean"] == 0.0
    # with dropout left on (TRL's default), old and new log-probs see different masks
    model2 = _with_attention_dropout(copy.deepcopy(model))
    torch.manual_seed(0)
    cfg_on = UpdateConfig(
        loss=LossConfig(epsilon=1e-4),
        steps_per_generation=1,
        num_iterations=2,
        disable_dropout=False,
    )
    hist_on = grpo_update(
        model2, opt.__class__(model2.parameters(), lr=0.0), None, _batch(0), cfg_on
    )
    assert hist_on[0]["clip_ratio/region_mean"] > 0.0


def _grads_after(model, cfg, pad_id):
    model = copy.deepcopy(model)
    grads = []

    class Capture(torch.optim.SGD):
        def step(self, closure=None):
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]).clone())
            return super().step(closure)

    hist = grpo_update(model, Capture(model.parameters(), lr=0.0), None, _batch(pad_id), cfg)
    return grads, hist


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo", "grpo", "dr_grpo"])
def test_accumulated_micro_batches_make_one_optimizer_step(tiny_model, loss_type):
    model, tok = tiny_model
    loss = LossConfig(loss_type=loss_type, max_completion_length=9)
    big = 1e9  # no gradient clipping, to compare raw gradients
    accumulated = UpdateConfig(
        loss=loss, steps_per_generation=4, gradient_accumulation_steps=4, max_grad_norm=big
    )
    grads, hist = _grads_after(model, accumulated, 0)
    assert len(grads) == len(hist) == 1
    if loss_type in ("dapo", "grpo", "dr_grpo"):
        # the accumulated step equals the whole batch at once (equal-sized micro-batches)
        whole, _ = _grads_after(
            model, UpdateConfig(loss=loss, steps_per_generation=1, max_grad_norm=big), 0
        )
        torch.testing.assert_close(grads[0], whole[0], rtol=1e-4, atol=1e-6)


def test_dapo_divides_every_step_by_its_share_of_the_generation_batch_tokens(tiny_model):
    # TRL 1.16: with 4 optimizer steps per generation batch, dapo's step 0 is the micro-batch's
    # token sum / (the generation batch's tokens / 4); bnpo's is the micro-batch's token mean
    model, _ = tiny_model
    big = 1e9  # no gradient clipping, to compare raw gradients
    dapo, _ = _grads_after(
        model,
        UpdateConfig(loss=LossConfig(loss_type="dapo"), steps_per_generation=4, max_grad_norm=big),
        0,
    )
    bnpo, _ = _grads_after(
        model,
        UpdateConfig(loss=LossConfig(loss_type="bnpo"), steps_per_generation=4, max_grad_norm=big),
        0,
    )
    assert len(dapo) == len(bnpo) == 4
    micro_tokens = len(COMPLETIONS[0]) + len(COMPLETIONS[1])
    batch_tokens = sum(len(c) for c in COMPLETIONS)
    torch.testing.assert_close(dapo[0], bnpo[0] * micro_tokens / (batch_tokens / 4))


def test_config_refuses_accumulation_across_generation_batches():
    with pytest.raises(ValueError, match="multiple of gradient_accumulation_steps"):
        UpdateConfig(steps_per_generation=2, gradient_accumulation_steps=4)

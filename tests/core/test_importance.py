"""grpo_core.importance: old-logprob rule and the rollout-engine correction."""

import math

import pytest
import torch

from grpo_core.importance import engine_importance_weights, needs_old_logprobs, resolve_old_logprobs


def test_needs_old_logprobs():
    assert not needs_old_logprobs(1, 1, False)
    assert needs_old_logprobs(2)
    assert needs_old_logprobs(1, 4)
    assert needs_old_logprobs(1, 1, True)
    with pytest.raises(ValueError):
        needs_old_logprobs(0)
    x = torch.zeros(2, requires_grad=True)
    assert not resolve_old_logprobs(x, None).requires_grad


def setup():
    # token log gaps old - sampling: row 0 [ln 2, ln 0.25], row 1 [ln 4, pad]
    old = torch.tensor([[math.log(2), math.log(0.25)], [math.log(4), 5.0]])
    sampling = torch.zeros(2, 2)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    return old, sampling, mask


def test_token_modes_hand():
    old, s, mask = setup()
    w, m = engine_importance_weights(old, s, mask, mode="token_truncate", clip_max=3.0)
    # ratios [2, .25 | 4 -> 3 (cap), pad e^0 = 1]
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.25], [3.0, 1.0]]))
    assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx((2 + 0.25 + 3) / 3)
    assert m["sampling/sampling_logp_difference/max"] == pytest.approx(math.log(4))
    assert m["sampling/importance_sampling_ratio/clipped_share"] == pytest.approx(1 / 3)
    w, m = engine_importance_weights(old, s, mask, mode="token_mask", clip_min=0.5, clip_max=3.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.0], [0.0, 1.0]]))
    # 0.25 under the floor and 4 over the cap, of 3 completion tokens (the pad not counted)
    assert m["sampling/importance_sampling_ratio/clipped_share"] == pytest.approx(2 / 3)


def test_sequence_modes_hand():
    old, s, mask = setup()
    # sequence ratio = exp(sum of gaps): row 0: 2 * 0.25 = 0.5 ; row 1: 4 (pad ignored)
    w, m = engine_importance_weights(old, s, mask, mode="sequence_truncate", clip_max=3.0)
    torch.testing.assert_close(w, torch.tensor([[0.5], [3.0]]))
    w, m = engine_importance_weights(old, s, mask)  # TRL default: sequence_mask, cap 3
    torch.testing.assert_close(w, torch.tensor([[0.5], [0.0]]))
    assert m["sampling/importance_sampling_ratio/min"] == 0.0
    assert m["sampling/importance_sampling_ratio/clipped_share"] == 0.5  # one of 2 sequences
    with pytest.raises(ValueError, match="mode"):
        engine_importance_weights(old, s, mask, mode="nope")

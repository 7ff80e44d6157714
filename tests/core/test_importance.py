"""grpo_core.algorithm.importance: old-logprob rule and the rollout-engine correction."""

import math

import pytest
import torch

from grpo_core.algorithm.importance import (
    engine_importance_weights,
    needs_old_logprobs,
    resolve_old_logprobs,
)


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


def _stale_batch(rows=64, tokens=4096, kl=0.004, seed=0):
    """Rows sampled by an older policy: per-token log-ratios log(pi_prox / mu) drawn with
    mean -s^2/2 and variance s^2 = 2 * kl (E[w] = 1, per-token KL about ``kl``)."""
    g = torch.Generator().manual_seed(seed)
    s2 = 2 * kl
    log_w = torch.randn(rows, tokens, generator=g, dtype=torch.float64) * s2**0.5 - s2 / 2
    prox = -torch.rand(rows, tokens, generator=g, dtype=torch.float64) * 3  # [B, T]
    mask = torch.ones(rows, tokens, dtype=torch.float64)
    mask[1::3, tokens // 2 :] = 0  # some shorter rows
    return prox, prox - log_w, mask


def _areal_reference(prox, samp, mask, cap, mode):
    """AReaL's behaviour weight in float64: w = exp(prox - mu); token_mask: w > cap -> 0."""
    import numpy as np

    p, s, m = prox.numpy(), samp.numpy(), mask.numpy().astype(bool)
    w = np.exp(p - s)
    over = (w > cap) & m
    w = np.where(over, 0.0, w) if mode == "token_mask" else np.minimum(w, cap)
    w = np.where(m, w, 0.0)
    c = w[m]
    return w, {
        "sampling/behaviour_weight/mean": c.mean(),
        "sampling/behaviour_weight/min": c.min(),
        "sampling/behaviour_weight/max": c.max(),
        "sampling/behaviour_weight/capped_share": over[m].mean(),
        "sampling/behaviour_weight/ess": c.sum() ** 2 / (len(c) * (c * c).sum()),
        "sampling/behaviour_weight/near_zero_share": (c < 0.01).mean(),
    }


@pytest.mark.parametrize("mode", ["token_mask", "token_truncate"])
@pytest.mark.parametrize("kl", [0.004, 0.5])
def test_behaviour_weights_equal_a_float64_reference_of_areal(mode, kl):
    from grpo_core.algorithm.importance import behaviour_weights

    prox, samp, mask = _stale_batch(rows=16, tokens=512, kl=kl)
    w, m = behaviour_weights(prox.float(), samp.float(), mask.float(), mode=mode, cap=5.0)
    ref_w, ref_m = _areal_reference(prox, samp, mask, 5.0, mode)
    assert w.numpy() == pytest.approx(ref_w, rel=1e-5, abs=1e-6)
    for key, value in ref_m.items():
        assert m[key] == pytest.approx(float(value), rel=1e-4, abs=1e-6), key
    if kl == 0.5:  # wide ratios: the cap acts
        assert m["sampling/behaviour_weight/capped_share"] > 0


def test_token_level_weights_do_not_collapse_on_long_completions():
    """Issue 41: at per-token KL 0.004 over 4,096 tokens TRL's sequence_mask weight (a
    product over the completion) has a median near 1e-7 and an ESS of about 1% of the batch,
    while clipped_share reads 0; the token-level behaviour weight keeps ESS near 1, and both
    now log the ESS and the near-zero share that show the collapse."""
    from grpo_core.algorithm.importance import behaviour_weights, engine_importance_weights

    prox, samp, mask = _stale_batch()
    full = torch.ones_like(mask, dtype=torch.float32)
    seq_w, seq_m = engine_importance_weights(prox.float(), samp.float(), full, mode="sequence_mask")
    assert seq_w.median().item() < 1e-5
    assert seq_m["sampling/importance_sampling_ratio/ess"] < 0.1
    assert seq_m["sampling/importance_sampling_ratio/near_zero_share"] > 0.8
    assert seq_m["sampling/importance_sampling_ratio/clipped_share"] < 0.1  # it does not show
    tok_w, tok_m = behaviour_weights(prox.float(), samp.float(), full)
    assert tok_m["sampling/behaviour_weight/ess"] > 0.98
    assert tok_m["sampling/behaviour_weight/near_zero_share"] == 0.0
    assert tok_w.mean().item() == pytest.approx(1.0, abs=0.01)


def test_behaviour_weight_runs_in_the_update_and_refuses_double_weighting(tiny_model):
    from grpo_core.algorithm.update import build_batch, grpo_update
    from grpo_core.config.loss import BehaviourWeight, EngineCorrection, UpdateConfig

    model, tok = tiny_model
    prompts = [[3, 12, 13, 4]] * 4
    comps = [[5, 12, 6, 2], [5, 13, 6, 7, 2], [5, 6, 2], [5, 7, 8, 2]]
    samp = [[-2.0] * len(c) for c in comps]
    batch = build_batch(prompts, comps, [1.0, -1.0, 0.5, -0.5], tok.pad_token_id,
                        group_ids=[0, 0, 1, 1], sampling_logprobs=samp)  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    hist = grpo_update(model, opt, None, batch, UpdateConfig(behaviour_weight=BehaviourWeight()))
    assert 0 < hist[0]["sampling/behaviour_weight/ess"] <= 1
    with pytest.raises(ValueError, match="both divide"):
        grpo_update(model, opt, None, batch, UpdateConfig(
            behaviour_weight=BehaviourWeight(), engine_correction=EngineCorrection()))  # fmt: skip
    with pytest.raises(ValueError, match="would be 1"):
        grpo_update(model, opt, None, batch, UpdateConfig(
            behaviour_weight=BehaviourWeight(), old_logprobs="sampler"))  # fmt: skip


def test_sequence_metrics_leave_out_rows_without_a_counted_token():
    """A masked-out row (truncated, mask_truncated_completions) has weight exp(0) = 1 in the
    sequence modes; it must not pull the metrics towards 1 (issue 41, smaller findings)."""
    old = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    samp = torch.tensor([[-2.0, -2.0], [-5.0, -5.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    _, m = engine_importance_weights(old, samp, mask, mode="sequence_truncate", clip_max=100.0)
    assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx(math.exp(2.0))
    assert m["sampling/importance_sampling_ratio/min"] == pytest.approx(math.exp(2.0))

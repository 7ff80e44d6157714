"""grpo_core.algorithm.losses: hand-computed values, an independent float64 reference, properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_core.algorithm.losses import LOSS_AGGREGATIONS, POLICY_OBJECTIVES, policy_loss

LOSS_TYPES = ["grpo", "bnpo", "dapo", "dr_grpo"]


def hand_batch():
    """Two sequences, 3 positions; row 1's last token is padding.

    row 0: A = +1, ratios [1.1, 1.5, 0.7], mask [1, 1, 1]
    row 1: A = -2, ratios [0.5, 1.3, 1.0], mask [1, 1, 0]
    """
    old = torch.zeros(2, 3, dtype=torch.float64)
    ratios = torch.tensor([[1.1, 1.5, 0.7], [0.5, 1.3, 1.0]], dtype=torch.float64)
    logp = ratios.log().requires_grad_()
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)
    return logp, old, adv, mask


# Per-token losses with epsilon = 0.2 (clip to [0.8, 1.2]):
#   row 0 (A=+1): -min(r, clip r): 1.1 -> -1.1; 1.5 -> -1.2 (high clip); 0.7 -> -0.7
#                 sum = -3.0, token mean = -1.0
#   row 1 (A=-2): -min(-2r, -2 clip r) = 2 max(r, clip r): 0.5 -> 1.6 (low clip); 1.3 -> 2.6
#                 sum = 4.2, token mean = 2.1
HAND = {
    "grpo": (-1.0 + 2.1) / 2,  # mean of sequence means = 0.55
    "bnpo": (-3.0 + 4.2) / 5,  # sum / 5 tokens = 0.24
    "dapo": (-3.0 + 4.2) / 5,  # same on a single batch = 0.24
    "dr_grpo": (-3.0 + 4.2) / (2 * 4),  # sum / (2 sequences x L_max 4) = 0.15
}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_hand_values_per_loss_type(loss_type):
    logp, old, adv, mask = hand_batch()
    loss, m = policy_loss(
        logp, old, adv, mask, epsilon=0.2, loss_type=loss_type, max_completion_length=4
    )
    assert loss.item() == pytest.approx(HAND[loss_type], abs=1e-12)
    # one low-clipped (row 1, t 0) and one high-clipped (row 0, t 1) of 5 tokens
    assert m["clip_ratio/low_mean"] == pytest.approx(0.2)
    assert m["clip_ratio/high_mean"] == pytest.approx(0.2)
    assert m["clip_ratio/region_mean"] == pytest.approx(0.4)
    assert "kl" not in m


def test_hand_clip_higher():
    # epsilon_high = 0.6: row 0 t 1 ratio 1.5 < 1.6 is no longer clipped -> -1.5
    # row 0 sum = -1.1 - 1.5 - 0.7 = -3.3; dapo = (-3.3 + 4.2) / 5 = 0.18
    logp, old, adv, mask = hand_batch()
    loss, m = policy_loss(logp, old, adv, mask, epsilon=0.2, epsilon_high=0.6)
    assert loss.item() == pytest.approx(0.18, abs=1e-12)
    assert m["clip_ratio/high_mean"] == 0.0


def test_hand_kl_k3():
    # ref - logp = ln 2 on row 0 t 0, 0 elsewhere: k3 = 2 - ln 2 - 1 = 1 - ln 2 = 0.30685
    # dapo: 0.24 + beta * 0.30685 / 5 tokens; kl metric = 0.30685 / 5
    logp, old, adv, mask = hand_batch()
    ref = logp.detach().clone()
    ref[0, 0] += math.log(2.0)
    loss, m = policy_loss(logp, old, adv, mask, ref_logp=ref, beta=0.1)
    k3 = 1 - math.log(2.0)
    assert loss.item() == pytest.approx(0.24 + 0.1 * k3 / 5, abs=1e-12)
    assert m["kl"] == pytest.approx(k3 / 5)


def test_hand_dual_clip():
    # A = -2, ratio 4: PPO loss -min(-8, -2.4) = 8 > c * |A| = 6 -> capped at 6
    #         ratio 2: loss 4 < 6 -> unchanged; A = +1 tokens are never capped
    old = torch.zeros(2, 2, dtype=torch.float64)
    logp = torch.tensor([[4.0, 2.0], [4.0, 1.0]], dtype=torch.float64).log()
    adv = torch.tensor([-2.0, 1.0], dtype=torch.float64)
    mask = torch.ones(2, 2, dtype=torch.float64)
    loss, _ = policy_loss(logp, old, adv, mask, clip_ratio_c=3.0, loss_type="bnpo")
    # row 1 (A=+1): -min(4, 1.2) = -1.2 ; -min(1, 1) = -1
    assert loss.item() == pytest.approx((6 + 4 - 1.2 - 1) / 4, abs=1e-12)


def test_hand_two_sided_delta():
    # delta = 1.4 caps the unclipped ratio for A < 0: ratio 2 -> -min(-2*1.4, -2*1.2) = 2.8
    old = torch.zeros(1, 1, dtype=torch.float64)
    logp = torch.tensor([[2.0]], dtype=torch.float64).log()
    loss, _ = policy_loss(logp, old, torch.tensor([-2.0]).double(), torch.ones(1, 1), delta=1.4)
    assert loss.item() == pytest.approx(2.8)


def test_hand_gspo_sequence_ratio():
    # row 0: s = exp(mean(ln 1.1, ln 1.5, ln 0.7)) = 1.155 ** (1/3) = 1.04917, A=+1 -> -1.04917
    # row 1: s = exp(mean(ln 0.5, ln 1.3)) = 0.65 ** 0.5 = 0.80623 > 0.8, A=-2 -> 1.61245
    # grpo: sequence means are the constants -> (-1.04917 + 1.61245) / 2
    # dapo would weight them by length: (3 * -1.04917 + 2 * 1.61245) / 5
    logp, old, adv, mask = hand_batch()
    s0, s1 = 1.155 ** (1 / 3), 0.65**0.5
    loss, m = policy_loss(
        logp, old, adv, mask, loss_type="grpo", importance_sampling_level="sequence"
    )
    assert loss.item() == pytest.approx((-s0 + 2 * s1) / 2, abs=1e-12)
    loss, m = policy_loss(logp, old, adv, mask, importance_sampling_level="sequence")
    assert loss.item() == pytest.approx((-3 * s0 + 2 * 2 * s1) / 5, abs=1e-12)
    assert m["clip_ratio/region_mean"] == 0.0


def test_hand_cispo():
    # CISPO: -sg(min(r, eps_high)) * A * logp; r = 1.5 with cap 1.2: weight 1.2, A = 1
    # loss value = -1.2 * ln 1.5; d/dlogp = -1.2 (the capped weight, no clipping of the grad)
    old = torch.zeros(1, 1, dtype=torch.float64)
    logp = torch.tensor([[1.5]], dtype=torch.float64).log().requires_grad_()
    loss, m = policy_loss(
        logp, old, torch.ones(1).double(), torch.ones(1, 1), objective="cispo", epsilon_high=1.2
    )
    assert loss.item() == pytest.approx(-1.2 * math.log(1.5))
    loss.backward()
    assert logp.grad.item() == pytest.approx(-1.2)
    assert m["clip_ratio/high_mean"] == 1.0


def test_unknown_names_list_valid_ones():
    logp, old, adv, mask = hand_batch()
    with pytest.raises(ValueError, match="bnpo, dapo, dr_grpo, grpo"):
        policy_loss(logp, old, adv, mask, loss_type="nope")
    with pytest.raises(ValueError, match="token"):
        policy_loss(logp, old, adv, mask, importance_sampling_level="nope")
    with pytest.raises(ValueError, match="max_completion_length"):
        policy_loss(logp, old, adv, mask, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, old, adv, mask, beta=0.1)
    assert set(LOSS_AGGREGATIONS.names()) == set(LOSS_TYPES)
    assert {"clip", "cispo"} <= set(POLICY_OBJECTIVES.names())


# ---------------------------------------------------------------------------------------------
# Independent slow implementation, element by element, from the papers' formulas.
#   DeepSeekMath eq. 3 (grpo):  L = 1/G sum_i 1/|o_i| sum_t l_it
#   DAPO eq. 8 (dapo / bnpo):   L = 1/(sum_i |o_i|) sum_i sum_t l_it
#   Dr. GRPO (dr_grpo):         L = 1/(G * L_max) sum_i sum_t l_it
#   l_it = -min(r_it A_i, clip(r_it, 1 - eps, 1 + eps_high) A_i) + beta * k3_it
#   GSPO: r_it = s_i = exp(1/|o_i| sum_t (logp_it - old_it))
# ---------------------------------------------------------------------------------------------
def slow_loss(logp, old, adv, mask, *, beta, ref, eps, eps_high, loss_type, L, level):
    B, T = logp.shape
    total = logp.new_zeros(())
    n_tokens = sum(int(mask[i, t]) for i in range(B) for t in range(T))
    for i in range(B):
        n_i = sum(int(mask[i, t]) for t in range(T))
        seq_lr = sum((logp[i, t] - old[i, t]) for t in range(T) if mask[i, t]) / max(n_i, 1)
        row = logp.new_zeros(())
        for t in range(T):
            if not mask[i, t]:
                continue
            r = torch.exp(seq_lr) if level == "sequence" else torch.exp(logp[i, t] - old[i, t])
            r_clip = torch.clamp(r, 1 - eps, 1 + eps_high)
            term = -torch.minimum(r * adv[i], r_clip * adv[i])
            if beta:
                d = ref[i, t] - logp[i, t]
                term = term + beta * (torch.exp(d) - d - 1)
            row = row + term
        if loss_type == "grpo":
            total = total + row / max(n_i, 1) / B
        elif loss_type in ("dapo", "bnpo"):
            total = total + row / max(n_tokens, 1)
        else:
            total = total + row / (B * L)
    return total


def random_batch(B, T, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    old = logp + torch.randn(B, T, generator=g, dtype=dtype) * 0.3
    ref = logp + torch.randn(B, T, generator=g, dtype=dtype) * 0.3
    adv = torch.randn(B, generator=g, dtype=dtype)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).to(dtype)
    return logp, old, ref, adv, mask


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("eps_high", [None, 0.28])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("seed", [0, 1])
def test_float64_value_and_grad_vs_slow_reference(loss_type, beta, eps_high, level, seed):
    logp, old, ref, adv, mask = random_batch(3, 5, seed)
    logp_a = logp.clone().requires_grad_()
    logp_b = logp.clone().requires_grad_()
    kw = dict(beta=beta, epsilon=0.2, epsilon_high=eps_high, loss_type=loss_type)
    loss, _ = policy_loss(
        logp_a,
        old,
        adv,
        mask,
        ref_logp=ref,
        max_completion_length=7,
        importance_sampling_level=level,
        **kw,
    )
    expected = slow_loss(
        logp_b,
        old,
        adv,
        mask,
        beta=beta,
        ref=ref,
        eps=0.2,
        eps_high=0.2 if eps_high is None else eps_high,
        loss_type=loss_type,
        L=7,
        level=level,
    )
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logp_a.grad, logp_b.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("splits", [[2, 1, 3], [1, 1, 1, 1, 1, 1], [6]])
def test_gradient_accumulation_equals_whole_batch(loss_type, level, splits):
    logp, old, ref, adv, mask = random_batch(6, 5, seed=7)
    kw = dict(
        ref_logp=ref,
        beta=0.04,
        loss_type=loss_type,
        max_completion_length=5,
        importance_sampling_level=level,
        epsilon_high=0.28,
    )
    whole = logp.clone().requires_grad_()
    full_loss, _ = policy_loss(whole, old, adv, mask, **kw)
    full_loss.backward()

    # global normaliser: tokens for dapo/bnpo, sequences for grpo/dr_grpo
    n_items = mask.sum() if loss_type in ("dapo", "bnpo") else mask.shape[0]
    acc = logp.clone().requires_grad_()
    total, start = 0.0, 0
    for size in splits:
        sl = slice(start, start + size)
        micro, _ = policy_loss(
            acc[sl],
            old[sl],
            adv[sl],
            mask[sl],
            num_items_in_batch=n_items,
            **{**kw, "ref_logp": ref[sl]},
        )
        micro.backward()
        total += micro.item()
        start += size
    assert total == pytest.approx(full_loss.item(), rel=1e-12, abs=1e-12)
    torch.testing.assert_close(acc.grad, whole.grad, rtol=1e-12, atol=1e-14)


def test_old_logp_none_is_detached_current():
    logp, _, _, adv, mask = random_batch(4, 6, seed=3)
    a = logp.clone().requires_grad_()
    b = logp.clone().requires_grad_()
    la, _ = policy_loss(a, None, adv, mask)
    lb, _ = policy_loss(b, b.detach(), adv, mask)
    la.backward()
    lb.backward()
    torch.testing.assert_close(la, lb)
    torch.testing.assert_close(a.grad, b.grad)


def test_token_weights_and_is_ratio_multiply_policy_term():
    logp, old, _, adv, mask = random_batch(3, 4, seed=5)
    w = torch.rand(3, 4, dtype=torch.float64)
    base, _ = policy_loss(logp, old, adv, mask, loss_type="bnpo", token_weights=w)
    alt, _ = policy_loss(logp, old, adv, mask, loss_type="bnpo", importance_sampling_ratio=w)
    pt = -torch.min(
        torch.exp(logp - old) * adv[:, None], torch.exp(logp - old).clamp(0.8, 1.2) * adv[:, None]
    )
    expected = (pt * w * mask).sum() / mask.sum()
    torch.testing.assert_close(base, expected)
    torch.testing.assert_close(alt, expected)


def test_bool_and_float_masks_agree():
    logp, old, _, adv, mask = random_batch(3, 4, seed=9)
    a, ma = policy_loss(logp, old, adv, mask)
    b, mb = policy_loss(logp, old, adv, mask.bool())
    torch.testing.assert_close(a, b)
    assert ma == mb


# ----------------------------- hypothesis properties -----------------------------------------
shapes = st.tuples(st.integers(1, 6), st.integers(1, 8), st.integers(0, 2**16))


@settings(max_examples=40, deadline=None)
@given(shapes, st.sampled_from(LOSS_TYPES), st.sampled_from(["token", "sequence"]))
def test_zero_advantages_give_zero_policy_gradient(shape, loss_type, level):
    B, T, seed = shape
    logp, old, _, _, mask = random_batch(B, T, seed)
    logp.requires_grad_()
    loss, _ = policy_loss(
        logp,
        old,
        torch.zeros(B, dtype=torch.float64),
        mask,
        loss_type=loss_type,
        max_completion_length=T,
        importance_sampling_level=level,
    )
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(logp.grad) == 0


@settings(max_examples=40, deadline=None)
@given(shapes)
def test_ratio_one_beta_zero_is_minus_token_weighted_mean_advantage(shape):
    # under token weighting (dapo): loss = -sum_i |o_i| A_i / sum_i |o_i|
    B, T, seed = shape
    logp, _, _, adv, mask = random_batch(B, T, seed)
    loss, m = policy_loss(logp, logp, adv, mask, loss_type="dapo")
    expected = -(adv * mask.sum(-1)).sum() / mask.sum()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-12)
    assert m["clip_ratio/region_mean"] == 0.0


@settings(max_examples=40, deadline=None)
@given(shapes, st.sampled_from([None, 0.28]))
def test_clipping_stops_gradient_exactly_outside_trust_region(shape, eps_high):
    # dapo, token level: d loss / d logp_it = -A_i r_it / N inside, exactly 0 when clipped
    B, T, seed = shape
    logp, old, _, adv, mask = random_batch(B, T, seed)
    logp.requires_grad_()
    loss, _ = policy_loss(logp, old, adv, mask, epsilon=0.2, epsilon_high=eps_high)
    loss.backward()
    hi = 0.2 if eps_high is None else eps_high
    r = torch.exp(logp.detach() - old)
    A = adv[:, None].expand_as(r)
    clipped = ((r > 1 + hi) & (A > 0)) | ((r < 1 - 0.2) & (A < 0))
    expected = torch.where(clipped, torch.zeros_like(r), -A * r / mask.sum()) * mask
    torch.testing.assert_close(logp.grad, expected, rtol=1e-12, atol=0.0)
    assert torch.all(logp.grad[clipped] == 0)


def test_kl_estimator_option_and_bias_correction():
    # one token, A = 0, old = logp (ratio 1), logp - ref = ln 2
    # k1 = ln 2 ; k2 = (ln 2)^2 / 2 ; k3 = 1/2 + ln 2 - 1 ; bias correction multiplies by r = 1
    logp = torch.tensor([[math.log(2.0)]], dtype=torch.float64)
    ref = torch.zeros(1, 1, dtype=torch.float64)
    zero_adv, mask = torch.zeros(1, dtype=torch.float64), torch.ones(1, 1)
    expected = {"k1": math.log(2), "k2": math.log(2) ** 2 / 2, "k3": 0.5 + math.log(2) - 1}
    for name, kl in expected.items():
        loss, m = policy_loss(logp, logp, zero_adv, mask, ref_logp=ref, beta=1.0, kl_estimator=name)
        assert loss.item() == pytest.approx(kl) and m["kl"] == pytest.approx(kl)
    # with old = logp - ln 2 the token ratio is 2: corrected k3 = 2 * (ln 2 - 1/2)
    loss, _ = policy_loss(
        logp,
        logp - math.log(2),
        zero_adv,
        mask,
        ref_logp=ref,
        beta=1.0,
        use_bias_correction_kl=True,
    )
    assert loss.item() == pytest.approx(2 * (0.5 + math.log(2) - 1))


def test_library_configs_refuse_what_the_rl_section_refuses():
    """LossConfig and policy_loss(**knobs) refuse as RLConfig does (issue 41): cispo without
    its cap, the clip objective's bounds with cispo, a dual-clip bound <= 1."""
    import pytest as _pytest

    from grpo_core.algorithm.losses import policy_loss
    from grpo_core.config.loss import LossConfig

    with _pytest.raises(ValueError, match="needs epsilon_high"):
        LossConfig(objective="cispo")
    with _pytest.raises(ValueError, match="needs epsilon_high"):
        logp = torch.zeros(1, 2)
        policy_loss(logp, None, torch.ones(1), torch.ones(1, 2), objective="cispo")
    with _pytest.raises(ValueError, match="delta with objective='cispo'"):
        LossConfig(objective="cispo", epsilon_high=5.0, delta=1.5)
    with _pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        LossConfig(clip_ratio_c=0.5)
    assert LossConfig(objective="cispo", epsilon_high=5.0).epsilon_high == 5.0

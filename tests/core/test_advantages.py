"""grpo_core.algorithm.advantages: hand-computed values, loop-vs-vectorised, properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_core.algorithm import advantages as A

NAN = float("nan")


def t(x, dtype=torch.float64):
    return torch.tensor(x, dtype=dtype)


def ids(x):
    return torch.tensor(x, dtype=torch.long)


def test_grpo_group_scale_hand():
    # rewards [1, 0, 0, 1]: mean 0.5, unbiased var = 4 * 0.25 / 3 = 1/3, std = 0.57735
    # A = +-0.5 / (0.57735 + 1e-4)
    adv = A.compute("grpo", t([1.0, 0.0, 0.0, 1.0]), ids([0, 0, 0, 0]))
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    torch.testing.assert_close(adv, t([a, -a, -a, a]))


def test_grpo_two_interleaved_groups_hand():
    # group 7: [2, 4] -> mean 3, std sqrt(2) ; group 3: [1, 1] -> equal rewards, A = 0
    adv = A.compute("grpo", t([2.0, 1.0, 4.0, 1.0]), ids([7, 3, 7, 3]))
    a = 1.0 / (math.sqrt(2) + 1e-4)
    torch.testing.assert_close(adv, t([-a, 0.0, a, 0.0]))


def test_grpo_batch_and_none_scale_hand():
    # rewards [2, 4 | 1, 1]; batch std: mean 2, devs [0, 2, -1, -1], var = 6 / 3 = 2
    r, g = t([2.0, 4.0, 1.0, 1.0]), ids([0, 0, 1, 1])
    adv = A.compute("grpo", r, g, scale_rewards="batch")
    b = math.sqrt(2) + 1e-4
    torch.testing.assert_close(adv, t([-1 / b, 1 / b, 0.0, 0.0]))
    torch.testing.assert_close(A.compute("grpo", r, g, scale_rewards="none"), t([-1, 1, 0, 0.0]))
    torch.testing.assert_close(A.compute("dr_grpo", r, g), t([-1, 1, 0, 0.0]))


def test_rloo_hand():
    # [1, 0, 0, 1]: A_0 = 1 - (0 + 0 + 1)/3 = 2/3 ; A_1 = 0 - (1 + 0 + 1)/3 = -2/3
    adv = A.compute("rloo", t([1.0, 0.0, 0.0, 1.0]), ids([0, 0, 0, 0]))
    torch.testing.assert_close(adv, t([2 / 3, -2 / 3, -2 / 3, 2 / 3]))


def test_nan_rewards_are_excluded_hand():
    # group [1, 0, NaN]: valid mean 0.5, unbiased std sqrt(0.5); NaN row gets 0
    adv = A.compute("grpo", t([1.0, 0.0, NAN]), ids([0, 0, 0]))
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    torch.testing.assert_close(adv, t([a, -a, 0.0]))
    # rloo with n = 2 valid: A_0 = 1 - 0 = 1
    torch.testing.assert_close(
        A.compute("rloo", t([1.0, 0.0, NAN]), ids([0, 0, 0])), t([1, -1, 0.0])
    )


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_equal_or_single_or_all_nan_groups_give_zero(name):
    r = t([3.0, 3.0, 3.0, 5.0, NAN, NAN, NAN])
    g = ids([0, 0, 0, 1, 1, 2, 2])
    adv = A.compute(name, r, g)
    assert not torch.isnan(adv).any()
    assert torch.all(adv == 0)


def test_float32_and_int_rewards():
    adv = A.compute("grpo", torch.tensor([1.0, 0.0]), ids([0, 0]))
    assert adv.dtype == torch.float32
    adv = A.compute("grpo", torch.tensor([1, 0]), ids([0, 0]))
    assert adv.dtype == torch.float32 and adv[0] > 0


def test_unknown_estimator_and_bad_options():
    with pytest.raises(ValueError, match="dr_grpo, grpo, rloo"):
        A.compute("ppo", t([1.0]), ids([0]))
    with pytest.raises(ValueError, match="scale_rewards"):
        A.compute("grpo", t([1.0]), ids([0]), scale_rewards="nope")
    with pytest.raises(ValueError, match="never scales"):
        A.compute("dr_grpo", t([1.0]), ids([0]), scale_rewards="group")


def slow(name, rewards, group_ids, scale="group", eps=1e-4):
    """Loop implementation straight from the formulas."""
    r = rewards.tolist()
    g = group_ids.tolist()
    valid_all = [x for x in r if not math.isnan(x)]
    if len(valid_all) > 1:
        mu = sum(valid_all) / len(valid_all)
        bstd = math.sqrt(sum((x - mu) ** 2 for x in valid_all) / (len(valid_all) - 1))
    else:
        bstd = 0.0
    out = []
    for i, ri in enumerate(r):
        if math.isnan(ri):
            out.append(0.0)
            continue
        grp = [r[j] for j in range(len(r)) if g[j] == g[i] and not math.isnan(r[j])]
        n, mean = len(grp), sum(grp) / len(grp)
        std = math.sqrt(sum((x - mean) ** 2 for x in grp) / (n - 1)) if n > 1 else 0.0
        if name == "rloo":
            others = [x for k, x in enumerate(grp) if k != grp.index(ri)] if n > 1 else []
            out.append(ri - sum(others) / len(others) if others else 0.0)
        elif scale == "group":
            out.append((ri - mean) / (std + eps))
        elif scale == "batch":
            out.append((ri - mean) / (bstd + eps))
        else:
            out.append(ri - mean)
    return torch.tensor(out, dtype=torch.float64)


def random_rewards(n_groups, size, seed, nan_frac=0.1, discrete=True):
    gen = torch.Generator().manual_seed(seed)
    n = n_groups * size
    r = (
        torch.randint(0, 3, (n,), generator=gen).double()
        if discrete
        else torch.randn(n, generator=gen).double()
    )
    r[torch.rand(n, generator=gen) < nan_frac] = NAN
    g = torch.randint(0, 1000, (n_groups,), generator=gen).repeat_interleave(size)
    perm = torch.randperm(n, generator=gen)
    return r[perm], g[perm]


@pytest.mark.parametrize("n_groups,size", [(1, 2), (3, 4), (8, 16), (5, 1)])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "variant", [("grpo", "group"), ("grpo", "batch"), ("grpo", "none"), ("rloo", None)]
)
def test_loop_vs_vectorised(n_groups, size, seed, variant):
    name, scale = variant
    r, g = random_rewards(n_groups, size, seed)
    opts = {} if scale is None else {"scale_rewards": scale}
    torch.testing.assert_close(A.compute(name, r, g, **opts), slow(name, r, g, scale or "none"))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.one_of(st.floats(-1e3, 1e3), st.just(NAN)), min_size=1, max_size=24),
    st.integers(1, 4),
    st.sampled_from(["grpo", "dr_grpo", "rloo"]),
)
def test_properties_finite_and_centred(values, n_groups, name):
    r = torch.tensor(values, dtype=torch.float64)
    g = torch.arange(len(values)) % n_groups
    adv = A.compute(name, r, g)
    assert torch.isfinite(adv).all()
    assert torch.all(adv[torch.isnan(r)] == 0)
    for gid in g.unique():
        sel = (g == gid) & ~torch.isnan(r)
        assert abs(adv[sel].sum().item()) <= 1e-6 * (1 + r[sel].abs().sum().item())


def test_multi_sum_then_normalize_equals_weighted_sum():
    # two reward functions, weights [1, 0.5]; row 3 has only the second function
    rpf = t([[1.0, 0.0], [0.0, 2.0], [1.0, 2.0], [NAN, 2.0]])
    g = ids([0, 0, 0, 0])
    w = t([1.0, 0.5])
    summed = A.weighted_reward_sum(rpf, w)
    torch.testing.assert_close(summed, t([1.0, 1.0, 2.0, 1.0]))
    torch.testing.assert_close(
        A.compute_multi(rpf, g, weights=w, scale_rewards="none"), summed - 1.25
    )


def test_multi_unscorable_row_gets_zero():
    rpf = t([[1.0, NAN], [NAN, NAN], [0.0, NAN]])
    adv = A.compute_multi(rpf, ids([0, 0, 0]), aggregation="normalize_then_sum")
    assert adv[1] == 0 and torch.isfinite(adv).all()
    assert torch.isnan(A.weighted_reward_sum(rpf)[1])


def test_multi_normalize_then_sum_hand():
    # one group of 2, f1 = [1, 0] -> (+-0.5)/(std 0.70711 + 1e-4) = +-0.70701
    #                  f2 = [0, 0] -> 0 / 1e-4 = 0
    # summed [0.70701, -0.70701]; batch mean 0, std = 0.99986 -> A = summed / (0.99986 + 1e-4)
    rpf = t([[1.0, 0.0], [0.0, 0.0]])
    adv = A.compute_multi(rpf, ids([0, 0]), aggregation="normalize_then_sum")
    s = 0.5 / (math.sqrt(0.5) + 1e-4)
    b = math.sqrt(2 * s * s) + 1e-4
    torch.testing.assert_close(adv, t([s / b, -s / b]))
    with pytest.raises(ValueError, match="aggregation"):
        A.compute_multi(rpf, ids([0, 0]), aggregation="nope")


def test_group_stats_hand():
    # groups: [1, 0] (std 0.70711) and [1, 1] (std 0); NaN row excluded
    r = t([1.0, 0.0, 1.0, 1.0, NAN])
    s = A.group_stats(r, ids([0, 0, 1, 1, 1]))
    assert s["reward"] == pytest.approx(0.75)
    # batch std of [1, 0, 1, 1]: mean .75, var = (3 * .0625 + .5625) / 3 = .25
    assert s["reward_std"] == pytest.approx(0.5)
    assert s["reward_std/group_mean"] == pytest.approx(math.sqrt(0.5) / 2)
    # completions whose group std is 0: the 3 rows of group 1 of 5
    assert s["frac_reward_zero_std"] == pytest.approx(3 / 5)

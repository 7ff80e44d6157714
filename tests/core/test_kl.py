"""grpo_core.algorithm.kl: the three estimators by hand."""

import math

import pytest
import torch

from grpo_core.algorithm.kl import KL_ESTIMATORS, kl_divergence


@pytest.mark.parametrize(
    "name,expected",
    [
        # logp = 0, ref = ln 2 (d = ref - logp = ln 2) and logp = ln 2, ref = 0 (d = -ln 2)
        ("k1", [-math.log(2), math.log(2)]),  # k1 = logp - ref
        ("k2", [0.5 * math.log(2) ** 2] * 2),  # k2 = (logp - ref)^2 / 2
        ("k3", [2 - math.log(2) - 1, 0.5 + math.log(2) - 1]),  # k3 = e^d - d - 1
    ],
)
def test_estimators_hand(name, expected):
    logp = torch.tensor([[0.0, math.log(2)]], dtype=torch.float64)
    ref = torch.tensor([[math.log(2), 0.0]], dtype=torch.float64)
    torch.testing.assert_close(kl_divergence(logp, ref, name), torch.tensor([expected]).double())


def test_k3_gradient_and_zero_at_equal():
    # d k3 / d logp = -e^d + 1 with d = ref - logp ; d = ln 2 -> -1
    logp = torch.zeros(1, 1, dtype=torch.float64, requires_grad=True)
    ref = torch.full((1, 1), math.log(2), dtype=torch.float64)
    kl_divergence(logp, ref).sum().backward()
    assert logp.grad.item() == pytest.approx(-1.0)
    assert kl_divergence(ref, ref).item() == 0.0


def test_registry():
    assert KL_ESTIMATORS.names() == ["k1", "k2", "k3"]
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_divergence(torch.zeros(1), torch.zeros(1), "k4")

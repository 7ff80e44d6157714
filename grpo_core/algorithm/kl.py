"""Per-token KL estimators between the policy and the reference model.

Schulman, "Approximating KL Divergence" (2020, joschu.net/blog/kl-approx.html). With samples
from the policy and ``log_r = ref_logp - logp`` (log of pi_ref / pi_theta):

- ``k1 = -log_r``: unbiased, high variance, can be negative.
- ``k2 = 0.5 * log_r**2``: biased, low variance, always >= 0.
- ``k3 = exp(log_r) - log_r - 1``: unbiased, low variance, always >= 0. The estimator of
  DeepSeekMath (Shao et al., 2024, eq. 4) and TRL's GRPOTrainer; the default.

All take ``(logp[B, T], ref_logp[B, T])`` and return ``kl[B, T]``; gradients flow to ``logp``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from grpo_core.registry import Registry

KLFn = Callable[[Tensor, Tensor], Tensor]
KL_ESTIMATORS: Registry[KLFn] = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = log pi_theta - log pi_ref."""
    return logp - ref_logp  # [B, T]


@KL_ESTIMATORS.register("k2")
def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = 0.5 * (log pi_theta - log pi_ref)^2."""
    return 0.5 * (logp - ref_logp) ** 2  # [B, T]


@KL_ESTIMATORS.register("k3")
def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = exp(ref - logp) - (ref - logp) - 1 (DeepSeekMath eq. 4)."""
    log_r = ref_logp - logp  # [B, T]
    return torch.exp(log_r) - log_r - 1  # [B, T]


def kl_divergence(logp: Tensor, ref_logp: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token KL estimate ``[B, T]`` with the named estimator (k1, k2, k3)."""
    return KL_ESTIMATORS.get(estimator)(logp, ref_logp)

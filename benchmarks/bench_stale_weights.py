"""How the weights of stale rows behave as completions grow: TRL's sequence-level engine
correction (``sequence_mask``: the product of per-token ratios over the completion, masked
above 3) against AReaL's token-level behaviour weight (``token_mask``: each token's ratio,
masked above 5), the two ``grpo_core.algorithm.importance`` offers for rows an older policy sampled.

Synthetic stale batches: per-token log-ratios ``log(pi_prox / mu)`` drawn with mean -s^2/2 and
variance s^2 = 2 x KL (E[w] = 1 per token, per-token KL about ``KL``), 256 rows of each length.
For each: the median weight, the effective sample size as a share of the rows (sequence) or
tokens (token level), the share of near-zero weights (< 0.01) and the share the cap masked.

    python benchmarks/bench_stale_weights.py [--kl 0.001 0.004 0.02] [--lengths 64 512 4096]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def batch(rows: int, tokens: int, kl: float, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    s2 = 2 * kl
    log_w = torch.randn(rows, tokens, generator=g) * s2**0.5 - s2 / 2  # [B, T]
    prox = -torch.rand(rows, tokens, generator=g) * 3  # [B, T]
    return prox, prox - log_w, torch.ones(rows, tokens)


def main(argv=None) -> None:
    from grpo_core.algorithm.importance import behaviour_weights, engine_importance_weights

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kl", type=float, nargs="*", default=[0.001, 0.004, 0.02])
    ap.add_argument("--lengths", type=int, nargs="*", default=[64, 512, 4096])
    ap.add_argument("--rows", type=int, default=256)
    args = ap.parse_args(argv)
    print("| per-token KL | tokens | weight | median | ESS / N | near zero | masked by the cap |")
    print("|---|---|---|---|---|---|---|")
    for kl in args.kl:
        for t in args.lengths:
            prox, samp, mask = batch(args.rows, t, kl)
            w, m = engine_importance_weights(prox, samp, mask, mode="sequence_mask")
            p = "sampling/importance_sampling_ratio"
            print(f"| {kl} | {t} | sequence_mask (TRL) | {w.median().item():.2e} | "
                  f"{m[p + '/ess']:.1%} | {m[p + '/near_zero_share']:.1%} | "
                  f"{m[p + '/clipped_share']:.1%} |")  # fmt: skip
            w, m = behaviour_weights(prox, samp, mask, mode="token_mask", cap=5.0)
            p = "sampling/behaviour_weight"
            print(f"| {kl} | {t} | token_mask (AReaL) | {w.median().item():.2e} | "
                  f"{m[p + '/ess']:.1%} | {m[p + '/near_zero_share']:.1%} | "
                  f"{m[p + '/capped_share']:.1%} |")  # fmt: skip


if __name__ == "__main__":
    main()

"""One optimizer step's metrics from those of its micro-batches (one process or N ranks)."""

from __future__ import annotations

SUMMED_METRICS = ("loss", "policy_loss")  # parts of one step's objective; the rest are means

# what a micro-batch whose rows all had a zero loss adds (grpo_core.algorithm.update, zero-gradient
# rows): nothing to the loss, no clipped token; its entropy comes with it
SKIPPED_METRICS = {
    "loss": 0.0,
    "policy_loss": 0.0,
    "clip_ratio/low_mean": 0.0,
    "clip_ratio/high_mean": 0.0,
    "clip_ratio/region_mean": 0.0,
}


def of_micro_batch(m: dict) -> dict:
    """A micro-batch's metrics, :data:`SKIPPED_METRICS` filled in for one marked skipped (its
    entropy, measured without grad, is kept)."""
    if not m.get("skipped"):
        return m
    return {**SKIPPED_METRICS, **{k: v for k, v in m.items() if k != "skipped"}}


def combine(micro_batches: list[dict]) -> dict:
    """Loss parts summed, other metrics averaged over the micro-batches that have them; a
    micro-batch marked ``{"skipped": True}`` counts as :data:`SKIPPED_METRICS`."""
    rows = [of_micro_batch(m) for m in micro_batches]
    out = {}
    for key in dict.fromkeys(k for m in rows for k in m):
        values = [m[key] for m in rows if key in m]
        out[key] = sum(values) if key in SUMMED_METRICS else sum(values) / len(values)
    return out


def ess_of_parts(parts) -> float:
    """``grpo_core.algorithm.importance.effective_sample_share`` from its ``ess_parts`` (summed over ranks; a tensor
    or its list)."""
    total, sq, n = (float(x) for x in parts)
    if n == 0:
        return 1.0
    return total**2 / (n * sq) if sq > 0 else 0.0

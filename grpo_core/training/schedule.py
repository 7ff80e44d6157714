"""Learning-rate schedules shared by SFT and the RL update (``torch.optim.lr_scheduler.LambdaLR``
multipliers)."""

from __future__ import annotations

import math
from collections.abc import Callable


def lr_lambda(warmup: int, total: int, kind: str = "constant") -> Callable[[int], float]:
    """Linear warmup over ``warmup`` steps, then constant, linear or cosine decay to 0 at
    ``total``."""

    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if kind == "constant" or total <= warmup:
            return 1.0
        frac = (step - warmup) / max(1, total - warmup)
        return max(0.0, 1 - frac) if kind == "linear" else 0.5 * (1 + math.cos(math.pi * frac))

    return f

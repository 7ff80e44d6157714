"""The warm policy: the model stays in the worker process between rollout, score and
update tasks. A task asking for a checkpoint gets the in-memory model when its weights are
that checkpoint (same ``policy_id``); otherwise it is loaded from disk. The optimizer (and
its state) travels with the warm model, and is restored from the checkpoint's trainer
state when the model comes from disk.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from grpo_core.checkpoint import load_checkpoint, load_trainer_state, policy_id
from grpo_core.engines import WarmEngines

if TYPE_CHECKING:  # torch loads with the first model: a cached rerun never needs it
    import torch

log = logging.getLogger(__name__)
_LOCK = threading.Lock()


@dataclass
class WarmPolicy:
    checkpoint: Path
    policy_id: str
    model: torch.nn.Module
    tokenizer: object
    optimizer: torch.optim.Optimizer | None = None
    optimizer_key: tuple | None = None
    extra: dict = field(default_factory=dict)


ENGINES = WarmEngines()  # rollout engines kept alive across iterations (weights synced in memory)
_WARM: dict[str, WarmPolicy] = {}  # slot ("policy", "reference") -> warm model
STATS = {"loads": 0, "hits": 0}


def get(checkpoint: str | Path, slot: str = "policy", *, mutate: bool = False) -> WarmPolicy:
    """The model of ``checkpoint``, from memory when it is already there.

    ``mutate=True`` (training): the entry leaves the cache until :func:`put` records the
    checkpoint its new weights were saved to, so a failed step never leaves a model
    labelled with weights it no longer has.
    """
    checkpoint = Path(checkpoint)
    pid = policy_id(checkpoint)
    with _LOCK:
        warm = _WARM.get(slot)
        if warm is not None and warm.policy_id == pid:
            STATS["hits"] += 1
            warm.checkpoint = checkpoint
            if mutate:
                del _WARM[slot]
            return warm
        model, tokenizer = load_checkpoint(checkpoint)
        model.eval()
        STATS["loads"] += 1
        log.info("loaded %s (%s) from disk into slot %s", checkpoint, pid, slot)
        warm = WarmPolicy(checkpoint, pid, model, tokenizer)
        if not mutate:
            _WARM[slot] = warm
        return warm


def put(checkpoint: str | Path, warm: WarmPolicy, slot: str = "policy") -> None:
    """Record that ``warm.model`` now holds the weights saved at ``checkpoint``."""
    with _LOCK:
        warm.checkpoint = Path(checkpoint)
        warm.policy_id = policy_id(checkpoint)
        _WARM[slot] = warm


def optimizer_for(
    warm: WarmPolicy, *, learning_rate: float, weight_decay: float
) -> torch.optim.Optimizer:
    """AdamW for the warm model; kept across RL iterations, restored from trainer state."""
    import torch

    key = (learning_rate, weight_decay)
    if warm.optimizer is None or warm.optimizer_key != key:
        opt = torch.optim.AdamW(
            warm.model.parameters(), lr=learning_rate, weight_decay=weight_decay
        )
        state = load_trainer_state(warm.checkpoint)
        if state and state.get("optimizer") and state.get("optimizer_key") == key:
            opt.load_state_dict(state["optimizer"])
        warm.optimizer, warm.optimizer_key = opt, key
    return warm.optimizer


def relabel(checkpoint: str | Path, slot: str = "policy") -> None:
    """Name ``checkpoint`` as the source of the warm model when it holds the same weights
    (a copy of the checkpoint it came from); loads nothing when no model is warm."""
    checkpoint = Path(checkpoint)
    with _LOCK:
        warm = _WARM.get(slot)
        if warm is not None and warm.policy_id == policy_id(checkpoint):
            warm.checkpoint = checkpoint


def clear() -> None:
    with _LOCK:
        _WARM.clear()

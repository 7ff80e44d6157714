"""How the GRPO update runs on one process or on N ranks: a strategy object handed to
``grpo_core.algorithm.update.grpo_update``, so the update has one code path.

:class:`LocalParallel` (the default) is one process: it changes nothing. The data-parallel
ranks' strategies (``grpo_core/training/distributed.py: DataParallel``, ``grpo_core/training/fsdp.py:
ShardedDataParallel``) implement the same methods with collectives: a rank trains its share
of every micro-batch's groups, all-reduces counts and gradients, and the N ranks make the
update of one process.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import Tensor

from grpo_core.training.step_metrics import combine


class LocalParallel:
    """One process: the whole batch, its own counts and gradients."""

    sharded: ClassVar[bool] = False  # parameters sharded over ranks (FSDP2)
    rank: ClassVar[int] = 0
    world_size: ClassVar[int] = 1

    def prepare(self, cfg):
        """The update's config as this strategy runs it (ranks refuse or turn off what their
        forward plan does not cover)."""
        return cfg

    def prepare_model(self, model: torch.nn.Module, *, lora: bool = False) -> bool:
        """Make ``model`` ready to train under this strategy (ranks: rank 0's weights on
        every rank, sharded with FSDP2); True when its parameters were replaced, so that an
        optimizer built on the old ones is stale. ``lora``: the model has a LoRA adapter."""
        return False

    def shard(self, batch, slices: list[Tensor]):
        return batch, slices

    def all_reduce_counts(self, tokens: Tensor, rows: list[int]) -> tuple[Tensor, list[int]]:
        return tokens, rows

    def importance_metrics(self, metrics: dict, tokens: float, ess=None) -> dict:
        return metrics

    def all_reduce_gradients(self, model: torch.nn.Module) -> None:
        return None

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> Tensor:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def step_metrics(self, window: list[dict], tokens: list[float]) -> dict:
        """One optimizer step's metrics from its micro-batches'."""
        return combine(window)

    def checkpoint_state(self, model: torch.nn.Module, train) -> tuple[dict, dict | None]:
        """What a checkpoint saves: ``train``'s (a ``grpo_core.training.train_state.TrainState``) state
        dict and the weights (``None``: the model's own state dict)."""
        return train.state_dict(), None

    def load_full_optimizer_state(self, model: torch.nn.Module, optimizer, state: dict) -> None:
        """A state saved by :meth:`checkpoint_state` into ``optimizer``."""
        optimizer.load_state_dict(state)

    def barrier(self) -> None:
        return None

    def row_share(self, n: int) -> range:
        """This rank's rows of a batch of ``n`` that every rank holds (SFT): all of them."""
        return range(n)

    def sum_scalar(self, x: float) -> float:
        """``x`` summed over the ranks (a loss made of the ranks' shares)."""
        return x


LOCAL = LocalParallel()


def ranks_prepare(cfg, *, skipped_entropy: bool = True):
    """What data-parallel ranks run of ``cfg``: a top-entropy token mask is refused; the
    entropy of skipped rows (a no-grad forward on each rank) is kept unless
    ``skipped_entropy`` is False (sharded ranks: extra forwards would have to be matched
    across ranks, so they report ``entropy/trained_rows`` instead)."""
    if cfg.top_entropy_quantile < 1.0:
        raise ValueError("top_entropy_quantile < 1 is not supported with data_parallel")
    if cfg.entropy_of_skipped_rows and not skipped_entropy:
        cfg = dataclasses.replace(cfg, entropy_of_skipped_rows=False)
    return cfg

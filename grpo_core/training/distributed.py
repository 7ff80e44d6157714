"""Data-parallel GRPO update over ``torch.distributed``: N ranks, one replica of the policy each.

What makes N processes give the update of one (``grpo_core.algorithm.update.grpo_update`` with
``data_parallel=``):

- the micro-batches are those of one process (same ``steps_per_generation`` plan over the
  *global* number of groups); each rank takes a contiguous share of the whole groups of every
  micro-batch (``tensor_split``: uneven shares differ by one group, a rank may get none);
- every rank computes the old / reference log-probs of its own rows only;
- each micro-batch's loss is divided by the normaliser of the *global* micro-batch (one
  all-reduce of the per-micro-batch token and sequence counts): ``dapo`` the whole generation
  batch's tokens, ``bnpo`` the micro-batch's tokens, ``grpo``/``dr_grpo`` its sequences, as
  ``grpo_core.algorithm.losses.step_normalisers``. A rank's loss is then its share of the sum, and
  the SUM of the ranks' gradients is the one-process gradient;
- gradients are summed once per optimizer step (as DDP under ``no_sync`` over the accumulation
  window), in flat buckets; clipping and the optimizer step then run on identical gradients on
  every rank, so the replicas stay equal. The module is not wrapped in torch's
  ``DistributedDataParallel``: a rank with no rows in a micro-batch skips its forward, which
  DDP's per-forward reducer does not allow;
- metrics are gathered and combined as one process computes them (token-weighted means, sums
  of the loss parts), so every rank reports the same numbers.

Launch: ``torchrun`` (env ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``) then
:func:`process_group`, or :func:`spawn` a function on N local processes (tests, benchmarks).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from grpo_core.contracts.batch import UpdateBatch
from grpo_core.training.parallel import LocalParallel, ranks_prepare
from grpo_core.training.step_metrics import SUMMED_METRICS, combine, ess_of_parts, of_micro_batch

BUCKET_ELEMENTS = 25_000_000  # gradient elements per all-reduce (DDP's 25 MB-ish buckets)


@dataclass
class DataParallel(LocalParallel):
    """This process's place in a data-parallel group; the collectives the update needs."""

    group: dist.ProcessGroup | None = None  # None: the default (world) group
    sharded: ClassVar[bool] = (
        False  # FSDP2 (grpo_core/training/fsdp.py): parameters sharded over ranks
    )

    def prepare(self, cfg):
        return ranks_prepare(cfg)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def device(self) -> torch.device:
        """Where this backend's collectives take tensors (nccl: this rank's GPU)."""
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def shard(self, batch: UpdateBatch, slices: list[Tensor]) -> tuple[UpdateBatch, list[Tensor]]:
        """This rank's rows: a contiguous share of the whole groups of each micro-batch.
        Returns the local batch and the micro-batches' row indices into it (possibly empty)."""
        dev = batch.device
        gids = (
            batch.group_ids if batch.group_ids is not None else torch.arange(batch.size, device=dev)
        )
        mine = []
        for idx in slices:
            groups = torch.unique_consecutive(gids[idx])  # [g] in row order
            part = torch.tensor_split(groups, self.world_size)[self.rank]
            mine.append(idx[torch.isin(gids[idx], part)])
        rows = torch.cat(mine) if mine else torch.zeros(0, dtype=torch.long, device=dev)
        bounds = [0]
        for m in mine:
            bounds.append(bounds[-1] + len(m))
        local = [torch.arange(bounds[j], bounds[j + 1], device=dev) for j in range(len(mine))]
        return batch.slice(rows), local

    def all_reduce_counts(self, tokens: Tensor, rows: list[int]) -> tuple[Tensor, list[int]]:
        """The global micro-batches' completion tokens and sequences from this rank's share
        (summed over the ranks), for ``grpo_core.algorithm.losses.step_normalisers``."""
        seqs = torch.tensor(rows, dtype=torch.float64, device=tokens.device)
        counts = torch.stack([tokens.double(), seqs], 1)
        counts = counts.reshape(-1, 2).to(self.device)  # [J, 2]: tokens, sequences
        dist.all_reduce(counts, group=self.group)
        counts = counts.to(tokens.device)  # back where the batch lives (the model's device)
        return counts[:, 0].to(torch.float32), [int(r) for r in counts[:, 1].tolist()]

    def all_reduce_gradients(self, model: torch.nn.Module) -> None:
        """Sum the ranks' gradients in place. A parameter that got a gradient on some rank gets
        the sum on all (zeros where absent); one that got none anywhere keeps ``None``, as in
        one process (so weight decay does not touch it)."""
        self.sum_gradients(self.fill_missing_gradients(model))

    def fill_missing_gradients(self, model: torch.nn.Module) -> list[torch.nn.Parameter]:
        """Zero gradients on this rank for the parameters that got one on some rank; returns
        the parameters that have a gradient now (on every rank alike)."""
        params = [p for p in model.parameters() if p.requires_grad]
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
        has = has.to(self.device)
        dist.all_reduce(has, group=self.group)
        params = [p for p, h in zip(params, has.cpu().tolist(), strict=True) if h]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return params

    def sum_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """All-reduce (sum) ``params``' gradients, in flat buckets."""
        buckets: dict[tuple, list[list[Tensor]]] = {}
        for p in params:
            key = (p.grad.dtype, p.grad.device)
            runs = buckets.setdefault(key, [[]])
            if sum(g.numel() for g in runs[-1]) + p.grad.numel() > BUCKET_ELEMENTS and runs[-1]:
                runs.append([])
            runs[-1].append(p.grad)
        for runs in buckets.values():
            for grads in runs:
                flat = torch.cat([g.reshape(-1) for g in grads])  # [sum numel]
                dist.all_reduce(flat, group=self.group)
                offset = 0
                for g in grads:
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()

    def prepare_model(self, model: torch.nn.Module, *, lora: bool = False) -> bool:
        self.broadcast_parameters(model)  # replicas start from rank 0's weights
        return False

    def broadcast_parameters(self, model: torch.nn.Module) -> None:
        """Rank 0's parameters and buffers to every rank (replicas start equal)."""
        with torch.no_grad():
            for t in model.state_dict().values():
                if t.device.type == "cpu" and self.device.type == "cuda":
                    buf = t.to(self.device)
                    dist.broadcast(buf, src=0, group=self.group)
                    t.copy_(buf.cpu())
                else:
                    dist.broadcast(t, src=0, group=self.group)

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def row_share(self, n: int) -> range:
        """This rank's contiguous share of a batch of ``n`` rows that every rank holds."""
        bounds = [len(part) for part in torch.tensor_split(torch.arange(n), self.world_size)]
        start = sum(bounds[: self.rank])
        return range(start, start + bounds[self.rank])

    def sum_scalar(self, x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.group)
        return float(t.item())

    def gather(self, obj) -> list:
        """Every rank's ``obj`` (small Python objects: metrics), in rank order."""
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def step_metrics(self, window: list[dict], tokens: list[float]) -> dict:
        """One optimizer step's metrics as one process reports them. ``window``: this rank's
        metrics of each micro-batch (``{}`` when it had no rows), ``tokens``: its completion
        tokens in each. Loss parts are summed over ranks, other metrics are means over the
        micro-batch's tokens (the ranks' means weighted by their tokens)."""
        ranks = self.gather(list(zip(window, tokens, strict=True)))
        merged = []
        for j in range(len(window)):
            # (metrics, tokens) of the ranks with rows; a rank that skipped all of them adds
            # no loss and no clipped token (grpo_core.training.step_metrics)
            parts = [(of_micro_batch(m), t) for m, t in (r[j] for r in ranks) if m]
            out = {}
            for key in dict.fromkeys(k for m, _ in parts for k in m):
                values = [(m[key], t) for m, t in parts if key in m]
                if key in SUMMED_METRICS:
                    out[key] = sum(v for v, _ in values)
                else:
                    weight = sum(t for _, t in values)
                    out[key] = (
                        sum(v * t for v, t in values) / weight
                        if weight
                        else sum(v for v, _ in values) / len(values)
                    )
            merged.append(out)
        return combine(merged)

    def importance_metrics(self, metrics: dict, tokens: float, ess=None) -> dict:
        """``engine_importance_weights``' and ``behaviour_weights``' metrics over every rank:
        min of mins, max of maxes, token-weighted means (sequence-level means are weighted by
        tokens too: approximate), and the ESS of the whole batch from every rank's ``ess``
        (``grpo_core.algorithm.importance.ess_parts``: sums, not a mean of the ranks' ESS)."""
        # a collective every rank runs (a rank without weights adds zeros), before the gather
        parts = torch.zeros(3, dtype=torch.float64, device=self.device)
        if ess is not None:
            parts += ess.detach().to(self.device, torch.float64)
        dist.all_reduce(parts, group=self.group)
        sums = parts.tolist()  # [sum w, sum w^2, n] of the whole batch
        whole = ess_of_parts(sums) if sums[2] > 0 else None
        ranks = [(m, t) for m, t in self.gather((metrics, tokens)) if m]
        if not ranks:
            return {}
        out = {}
        for key in ranks[0][0]:
            values = [(m[key], t) for m, t in ranks]
            if key.endswith("/min"):
                out[key] = min(v for v, _ in values)
            elif key.endswith("/max"):
                out[key] = max(v for v, _ in values)
            elif key.endswith("/ess") and whole is not None:
                out[key] = whole
            else:
                weight = sum(t for _, t in values) or 1.0
                out[key] = sum(v * t for v, t in values) / weight
        return out


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


@contextmanager
def process_group(
    backend: str | None = None, strategy: str = "ddp", param_dtype: str | None = None
) -> Iterator[DataParallel]:
    """Join the process group that ``torchrun`` (or :func:`spawn`) describes in the
    environment; destroy it on exit. nccl: this rank's GPU is ``LOCAL_RANK``. ``strategy``:
    ``ddp`` (replicas) or ``fsdp`` (:class:`grpo_core.training.fsdp.ShardedDataParallel`, its layers
    all-gathered in ``param_dtype``)."""
    missing = [
        k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
    ]
    if missing:
        raise RuntimeError(
            f"no process group described: environment variable(s) {missing} unset; "
            "launch with torchrun --nproc-per-node N (or grpo_core.training.distributed.spawn)"
        )
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    try:
        yield make_data_parallel(strategy, param_dtype=param_dtype)
    finally:
        dist.destroy_process_group()


def make_data_parallel(
    strategy: str = "ddp", group=None, param_dtype: str | None = None
) -> DataParallel:
    """This rank's :class:`DataParallel` for ``strategy`` (``ddp`` or ``fsdp``; ``fsdp``
    all-gathers its layers in ``param_dtype``, default the weights' own)."""
    if strategy == "fsdp":
        from grpo_core.training.fsdp import ShardedDataParallel

        return ShardedDataParallel(group, param_dtype=param_dtype)
    if strategy != "ddp":
        raise ValueError(f"unknown data-parallel strategy {strategy!r}; expected ddp or fsdp")
    return DataParallel(group)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world_size: int, port: int, backend: str, args: tuple):
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    with process_group(backend) as dp:
        fn(dp, *args)


def spawn(fn: Callable, world_size: int, *args, backend: str = "gloo") -> None:
    """Run ``fn(data_parallel, *args)`` on ``world_size`` new local processes (a free port on
    127.0.0.1); returns when all have finished, raises if one failed. ``fn`` must be
    importable by name (a module-level function)."""
    import torch.multiprocessing as mp

    mp.spawn(_entry, args=(fn, world_size, free_port(), backend, args), nprocs=world_size)

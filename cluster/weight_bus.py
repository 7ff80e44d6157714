"""Device-to-device weight sync: trainer rank 0 broadcasts a new policy to the rollout replicas.

With ``cluster.rollout.weight_sync: broadcast`` (``auto``, the default: when both roles have
GPUs), the replicas do not read the checkpoint the trainer group wrote: trainer rank 0 and
every replica join one process group of their own (the *bus*: rank 0 the trainer, rank k the replica k-1), apart from the
trainer ranks' data-parallel group, and rank 0 broadcasts the weights it trained, from its
device to theirs: NCCL when both roles have GPUs, gloo otherwise. This is the scheme of
vLLM's NCCL weight-transfer engine and of verl / OpenRLHF (a stateless group between the
trainer and the inference workers); the driver only describes the tensors and starts both
sides, and never holds a weight.

The tensors go in *buckets*: consecutive tensors of one dtype packed into one flat buffer of
at most ``bucket_bytes`` (``cluster.rollout.weight_sync_bucket_mb``), one broadcast each, so
a model of many small tensors costs few collectives and a receiver holds one bucket at a
time beyond its own weights. With FSDP every trainer rank walks the same tensors and gathers
each sharded one (``DTensor.full_tensor``, a collective), and rank 0 sends it: a rank holds
one full tensor and one bucket at a time.

The names are the checkpoint's (``grpo_core.training.weights_id.savable_state_dict``: a LoRA policy's
merged weights, without tied copies), so what a replica receives is exactly what it would
have read from the checkpoint: the ``policy_id`` it then holds is the same.

Ray is not imported here: the driver side is ``cluster/rollout_workers.py``."""

from __future__ import annotations

import dataclasses
import datetime
import logging
from collections.abc import Callable, Iterable, Iterator

import torch

log = logging.getLogger(__name__)

TIMEOUT_S = 300.0  # how long a bus member waits for the others (joining, each broadcast)
_BUS: dict[str, Bus] = {}  # this process's bus (trainer rank 0 or a replica), by its key


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of the policy: its checkpoint name, shape and dtype (``torch.float32``'s
    name ``"float32"``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


def buckets(entries: Iterable[Entry], bucket_bytes: int) -> list[list[Entry]]:
    """``entries`` in order, cut into runs of one dtype of at most ``bucket_bytes`` each (a
    larger tensor is a bucket of its own)."""
    out: list[list[Entry]] = []
    size = 0
    for e in entries:
        if not out or out[-1][0].dtype != e.dtype or size + e.nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(e)
        size += e.nbytes
    return out


def describe(state: dict[str, torch.Tensor]) -> list[Entry]:
    """The entries of a state dict (a DTensor's full shape)."""
    return [Entry(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items()]


class Bus:
    """One member of a bus: a process group of its own (``TCPStore`` at rank 0's address and
    port; ``ProcessGroupGloo`` or ``ProcessGroupNCCL``), outside ``torch.distributed``'s
    default group, which the trainer ranks use for their data parallelism."""

    def __init__(self, addr: str, port: int, rank: int, world: int, backend: str) -> None:
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=TIMEOUT_S)
        self.rank, self.world, self.backend = rank, world, backend
        self.store = dist.TCPStore(addr, port, world, is_master=rank == 0, timeout=timeout)
        store = dist.PrefixStore("weight_bus", self.store)
        if backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.group = dist.ProcessGroupNCCL(store, rank, world)
        else:
            self.device = torch.device("cpu")
            self.group = dist.ProcessGroupGloo(store, rank, world, timeout)

    def broadcast(self, flat: torch.Tensor) -> None:
        self.group.broadcast([flat], dist_opts(root=0)).wait()


def dist_opts(root: int):
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = root
    return opts


def join(key: str, addr: str, port: int, rank: int, world: int, backend: str) -> None:
    """Make this process member ``rank`` of the bus ``key`` (an older bus of it is dropped)."""
    _BUS.clear()
    _BUS[key] = Bus(addr, port, rank, world, backend)
    log.info("joined weight bus %s as rank %d of %d (%s)", key, rank, world, backend)


def member(key: str) -> Bus:
    bus = _BUS.get(key)
    if bus is None:
        raise RuntimeError(f"this process is not on weight bus {key} (it was replaced)")
    return bus


def send(
    key: str | None, tensors: Iterator[tuple[str, torch.Tensor]], plan: list[list[Entry]]
) -> int:
    """Broadcast ``tensors`` (in ``plan``'s order) as ``plan``'s buckets; returns the bytes
    sent. ``key`` None: walk the tensors only (an FSDP rank other than 0 takes part in each
    gather and sends nothing)."""
    bus = member(key) if key is not None else None
    sent = 0
    for bucket in plan:
        parts = []
        for e in bucket:
            name, t = next(tensors)
            if name != e.name:
                raise RuntimeError(f"weight bus: sending {name} where the plan has {e.name}")
            if bus is not None:
                parts.append(t.detach().to(bus.device, getattr(torch, e.dtype)).reshape(-1))
        if bus is not None:
            flat = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
            bus.broadcast(flat)
            sent += flat.numel() * flat.element_size()
    return sent


def receive(
    key: str, plan: list[list[Entry]], take: Callable[[list[tuple[str, torch.Tensor]]], None]
) -> int:
    """Receive ``plan``'s buckets from rank 0 and hand each one's tensors (views of the
    bucket, on this member's device) to ``take``; returns the bytes received. When ``take``
    fails, the remaining buckets are still received (rank 0 would otherwise wait for this
    member until the timeout) and the first error is raised at the end."""
    bus = member(key)
    got, failed = 0, None
    for bucket in plan:
        dtype = getattr(torch, bucket[0].dtype)
        flat = torch.empty(sum(e.numel for e in bucket), dtype=dtype, device=bus.device)
        bus.broadcast(flat)
        views, offset = [], 0
        for e in bucket:
            views.append((e.name, flat[offset : offset + e.numel].view(e.shape)))
            offset += e.numel
        if failed is None:
            try:
                take(views)
            except Exception as e:  # noqa: BLE001 - raised once the sender is done
                failed = e
        got += flat.numel() * flat.element_size()
    if failed is not None:
        raise failed
    return got


# --- the trainer ranks' side (functions the trainer group runs: fn(data_parallel, **kw)) ---


def _trained(policy_id: str):
    """The model this trainer rank's learner holds with the weights ``policy_id``, else None
    (cluster/policies.py)."""
    from cluster import runtime

    return runtime.executor().policies.holding(policy_id)


def _rank(data_parallel) -> int:
    return 0 if data_parallel is None else data_parallel.rank


def _tensors(model) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors of ``model``, a sharded one gathered whole (every rank)."""
    from torch.distributed.tensor import DTensor

    from grpo_core.training.weights_id import savable_state_dict

    for name, t in savable_state_dict(model).items():
        yield name, (t.full_tensor() if isinstance(t, DTensor) else t)


def describe_on_rank(data_parallel, *, policy_id: str) -> list[Entry] | None:
    """Rank 0: the entries of ``policy_id``'s tensors when every rank holds that policy
    (else None: the replicas read the checkpoint). A LoRA policy sharded by FSDP is not
    sent (its merged weights are computed from unsharded tensors only)."""
    from grpo_core.training import lora

    model = _trained(policy_id)
    here = model is not None and not (
        lora.is_peft(model) and data_parallel is not None and data_parallel.sharded
    )
    if data_parallel is not None and data_parallel.world_size > 1:
        here = all(data_parallel.gather(here))
    if not here or _rank(data_parallel) != 0:
        return None
    from grpo_core.training.weights_id import savable_state_dict

    return describe(savable_state_dict(model))


def join_on_rank(data_parallel, *, key: str, addr: str, port: int, world: int, backend: str):
    """Rank 0 joins the bus as its rank 0 (the sender); the other ranks are not members."""
    if _rank(data_parallel) == 0:
        join(key, addr, port, 0, world, backend)


def send_on_rank(data_parallel, *, key: str, policy_id: str, plan: list[list[Entry]]) -> int:
    """Every rank walks ``policy_id``'s tensors (gathering the sharded ones); rank 0
    broadcasts them on the bus. Returns the bytes sent (rank 0)."""
    model = _trained(policy_id)
    if model is None:
        raise RuntimeError(f"weight bus: this trainer rank no longer holds policy {policy_id}")
    with torch.no_grad():
        return send(key if _rank(data_parallel) == 0 else None, _tensors(model), plan)

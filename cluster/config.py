"""The ``cluster:`` config section: where rollouts, scoring and the GRPO update run.

``backend: local`` (the default) is one process, as every command has always run. ``ray``
runs the roles below as Ray workers on the cluster at ``address`` (``auto``: the one this
machine belongs to; ``ray://host:port``: a remote head through Ray Client), or on a local
Ray started for the run when ``address`` is empty."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from grpo_core.config.section import Section


class WorkerSettings(Section):
    """How many workers a role gets and what each one reserves on the cluster."""

    workers: int = Field(1, ge=1, description="Ray workers (actors or tasks) for this role")
    num_cpus: float = Field(1.0, ge=0, description="CPUs each worker reserves")
    num_gpus: float = Field(0.0, ge=0, description="GPUs each worker reserves")


PLACEMENT = (
    "how the role's actors are placed over the cluster's nodes: pack (as few nodes as "
    "hold them, Ray's PACK) or spread (as many as can, Ray's SPREAD); on one node the same"
)


class RolloutSettings(WorkerSettings):
    """The rollout replicas, and how a new policy reaches them."""

    placement: Literal["pack", "spread"] = Field(
        "spread",
        description=PLACEMENT + ". Replicas never talk to each other: spread gives each its "
        "node's memory bandwidth, and a lost node takes fewer of them",
    )

    weight_sync: Literal["auto", "broadcast", "checkpoint"] = Field(
        "auto",
        description="broadcast: trainer rank 0 sends a new policy to the replicas over a "
        "process group of their own, device to device (NCCL when both roles have GPUs, else "
        "gloo; cluster/weight_bus.py); checkpoint: each replica reads the checkpoint the "
        "trainer group wrote; auto: broadcast when the trainer ranks and the replicas have "
        "GPUs, else checkpoint (on CPU a local file read beats gloo over TCP)",
    )
    weight_sync_bucket_mb: int = Field(
        256, ge=1, description="broadcast: tensors are packed into buffers of at most this size"
    )


class TrainerSettings(WorkerSettings):
    """The trainer role's workers and how its ranks train together."""

    placement: Literal["pack", "spread"] = Field(
        "pack",
        description=PLACEMENT + ". The ranks all-reduce every step: pack keeps that inside a "
        "node where the ranks fit (a larger group still spans nodes); spread puts them on "
        "different nodes, each with its own memory, at the price of the network",
    )

    dist_backend: Literal["gloo", "nccl"] = Field(
        "gloo", description="torch.distributed backend of the trainer ranks (nccl on GPUs)"
    )
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="ddp: a full replica of the policy per rank; fsdp: the decoder layers "
        "sharded over the ranks with FSDP2 (parameters, gradients, AdamW state)",
    )
    fsdp_param_dtype: Literal["bfloat16", "float32"] | None = Field(
        None,
        description="strategy fsdp: the dtype a layer is all-gathered and computed in (FSDP2 "
        "MixedPrecisionPolicy; shards, AdamW state and the gradient reduction stay float32); "
        "bfloat16 halves the all-gathers' bytes (with rl.bf16); None: the weights' dtype",
    )
    max_restarts: int = Field(
        1,
        ge=0,
        description="times one update (or SFT) starts a new trainer group after a rank died "
        "(killed, out of memory, its node lost) and redoes the work: the new ranks load the "
        "policy it starts from again (its kept checkpoint and train state, else replayed from "
        "the iteration records), so the run ends with the weights it would have had; a rank "
        "that raises is not retried. 0: the run stops with one line, and a rerun continues",
    )


class ClusterConfig(Section):
    backend: Literal["local", "ray"] = "local"
    address: str | None = Field(
        None, description="auto, ray://host:port, or empty to start a local Ray for the run"
    )
    num_cpus: int | None = Field(
        None, ge=1, description="CPUs of the local Ray started when address is empty"
    )
    rollout: RolloutSettings = RolloutSettings()
    trainer: TrainerSettings = TrainerSettings()
    scoring: WorkerSettings = WorkerSettings()

    @property
    def uses_ray(self) -> bool:
        return self.backend == "ray"

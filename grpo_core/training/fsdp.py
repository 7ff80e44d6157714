"""FSDP2 for the data-parallel GRPO update (``cluster.trainer.strategy: fsdp``): the decoder
layers sharded over the ranks with torch's ``fully_shard``, so each rank holds 1/N of their
parameters, gradients and AdamW state; N ranks still make the update of one process.

What differs from :class:`~grpo_core.training.distributed.DataParallel` (replicas):

- every decoder layer is an FSDP2 unit (``model._no_split_modules``, Hugging Face's list of
  the layer classes), and the model is the root unit that holds the rest (embeddings, final
  norm, LM head; tied weights stay one parameter): every parameter is sharded, and the
  layers' all-gathers overlap the compute of the one before as the root schedules them
  (torch's implicit prefetch). The chunked LM head (grpo_core/logprobs/model.py) runs the
  decoder and the head outside the model's forward, so it is bound to the model and
  registered as one of its forwards (``register_fsdp_forward_method``): the root's
  parameters are gathered around it and its gradients reduce-scattered after backward;
- a sharded layer all-gathers its parameters in every forward and reduce-scatters its
  gradients in every backward, so every rank must run as many forwards (and backwards) as
  the others, in the same order: the ranks agree on the number of forwards of the old
  log-prob pass and of each micro-batch before running them, and a rank with fewer rows, or
  none, makes up the difference with forwards of one padding token whose loss is 0
  (:meth:`ShardedDataParallel.pad_to`);
- the reduce-scatter sums (gradient divide factor 1) instead of averaging: each rank's loss
  is already its share of the global micro-batch's loss (global-batch normalisers);
- gradient clipping: the global norm over the shards (all-reduced; parameters left
  replicated, if any, counted once).

Tested on CPU with gloo and 2 processes (tests/distributed/test_fsdp_parity.py): the weights
after an update equal the one-process weights within fp32 tolerance for every ``loss_type``.
Not run here: GPUs and nccl, mixed-precision policies, a sharded reference model (with
``beta > 0`` each rank holds a full reference model), CPU offload.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from grpo_core.training.distributed import DataParallel
from grpo_core.training.parallel import ranks_prepare


def decoder_layers(model) -> list[torch.nn.Module]:
    """The model's repeated blocks: modules whose class Hugging Face lists in
    ``_no_split_modules`` (``Qwen2DecoderLayer``, ...)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(model).__name__}: no decoder layers to shard (the model's "
            f"_no_split_modules {sorted(names)} names no module class it has)"
        )
    return layers


@dataclass
class ShardedDataParallel(DataParallel):
    """A :class:`DataParallel` rank whose model's decoder layers are sharded (:meth:`wrap`)."""

    sharded: ClassVar[bool] = True
    param_dtype: str | None = None  # the layers' all-gather/compute dtype (None: the weights')
    forwards: int = 0  # sharded forwards since the last pad_to
    _hooked: list = field(default_factory=list)

    def prepare(self, cfg):
        """As the replicas' (:meth:`DataParallel.prepare`); fp16 is refused: its loss scaler
        would check only this rank's shards for inf/nan, so ranks could disagree on skipping
        a step (bf16 needs no scaler)."""
        if cfg.fp16:
            raise ValueError(
                "rl.fp16 with cluster.trainer.strategy: fsdp is not supported (the loss "
                "scaler is not sharded); use rl.bf16"
            )
        return ranks_prepare(cfg, skipped_entropy=False)

    def prepare_model(self, model: torch.nn.Module, *, lora: bool = False) -> bool:
        """Shard the model's decoder layers the first time this rank trains it (a reloaded
        model is sharded again: True, its optimizer state must be rebuilt)."""
        if self.is_wrapped(model):
            return False
        if lora:
            raise ValueError(
                "cluster.trainer.strategy: fsdp does not shard LoRA adapters; use strategy: ddp "
                "with model.lora"
            )
        self.broadcast_parameters(model)  # equal weights on every rank before sharding
        self.wrap(model)
        return True

    def wrap(self, model) -> None:
        """Shard ``model``'s decoder layers in place over this group (call on every rank,
        with equal weights: after :meth:`broadcast_parameters`)."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        from grpo_core.logprobs.model import HEAD_METHOD, chunked_head_reason, head_logprobs

        chunked_head_reason(model)  # probed whole (equal weights on every rank), then cached
        mesh = DeviceMesh.from_group(self.group or dist.group.WORLD, self.device.type)
        for unit in [*decoder_layers(model), model]:  # the layers, then the root: the rest
            fully_shard(unit, mesh=mesh, reshard_after_forward=True, **self._mp())
            unit.set_gradient_divide_factor(1.0)  # sum: the losses are global shares
            unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
        # the chunked LM head reads the decoder and the head outside the model's forward:
        # bound as a forward of the root, it runs with the root's parameters gathered
        setattr(model, HEAD_METHOD, types.MethodType(head_logprobs, model))
        register_fsdp_forward_method(model, HEAD_METHOD)
        # one forward of the decoder is one sharded forward of every unit; a hook on a layer
        # would also count its recomputation in backward (gradient checkpointing)
        self._hooked = [model.get_decoder().register_forward_pre_hook(self._count)]
        self.forwards = 0
        if self.param_dtype is not None:  # the auto rules see the compute dtype (checkpoint.py)
            from grpo_core.training.checkpoint import COMPUTE_DTYPE_ATTR

            setattr(model, COMPUTE_DTYPE_ATTR, self.param_dtype)

    def _mp(self) -> dict:
        """``fully_shard``'s mixed-precision policy: layers gathered and run in
        ``param_dtype``, gradients reduce-scattered in float32 into float32 shards."""
        if self.param_dtype is None:
            return {}
        from torch.distributed.fsdp import MixedPrecisionPolicy

        dtype = getattr(torch, self.param_dtype)
        return {"mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)}

    def _count(self, module, args) -> None:
        self.forwards += 1

    def agree(self, counts: list[int]) -> list[int]:
        """The busiest rank's count of each entry (an element-wise max over the ranks)."""
        t = torch.tensor(counts or [0], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.cpu().tolist()[: len(counts)]

    def pad_to(self, model, target: int, *, grad: bool) -> None:
        """Forwards of one padding token (and backwards of their zero loss, when ``grad``)
        until this rank has run ``target`` sharded forwards since the last call: every rank
        then has run the same collectives in the same order. ``target`` comes from
        :meth:`agree`, before any of the forwards it counts."""
        missing = target - self.forwards
        if missing < 0:
            raise RuntimeError(
                f"rank {self.rank} ran {self.forwards} sharded forwards where {target} were "
                "planned: the ranks' collectives no longer match"
            )
        device = next(model.parameters()).device
        ids = torch.zeros((1, 1), dtype=torch.long, device=device)
        for _ in range(missing):
            with torch.set_grad_enabled(grad):  # the root's forward: every unit takes part
                out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
                if grad:
                    (out.logits.sum() * 0.0).backward()
        self.forwards = 0

    def all_reduce_gradients(self, model: torch.nn.Module) -> None:
        """Sum the replicated parameters' gradients; the sharded ones were reduce-scattered
        (summed) in each backward. A rank whose shard got no gradient (no backward on any
        rank in the step, while another rank zeroed its skipped rows' gradients) gets zeros,
        as the replicated parameters do."""
        params = self.fill_missing_gradients(model)
        self.sum_gradients([p for p in params if not isinstance(p, DTensor)])

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        """``clip_grad_norm_`` over the whole model: squared norms of this rank's shards,
        all-reduced, plus those of the replicated gradients (equal on every rank)."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        sharded = torch.zeros((), dtype=torch.float64, device=self.device)
        replicated = torch.zeros((), dtype=torch.float64, device=self.device)
        for g in grads:
            if isinstance(g, DTensor):
                sharded += g.to_local().double().pow(2).sum().to(self.device)
            else:
                replicated += g.double().pow(2).sum().to(self.device)
        dist.all_reduce(sharded, group=self.group)
        total = (sharded + replicated).sqrt().float()
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            local = g.to_local() if isinstance(g, DTensor) else g
            local.mul_(coef.to(local.device, local.dtype))
        return total

    def checkpoint_state(self, model, train) -> tuple[dict, dict]:
        """The optimizer state and the weights unsharded, on rank 0's CPU (collectives: every
        rank calls it; the other ranks get empty dicts, as only rank 0 writes the
        checkpoint)."""
        state = train.state_dict()
        state["optimizer"] = self.full_optimizer_state(model, train.optimizer)
        return state, self.full_state_dict(model)

    def full_state_dict(self, model, *, all_ranks: bool = False) -> dict[str, torch.Tensor]:
        """Every parameter and buffer, unsharded, on rank 0's CPU (``all_ranks``: on every
        rank's). A collective. Gathered one tensor at a time and moved to the CPU at once
        (``cpu_offload``), so a rank's device holds its shards plus one full tensor, never
        the whole model; the other ranks drop each tensor once gathered."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        from grpo_core.training.weights_id import retie

        opts = StateDictOptions(full_state_dict=True, cpu_offload=not all_ranks)
        state = get_model_state_dict(model, options=opts)
        # gathered copies: tied weights (one sharded parameter) come back as two tensors
        return retie(model, {k: v.cpu() for k, v in state.items()})

    def full_optimizer_state(self, model, optimizer) -> dict:
        """The optimizer's state unsharded, keyed by parameter name, on rank 0's CPU (empty on
        the others; a collective, one tensor at a time as :meth:`full_state_dict`)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(model, optimizer, options=opts)

    def load_full_optimizer_state(self, model, optimizer, state: dict) -> None:
        """:meth:`full_optimizer_state`'s dict into this rank's shards (a collective)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=opts)

    @staticmethod
    def is_wrapped(model) -> bool:
        from torch.distributed.fsdp import FSDPModule

        return any(isinstance(m, FSDPModule) for m in model.modules())

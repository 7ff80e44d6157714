"""One rollout replica: a Ray actor (``ray.remote(Replica)``) holding a rollout engine.

It starts from a checkpoint and takes later policies three ways: the driver's weights through
Ray's object store (:meth:`Replica.load_weights`, when the driver holds the model: the sync
probe), a checkpoint the trainer group wrote (:meth:`Replica.load_checkpoint`), or trainer
rank 0's broadcast on the weight bus (:meth:`Replica.receive_weights`,
cluster/weight_bus.py). A vLLM replica with ``lora_sync: adapter`` starts on the LoRA base
and takes each checkpoint's ``adapter/`` folder as a LoRA request instead. Ray is never
imported here: cluster/rollout_workers.py makes the actors."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from cluster.config import RolloutSettings

if TYPE_CHECKING:
    from grpo_core.engines.generation import Sample
    from grpo_core.engines.turns import SampleRequest


class Replica:
    """One rollout engine in a Ray actor (made with ``ray.remote(Replica)``)."""

    def __init__(
        self,
        checkpoint: str,
        policy_id: str,
        engine: str,
        engine_options: Mapping | None,
        load_options: Mapping | None,
        tokenizer,
    ) -> None:
        from cluster import storage
        from grpo_core.engines import get_engine

        storage.pull(checkpoint)  # a node without the run folder: from the shared store
        self.engine_name = engine
        opts = dict(engine_options or {})
        self.base_id: str | None = None  # adapter sync: the policy id of the engine's base
        if engine == "hf":
            from grpo_core.training.checkpoint import load_checkpoint

            model, tokenizer = load_checkpoint(checkpoint, **dict(load_options or {}))
            model.eval()
            self.engine = get_engine("hf", model=model, tokenizer=tokenizer, **opts)
        elif takes_adapters(opts):
            self._start_on_base(engine, checkpoint, policy_id, tokenizer, opts)
        else:
            self.engine = get_engine(engine, checkpoint=checkpoint, tokenizer=tokenizer, **opts)
        self.policy_id = policy_id

    def _start_on_base(self, engine, checkpoint: str, policy_id: str, tokenizer, opts) -> None:
        """``lora_sync: adapter``: the engine starts on the base of ``checkpoint``'s adapter
        (``checkpoint`` itself when it has none) and takes the adapter as a LoRA request."""
        from pathlib import Path

        from cluster import storage
        from grpo_core.engines import get_engine
        from grpo_core.training import lora

        saved = lora.saved_base(checkpoint)
        base, self.base_id = saved if saved else (checkpoint, policy_id)
        storage.pull(base)
        self.engine = get_engine(engine, checkpoint=base, tokenizer=tokenizer, **opts)
        if saved:
            self.engine.use_adapter(Path(checkpoint) / lora.ADAPTER_DIR)

    def generate(self, prompt_ids: list[list[int]], request: SampleRequest) -> list[Sample]:
        """This shard's episodes, through the turn loop (grpo_core/engines/turns.py)."""
        self.engine.wake_up()
        samples = request.run(self.engine, prompt_ids, progress=False)
        self.engine.sleep()
        return samples

    def load_weights(self, state_dict: Mapping, policy_id: str, probe: list[int] | None):
        """Take the driver's weights; with ``probe``, return the greedy probe completion.
        A sleeping engine wakes its weights only (its KV cache waits for the next generate)."""
        self.engine.wake_up(tags=["weights"])
        self.engine.update_weights(state_dict)
        self.policy_id = policy_id
        out = None
        if probe is not None:
            self.engine.wake_up()
            out = self._greedy(probe)
        self.engine.sleep()
        return out

    def load_checkpoint(self, checkpoint: str, policy_id: str) -> bool:
        """Take the weights of ``checkpoint`` (the trainer group wrote it; pulled from the
        shared store on a node without the run folder): the driver holds no copy to send.
        With adapter sync, its adapter (:meth:`_take_adapter`); False: start me again."""
        from cluster import storage

        storage.pull(checkpoint)
        if self.base_id is not None:
            return self._take_adapter(checkpoint, policy_id)
        self.engine.wake_up(tags=["weights"])
        if self.engine_name == "hf":
            from grpo_core.training.train_state import load_weights_

            load_weights_(self.engine.model, checkpoint)  # in place, the model's own dtype
        else:
            from grpo_core.training.checkpoint import load_checkpoint

            model, _ = load_checkpoint(checkpoint, device="cpu")
            self.engine.update_weights(model.state_dict())
            del model
        self.policy_id = policy_id
        self.engine.sleep()
        return True

    def _take_adapter(self, checkpoint: str, policy_id: str) -> bool:
        """``lora_sync: adapter``: ``checkpoint``'s adapter when it sits on this engine's
        base, the base alone when ``checkpoint`` is the base; False for another base (the
        caller starts this replica again from ``checkpoint``)."""
        from pathlib import Path

        from grpo_core.training import lora

        saved = lora.saved_base(checkpoint)
        if saved is not None and saved[1] == self.base_id:
            self.engine.use_adapter(Path(checkpoint) / lora.ADAPTER_DIR)
        elif saved is None and policy_id == self.base_id:
            self.engine.lora_request = None
        else:
            return False
        self.policy_id = policy_id
        return True

    def adapter(self) -> str | None:
        """The folder of the LoRA adapter requests carry now (None: the weights alone)."""
        request = getattr(self.engine, "lora_request", None)
        return None if request is None else request.lora_path

    def probe(self, probe: list[int]) -> list[int]:
        """The greedy completion of ``probe`` with the weights (and adapter) held now."""
        self.engine.wake_up()
        out = self._greedy(probe)
        self.engine.sleep()
        return out

    def join_bus(self, key: str, addr: str, port: int, rank: int, world: int, backend: str):
        """Become member ``rank`` of the weight bus ``key`` (cluster/weight_bus.py)."""
        from cluster import weight_bus

        weight_bus.join(key, addr, port, rank, world, backend)

    def receive_weights(self, key: str, plan: list, policy_id: str) -> int:
        """Take trainer rank 0's broadcast of ``policy_id`` (``plan``'s buckets): the hf
        engine copies each tensor into its model in place (in the model's dtype), vLLM
        loads them once all arrived. Returns the bytes received."""
        import torch

        from cluster import weight_bus

        self.engine.wake_up(tags=["weights"])
        if self.engine_name == "hf":
            params = self.engine.model.state_dict()

            def take(views):
                for name, t in views:
                    if name not in params:
                        raise KeyError(f"weight bus: the replica's model has no tensor {name}")
                    params[name].copy_(t)

            with torch.no_grad():
                got = weight_bus.receive(key, plan, take)
        else:
            state: dict = {}
            got = weight_bus.receive(key, plan, lambda views: state.update(views))
            self.engine.update_weights(state)
            del state
        self.policy_id = policy_id
        self.engine.sleep()
        return got

    def weights_id(self) -> str | None:
        """The ``policy_id`` of the weights this replica holds, hashed here (the hf engine;
        None for vLLM, whose weights live in its own processes): equal to the trainer's
        when the transfer was exact and the replica samples in the trainer's dtype."""
        if self.engine_name != "hf":
            return None
        from grpo_core.training.weights_id import savable_state_dict, state_dict_id

        return state_dict_id(savable_state_dict(self.engine.model))

    def dtype(self) -> str:
        """The dtype this replica samples in (hf: its model's; vllm: its option, or auto)."""
        model = getattr(self.engine, "model", None)
        if model is not None:
            from grpo_core.training.checkpoint import dtype_name

            return dtype_name(model)
        return str(getattr(self.engine, "dtype", "auto"))

    def _greedy(self, probe: list[int]) -> list[int]:
        from grpo_core.engines import engine_probe

        return engine_probe(self.engine, probe)

    def current_policy(self) -> str:
        return self.policy_id

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        """The Ray node this replica runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()


def takes_adapters(engine_options: Mapping | None) -> bool:
    """Whether a replica of these engine options takes LoRA adapters instead of weights
    (``lora_sync: adapter``, with the run's ``lora_rank``: cluster/executor.py)."""
    opts = engine_options or {}
    return opts.get("lora_sync") == "adapter" and bool(opts.get("lora_rank"))


def actor_options(group: RolloutSettings) -> dict:
    """Ray resources of one replica, and ``OMP_NUM_THREADS`` for its torch threads: the
    driver's value when set, else 1 (a few replicas share a machine's cores), and the run's
    shared store (cluster/storage.py)."""
    from cluster import storage

    threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    spread = group.placement == "spread"  # cluster/config.py: PLACEMENT
    return {
        "num_cpus": group.num_cpus,
        "num_gpus": group.num_gpus,
        "runtime_env": {"env_vars": {**threads, **storage.env()}},
        **({"scheduling_strategy": "SPREAD"} if spread else {}),
    }

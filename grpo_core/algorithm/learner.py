"""The learner: the policy a stage trains and everything that trains it, in one object.

A :class:`Learner` holds the model and tokenizer, the id of the weights they hold now
(``policy_id``) and the checkpoint or record that names them, the train state that continues
them (``train``: AdamW, LR schedule, RNG states, step; grpo_core/training/train_state.py), the
LoRA base the adapter sits on, and the background writer of its own kept checkpoints. Its
methods are the stage's training verbs:

- :meth:`update`: GRPO steps on scored rows (grpo_core/algorithm/iteration.py: ``update``),
  the train state advanced in place;
- :meth:`resume`: the model ready to train (one process, or a rank of N) and the train state
  for the step the stage is at (the live one, the saved one, or fresh: ``TrainState.resume``);
- :meth:`save`: the weights' id hashed in memory and, kept, the checkpoint written (now, or
  by :attr:`writer` from a CPU copy; data-parallel ranks: by rank 0);
- :meth:`reference`: the reference model (LoRA: the same modules, adapter disabled);
- :meth:`load` / :meth:`adapted`: from a checkpoint, as the run loads policies.

A rollout that runs while the learner goes on (``rl.async_level``) samples a frozen copy of
its weights that the executor takes (cluster/engine_process.py: ``snapshot``).

While an update runs, ``policy_id`` is None: a failed step never leaves weights labelled
with an id they no longer have. Torch only: who holds the learner (this process's executor, or
a rank of the trainer group) and how its lineage is resolved are the pipeline's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_core.training.checkpoint_writer import CheckpointWriter

log = logging.getLogger(__name__)


@dataclass
class Learner:
    model: Any
    tokenizer: Any
    checkpoint: Path
    policy_id: str | None
    loaded_with: dict = field(default_factory=dict)  # the load options it was loaded with
    lora_base: str | None = None  # the checkpoint the LoRA adapter sits on, and its id
    lora_base_id: str | None = None
    train: Any = None  # grpo_core.training.train_state.TrainState, once it has trained
    writer: CheckpointWriter = field(default_factory=CheckpointWriter)

    @property
    def config(self):
        return self.model.config

    @classmethod
    def load(
        cls, checkpoint: str | Path, policy_id: str, *, load: Callable, loaded_with: dict
    ) -> Learner:
        """``checkpoint``'s model and tokenizer (``load(path) -> (model, tokenizer)``)."""
        model, tokenizer = load(Path(checkpoint))
        model.eval()
        return cls(model, tokenizer, Path(checkpoint), policy_id, loaded_with=loaded_with)

    def adapted(self, checkpoint: Path, base: Path, base_id: str, **how) -> Learner:
        """This learner as a LoRA adapter on ``base``: itself when it already is, else
        :func:`with_adapter` of it."""
        if self.lora_base_id == base_id:
            return self
        return with_adapter(self, checkpoint, self.policy_id, base, base_id, **how)

    def lora_info(self) -> dict:
        """What a checkpoint of a LoRA policy records in checkpoint_info.json: its base."""
        if self.lora_base_id is None:
            return {}
        return {"lora_base": self.lora_base, "lora_base_policy_id": self.lora_base_id}

    def reference(self, base_id: str, load_reference: Callable[[], Any]):
        """The reference model: with LoRA on the weights ``base_id``, the policy's own modules
        with the adapter disabled; else ``load_reference()``."""
        from grpo_core.training import lora

        if lora.is_peft(self.model) and self.lora_base_id == base_id:
            return lora.reference_of(self.model)
        return load_reference()

    def resume(self, optimization, saved: Path | None, *, seed: int, parallel=None,
               logger=None):  # fmt: skip
        """The model made ready to train under ``parallel`` (this rank of N,
        grpo_core/training/parallel.py; default one process), then the train state at the step
        of the stage ``optimization`` (an ``RLOptimization``) names: the live one when it is
        that, else the one saved at ``saved``, else fresh (``TrainState.resume``). A live
        state moved to CPU memory while an engine generated comes back first; one built on
        parameters the strategy replaced (an FSDP2 wrap) is dropped."""
        from grpo_core.training import offload
        from grpo_core.training.parallel import LOCAL
        from grpo_core.training.train_state import TrainState

        parallel = parallel or LOCAL
        if parallel.prepare_model(self.model, lora=bool(self.lora_info())):
            self.train = None  # an optimizer built on the unsharded parameters
        live, self.train = self.train, None  # a failed build leaves no state of the wrong step
        if live is not None:
            offload.restore(live.optimizer)
        self.train = TrainState.resume(
            self.model,
            saved,
            live,
            key=optimization.key,
            global_step=optimization.global_step,
            build=optimization.build,
            seed=seed,
            load_optimizer=parallel.load_full_optimizer_state,
            logger=logger,
        )
        return self.train

    def update(self, rows, rl, **kwargs):
        """GRPO steps on ``rows`` from the current train state (:meth:`resume` first);
        ``kwargs``: ``iteration.update``'s (``pad_id`` and ``policy_id`` are the learner's).
        ``policy_id`` is None until :meth:`trained` names the new weights."""
        from grpo_core.algorithm import iteration

        pid, self.policy_id = self.policy_id, None
        return iteration.update(
            self.model,
            self.train,
            rows,
            rl,
            policy_id=pid,
            pad_id=self.tokenizer.pad_token_id,
            **kwargs,
        )

    def trained(self, checkpoint: str | Path, policy_id: str) -> None:
        """The weights in memory are ``policy_id``, named by ``checkpoint`` (a folder, or a
        record that names them without holding them)."""
        self.checkpoint, self.policy_id = Path(checkpoint), policy_id

    def weights_id(self) -> str:
        """The id of the weights in memory, hashed as a checkpoint of them would hash."""
        from grpo_core.training.weights_id import savable_state_dict, state_dict_id

        return state_dict_id(savable_state_dict(self.model))

    def save(
        self,
        out: str | Path,
        *,
        info: dict,
        parallel=None,
        background: bool = False,
        on_done: Callable[[Path], None] | None = None,
        fetch: Callable[[Path], None] | None = None,
    ) -> str:
        """Write the policy and its train state to ``out``; returns the weights' id, hashed
        in memory. ``background``: written by :attr:`writer` from a CPU copy taken now (a
        LoRA policy, whose adapter is read from the live model, is written here and now).
        ``on_done(out)``: once it is written.

        ``parallel``: this is one of the data-parallel ranks (grpo_core/training/distributed.py),
        which all call it: the weights and optimizer state are gathered (collectives) and
        rank 0 writes them, then ``on_done``; every rank returns once the checkpoint exists
        (``fetch(out)`` first on the others: a rank on another node takes its copy) with the
        id read from it."""
        from grpo_core.training import lora
        from grpo_core.training.checkpoint import save_checkpoint
        from grpo_core.training.parallel import LOCAL
        from grpo_core.training.weights_id import savable_state_dict, state_dict_id

        trainer_state, weights = (parallel or LOCAL).checkpoint_state(self.model, self.train)
        info = {**info, **self.lora_info()}
        if parallel is not None:
            return self._save_on_ranks(out, parallel, trainer_state, weights, info, on_done, fetch)
        weights = savable_state_dict(self.model) if weights is None else weights
        pid = state_dict_id(weights)
        if background and not lora.is_peft(self.model):
            self.writer.submit(out, self.model, self.tokenizer, weights=weights,
                               trainer_state=trainer_state, info=info, expected_id=pid,
                               on_done=on_done)  # fmt: skip
            return pid
        save_checkpoint(self.model, self.tokenizer, out, trainer_state=trainer_state, info=info,
                        state_dict=weights, expected_id=pid)  # fmt: skip
        if on_done is not None:
            on_done(Path(out))
        return pid

    def _save_on_ranks(self, out, parallel, trainer_state, weights, info, on_done, fetch) -> str:
        """:meth:`save` on the data-parallel ranks (``weights``: a sharded model's, gathered
        to rank 0; None: the model's own)."""
        from grpo_core.training.checkpoint import policy_id, save_checkpoint

        if parallel.rank == 0:
            save_checkpoint(self.model, self.tokenizer, out, trainer_state=trainer_state,
                            info=info, state_dict=weights)  # fmt: skip
            if on_done is not None:  # the driver, the next iteration's ranks: maybe elsewhere
                on_done(Path(out))
        parallel.barrier()  # the checkpoint exists when any rank returns
        if parallel.rank != 0 and fetch is not None:
            fetch(Path(out))
        return policy_id(out)

    def offload_optimizer(self) -> None:
        """Move the optimizer state to CPU memory (room for an engine's KV cache); the next
        :meth:`resume` brings it back."""
        from grpo_core.training import offload

        if self.train is not None:
            offload.offload(self.train.optimizer)

    def drain(self) -> None:
        """Wait for the kept checkpoints the writer has queued (raises the first failure)."""
        self.writer.drain()


def with_adapter(
    warm: Learner | None,
    checkpoint: Path,
    policy_id: str,
    base: Path,
    base_id: str,
    *,
    lora_cfg,
    quantized: bool,
    load: Callable,
    loaded_with: dict,
) -> Learner:
    """The policy ``policy_id`` (named ``checkpoint``) as a LoRA adapter on ``base``
    (``model.lora``): when it is the base's weights, ``warm``'s model (merged, the saved
    merged copy bit for bit) or ``checkpoint`` loaded, with a fresh adapter; else the base
    loaded with ``checkpoint``'s ``adapter/``. ``load(path) -> (model, tokenizer)``."""
    from grpo_core.training import lora

    if policy_id == base_id:
        if warm is None or quantized:  # a 4-bit base is not merged into: reload it
            model, tokenizer = load(checkpoint)
        else:
            model, tokenizer = lora.merge_in_place(warm.model), warm.tokenizer
        model = lora.attach_adapter(model, lora_cfg, quantized=quantized)
    else:
        model, tokenizer = load(base)
        model = lora.load_adapter(model, checkpoint / lora.ADAPTER_DIR)
    model.peft_config["default"].base_model_name_or_path = str(base)
    model.eval()
    writer = warm.writer if warm is not None else CheckpointWriter()
    return Learner(model, tokenizer, checkpoint, policy_id, loaded_with=loaded_with,
                   lora_base=str(base), lora_base_id=base_id, writer=writer)  # fmt: skip

"""The policy memo: the model stays in the worker process between rollout, score and
update tasks. A task asking for a checkpoint gets the in-memory model when its weights are
that checkpoint (same ``policy_id``); otherwise it is loaded from disk. For an RL
iteration's record (tasks/policies/ref.py) whose weights are neither in memory nor kept, the
memo says so (:class:`NotInMemory`); replaying the update is the update task's decision
(``tasks/update.py: policy``). The memo trains nothing.

The RL update keeps its train state (``grpo_core.training.train_state.TrainState``: AdamW, LR
schedule, RNG states) beside the warm model (``CachedPolicy.train``) between iterations;
``tasks/update.py`` decides whether it continues the stage (``TrainState.resume``).

How a policy is loaded (``model.dtype``, ``attn_implementation``, ``gradient_checkpointing``,
``lora``, ``load_in_4bit``) is the process's setup (cluster/process.py: ``STATE.model``, set
by the run context); every load here honours it, a model in memory that was loaded with other
options is not reused, and :func:`options_key` puts what changes results into the stage cache
keys.
With ``model.lora``, a task that trains names the checkpoint its adapter sits on
(``lora_base``: the stage's initial checkpoint): the policy is that base with a LoRA adapter
(fresh at the stage's first step, else the checkpoint's ``adapter/``), and the reference
model is the same modules with the adapter disabled (:func:`reference`).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.process import STATE
from grpo_core.config.stages import ModelConfig
from grpo_core.errors import UserError
from grpo_core.training import lora
from grpo_core.training.checkpoint import load_checkpoint
from grpo_core.training.checkpoint_writer import CheckpointWriter
from tasks.policies import ref as policy_ref

if TYPE_CHECKING:  # torch loads with the first model: a cached rerun never needs it
    import torch

    from grpo_core.training.train_state import TrainState

log = logging.getLogger(__name__)
_LOCK = threading.Lock()


@dataclass
class CachedPolicy:
    checkpoint: Path
    policy_id: str
    model: torch.nn.Module
    tokenizer: object
    train: TrainState | None = None  # set by the RL update; dropped by anything else training
    extra: dict = field(default_factory=dict)
    loaded_with: dict = field(default_factory=lambda: _loading())  # the options it was loaded with

    @property
    def config(self):
        return self.model.config


_WARM: dict[str, CachedPolicy] = {}  # slot ("policy", "reference") -> warm model
STATS = {"loads": 0, "hits": 0, "replays": 0}  # replays: counted by tasks/update.py
# the kept checkpoints of RL updates, written in the background (grpo_core/training/checkpoint_writer.py)
WRITER = CheckpointWriter()
# a checkpoint folder's or an RL iteration record's policy_id (tasks/policies/ref.py)
policy_id = policy_ref.policy_id


def options() -> ModelConfig:
    """How this process loads policies (its setup's ``model`` section)."""
    return STATE.model


def _loading() -> dict:
    """The model section's options that decide how a checkpoint loads (not where from)."""
    return STATE.model.model_dump(exclude={"source", "path", "demo"})


def options_key() -> dict | None:
    """The load options that change a stage's outputs, or None when they are the defaults
    (so the keys of a run that sets none stay what they were)."""
    opts = STATE.model.load_options()
    return None if opts == ModelConfig().load_options() else opts


def _load(checkpoint: Path):
    return load_checkpoint(checkpoint, **STATE.model.load_kwargs())


def _cached(slot: str) -> CachedPolicy | None:
    """The model in ``slot``, unless it was loaded with other options than today's (then it
    is dropped: a new setup loads anew)."""
    warm = _WARM.get(slot)
    if warm is not None and warm.loaded_with != _loading():
        _WARM.clear()
        return None
    return warm


def _with_adapter(
    warm: CachedPolicy | None, checkpoint: Path, pid: str, base: Path
) -> CachedPolicy:
    """The policy of ``checkpoint`` as a LoRA adapter on ``base``: the warm model when it
    already is that, the warm model (merged) with a fresh adapter when ``checkpoint`` is the
    base itself, else loaded from disk (the base plus the checkpoint's ``adapter/``)."""
    cfg = STATE.model
    base_id = policy_id(base)
    if warm is not None and warm.extra.get("lora_base_id") == base_id:
        return warm
    if pid == base_id:
        if warm is None or cfg.load_in_4bit:  # a 4-bit base is not merged into: reload it
            model, tokenizer = _load(checkpoint)
        else:  # same weights in memory (a merge gives the saved merged copy bit for bit)
            model, tokenizer = lora.merge_in_place(warm.model), warm.tokenizer
        model = lora.attach_adapter(model, cfg.lora, quantized=cfg.load_in_4bit)
    else:
        adapter = checkpoint / lora.ADAPTER_DIR
        saved_base = _read_info(checkpoint).get("lora_base_policy_id")
        if not adapter.is_dir() or saved_base != base_id:
            raise UserError(
                f"{checkpoint}: model.lora continues the adapter saved with the checkpoint on "
                f"its stage's initial checkpoint {base} (policy {base_id}), but the checkpoint "
                + (
                    "has no adapter/ folder"
                    if not adapter.is_dir()
                    else f"has an adapter on policy {saved_base}"
                )
                + "; rerun the stage with --force, or train it without model.lora"
            )
        model, tokenizer = _load(base)
        model = lora.load_adapter(model, adapter)
    model.peft_config["default"].base_model_name_or_path = str(base)
    warm = CachedPolicy(checkpoint, pid, model, tokenizer)
    warm.extra.update(lora_base=str(base), lora_base_id=base_id)
    return warm


def _read_info(checkpoint: Path) -> dict:
    import json

    try:
        return json.loads((checkpoint / "checkpoint_info.json").read_text())
    except (OSError, ValueError):
        return {}


def warm(slot: str = "policy") -> CachedPolicy | None:
    """The model this process holds in ``slot`` (None: none, or loaded with other options)."""
    return _cached(slot)


def describe(model) -> dict:
    """What a model in memory is, as loaded: dtype, LoRA, gradient checkpointing."""
    from grpo_core.training import lora
    from grpo_core.training.checkpoint import dtype_name

    return {
        "dtype": dtype_name(model),
        "lora": lora.is_peft(model),
        "gradient_checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
    }


def lora_info(warm: CachedPolicy) -> dict:
    """What a checkpoint of a LoRA policy records in checkpoint_info.json: its base."""
    if "lora_base_id" not in warm.extra:
        return {}
    return {"lora_base": warm.extra["lora_base"], "lora_base_policy_id": warm.extra["lora_base_id"]}


def reference(warm: CachedPolicy, checkpoint: str | Path):
    """The reference model for an update of ``warm``: with LoRA on ``checkpoint``'s
    weights, the policy's own modules with the adapter disabled; else ``checkpoint``'s model
    (slot ``reference``)."""
    if lora.is_peft(warm.model) and warm.extra.get("lora_base_id") == policy_id(checkpoint):
        return lora.reference_of(warm.model)
    return get(checkpoint, slot="reference").model


def get(
    checkpoint: str | Path,
    slot: str = "policy",
    *,
    mutate: bool = False,
    lora_base: str | Path | None = None,
) -> CachedPolicy:
    """The model of ``checkpoint``, from memory when it is already there.

    ``mutate=True`` (training): the entry leaves the cache until :func:`put` records the
    checkpoint its new weights were saved to, so a failed step never leaves a model
    labelled with weights it no longer has. ``lora_base`` (training with ``model.lora``):
    the checkpoint the adapter sits on, the stage's initial one.
    """
    checkpoint = Path(checkpoint)
    if policy_ref.is_ref(checkpoint):
        return _get_ref(checkpoint, slot, mutate=mutate, lora_base=lora_base)
    pid = policy_id(checkpoint)
    train_lora = lora_base is not None and STATE.model.lora is not None
    with _LOCK:
        warm = _warm_hit(slot, checkpoint, pid, mutate=mutate, lora_base=lora_base)
        if warm is not None:
            return warm
        if train_lora:
            warm = _with_adapter(None, checkpoint, pid, Path(lora_base))
            model = warm.model
        else:
            model, tokenizer = _load(checkpoint)
            warm = CachedPolicy(checkpoint, pid, model, tokenizer)
        model.eval()
        STATS["loads"] += 1
        log.info("loaded %s (%s) from disk into slot %s", checkpoint, pid, slot)
        if not mutate:
            _WARM[slot] = warm
        return warm


def _warm_hit(
    slot: str, checkpoint: Path, pid: str, *, mutate: bool, lora_base
) -> CachedPolicy | None:
    """The model in ``slot`` when it holds the weights ``pid`` (named ``checkpoint`` from
    now on), else None. Called with the lock held."""
    warm = _cached(slot)
    if warm is None or warm.policy_id != pid:
        return None
    STATS["hits"] += 1
    warm.checkpoint = checkpoint
    if lora_base is not None and STATE.model.lora is not None:
        adapted = _with_adapter(warm, checkpoint, pid, Path(lora_base))
        if adapted is not warm:
            _WARM.pop(slot, None)
            warm = adapted
            if not mutate:
                _WARM[slot] = warm
    if mutate:
        _WARM.pop(slot, None)
    return warm


class NotInMemory(LookupError):
    """The policy an RL iteration's record names is neither in memory nor kept on disk: only
    replaying its update gives it back (the update task decides: ``tasks/update.py:
    policy``)."""

    def __init__(self, path: Path, ref) -> None:
        why = "its background write did not finish" if ref.checkpoint else "not a save point"
        super().__init__(f"{path}: policy {ref.policy_id} is not in memory and has no kept "
                         f"checkpoint ({why})")  # fmt: skip
        self.path, self.ref, self.why = path, ref, why


def _get_ref(path: Path, slot: str, *, mutate: bool, lora_base) -> CachedPolicy:
    """The policy an RL iteration's record names (tasks/policies/ref.py): from memory, else
    from its kept checkpoint; else :class:`NotInMemory`."""
    ref = policy_ref.read_ref(path)
    with _LOCK:
        warm = _warm_hit(slot, path, ref.policy_id, mutate=mutate, lora_base=lora_base)
    if warm is not None:
        return warm
    if ref.checkpoint and WRITER.is_pending(ref.checkpoint):
        WRITER.drain()  # its background write: finished before it is read
    kept = ref.kept()
    if kept is not None:
        warm = get(kept, slot, mutate=mutate, lora_base=lora_base)
        if warm.policy_id != ref.policy_id:
            raise UserError(
                f"{path}: records policy {ref.policy_id} kept in {kept}, which holds "
                f"{warm.policy_id}; rerun the stage with --force"
            )
        return warm
    if slot != "policy":
        raise UserError(f"{path}: a policy record is not a {slot} model; give a checkpoint")
    raise NotInMemory(path, ref)


def put(
    checkpoint: str | Path, warm: CachedPolicy, slot: str = "policy", *, pid: str | None = None
) -> None:
    """Record that ``warm.model`` now holds the weights saved at ``checkpoint`` (or, with
    ``pid``, weights of that ``policy_id`` that ``checkpoint`` names without holding yet)."""
    with _LOCK:
        warm.checkpoint = Path(checkpoint)
        warm.policy_id = pid or policy_id(checkpoint)
        _WARM[slot] = warm


def relabel(checkpoint: str | Path, slot: str = "policy") -> None:
    """Name ``checkpoint`` as the source of the warm model when it holds the same weights
    (a copy of the checkpoint it came from); loads nothing when no model is warm."""
    checkpoint = Path(checkpoint)
    with _LOCK:
        warm = _cached(slot)
        if warm is not None and warm.policy_id == policy_id(checkpoint):
            warm.checkpoint = checkpoint


def holding(pid: str):
    """The model in memory whose weights are ``pid``, else None (a trainer rank sends it to
    the rollout replicas: cluster/weight_bus.py; the process setup names this function as
    its ``trained_policy``)."""
    w = warm()
    return w.model if w is not None and w.policy_id == pid else None


def clear() -> None:
    with _LOCK:
        _WARM.clear()

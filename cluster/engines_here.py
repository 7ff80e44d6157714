"""Sampling with this process's engines: the part of the executor's ``Local.sample`` that the
local engine process (cluster/engine_process.py) runs too, so that it needs no executor."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from cluster.state import STATE
from grpo_core.engines import WarmEngines
from grpo_core.engines.turns import SampleRequest


def with_lora_rank(options: Mapping | None, model) -> dict:
    """A rollout engine's options for a run loading policies with ``model`` (its ``model``
    section): ``lora_sync: adapter`` with ``model.lora`` gains the adapters' ``lora_rank``."""
    out = dict(options or {})
    if out.get("lora_sync") == "adapter" and model.lora is not None:
        out["lora_rank"] = model.lora.r
    return out


def engine_for(
    engines: WarmEngines, policy, name: str, options: Mapping | None, *, check_sync: bool
):
    """The engine ``name`` of ``engines`` holding ``policy``'s weights (kept across calls);
    with ``lora_sync: adapter`` and ``model.lora``, one taking adapters of that rank."""
    return engines.get(
        name,
        checkpoint=policy.checkpoint,
        policy_id=policy.policy_id,
        model=policy.model,
        tokenizer=policy.tokenizer,
        opts=with_lora_rank(options, STATE.model),
        check_sync=check_sync,
    )


def sample_here(
    engines: WarmEngines,
    policy,
    prompt_ids: list[list[int]],
    request: SampleRequest,
    *,
    offload: Callable[[], None] | None = None,
):
    """``request`` for each prompt through the turn loop, with the engine of ``engines``
    holding ``policy``; with ``offload_optimizer``, ``offload()`` first (the learner's
    optimizer state to CPU memory, room for the engine's KV cache; back before its next
    step); the engine sleeps after."""
    if request.engine_options.get("offload_optimizer") and offload is not None:
        offload()
    eng = engine_for(
        engines, policy, request.engine, request.engine_options, check_sync=request.check_sync
    )
    samples = request.run(eng, prompt_ids, progress=True)
    eng.sleep()  # frees accelerator memory for the update where the engine supports it
    return samples

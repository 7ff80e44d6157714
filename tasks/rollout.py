"""Rollout task: sample ``num_generations`` completions per prompt, write rollouts Parquet.

With ``cluster.backend: ray`` the prompts are sharded over the rollout replicas
(``cluster/rollout_workers.py``) and gathered back into the same file."""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import zlib

from prefect import task
from prefect.cache_policies import NO_CACHE

from cluster import runtime
from grpo_core.algorithm import iteration as grpo_iteration
from grpo_core.config.engine import EngineSpec
from grpo_core.config.settings import Sampling
from grpo_core.config.stages import RLConfig
from grpo_core.contracts.io import write_parquet
from grpo_core.contracts.prompts import load_rows
from grpo_core.contracts.rollouts import turn_calls
from grpo_core.engines.context import model_context
from grpo_core.engines.turns import SampleRequest
from tasks.cache import cached, stage_key, tool_code
from tasks.policies import loading
from tasks.policies import ref as policy_ref
from tasks.policies.trainer import open_trainer
from tasks.results import RolloutOutcome
from tasks.run_log import logger, timer


def cached_rows(path: str) -> list[dict]:
    """Prompt rows of ``path``, read once per process (keyed on path, size and mtime)."""
    st = os.stat(path)
    return _load(path, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _load(path: str, size: int, mtime_ns: int) -> list[dict]:
    return load_rows(path)


def select_prompts(n_rows: int, k: int, iteration: int, seed: int, stage: str) -> list[int]:
    """Row indices for one iteration: consecutive slices of a seeded permutation, so each
    iteration is reproducible alone and prompts repeat only after an epoch."""
    perm = _permutation(n_rows, seed, stage)
    start = (iteration * k) % n_rows
    return [perm[(start + j) % n_rows] for j in range(k)]


@functools.lru_cache(maxsize=4)
def _permutation(n_rows: int, seed: int, stage: str) -> tuple[int, ...]:
    perm = list(range(n_rows))
    random.Random(seed * 1_000_003 + zlib.crc32(stage.encode())).shuffle(perm)
    return tuple(perm)


def sample_rollouts(
    policy_path: str,
    rows: list[dict],
    out_path: str,
    *,
    num_generations: int,
    iteration: int,
    seed: int,
    engine: str = "hf",
    engine_options: dict | None = None,
    check_sync: bool = False,
    tools=None,
    desc: str = "rollout",
    **sampling,
) -> RolloutOutcome:
    """:func:`write_rollouts` with the sampling settings as keywords (``temperature``,
    ``max_completion_length``, ``top_p``, ...: the fields of ``grpo_core.config.settings.Sampling``)
    and ``num_generations`` samples per prompt drawn with ``seed``."""
    params = Sampling(**sampling).params(num_generations, seed=seed)
    spec = EngineSpec(engine, engine_options or {}, check_sync, tools)
    return write_rollouts(policy_path, rows, out_path, params, iteration, spec, desc)


def write_rollouts(
    policy_path: str,
    rows: list[dict],
    out_path: str,
    params,
    iteration: int,
    engine: EngineSpec,
    desc: str = "rollout",
) -> RolloutOutcome:
    """Sample ``params`` (a ``grpo_core.engines.generation.SamplingParams``) for each prompt of
    ``rows`` with ``engine`` (kept warm, weights synced in memory) and write the rollout
    Parquet; returns path and generation metrics. The sampling is the notebook's
    (grpo_core/algorithm/iteration.py: ``sample``), run where the executor samples."""
    executor = runtime.executor()  # this process's engine, or the rollout replicas
    # load_options: a process that loads its own copy loads it as this one does
    load = loading.options().load_kwargs(trainer=False)
    request = SampleRequest.of(engine, params, load_options=load, desc=desc)
    held = executor.held_policy(policy_ref.policy_id(policy_path))
    w = held or policy_for(executor, policy_path, request)  # held: rl.async_level
    meta: dict = {}  # filled once sampled: the dtype is the samplers' (the replicas exist then)
    done: dict = {}

    def run(prompt_ids, req):  # where the executor samples: its engines, or the replicas
        with timer() as t:
            done["samples"] = executor.sample(w, prompt_ids, req)
        done["seconds"] = t["seconds"]
        meta.update(_metadata(policy_path, engine, params, executor.rollout_shards(len(rows)),
                              executor.sampled_dtype(w)))  # fmt: skip
        return done["samples"]

    table = grpo_iteration.sample(
        None, w.tokenizer, rows, request, policy_id=w.policy_id, iteration=iteration, run=run,
        context=model_context(w.config), metadata=meta,
    )  # fmt: skip
    write_parquet(table, out_path)
    busy = executor.served_here() if w.model is None else None
    metrics = _generation_metrics(done["samples"], done["seconds"])
    return RolloutOutcome(out_path, metrics, engine_busy=busy)


def policy_for(executor, checkpoint: str, request: SampleRequest):
    """The policy to sample from: a read-only handle on its weights in memory
    (tasks/policies/trainer.py), or, where the executor's samplers load the weights
    themselves (the rollout replicas), one without them (``tasks/policies/files.py``)."""
    if not executor.wants_weights(request):
        from tasks.policies.files import files

        return files(checkpoint)
    return open_trainer(executor).handle(checkpoint)


def _metadata(policy_path, engine: EngineSpec, params, shards: int, dtype: str) -> dict:
    """The rollout file's metadata: what sampled it and how (``dtype``: the sampling
    model's, for the hf engine)."""
    meta = {
        "model": str(policy_path),
        "engine": engine.name,
        "engine_options": dict(engine.options),
        "sampling": params.__dict__,
    }
    if shards > 1:  # shard k samples with seed cluster.rollout_workers.shard_seed(seed, k)
        meta["rollout_shards"] = shards
    if engine.name == "hf":  # the sampling model's dtype (grpo_core/logprobs/old.py)
        meta["dtype"] = dtype
    return meta


def _generation_metrics(samples: list, seconds: float) -> dict:
    """TRL's completion metrics, of the tokens the model wrote (an environment's tokens
    are left out); with tools, the episodes' numbers too (:func:`tool_metrics`)."""
    lengths = [len(s.completion_ids) if s.loss_mask is None else sum(s.loss_mask) for s in samples]
    n_tokens = sum(lengths)
    out = {
        "completions/mean_length": n_tokens / len(samples),
        "completions/min_length": float(min(lengths)),
        "completions/max_length": float(max(lengths)),
        "completions/clipped_ratio": sum(s.finish_reason == "length" for s in samples)
        / len(samples),
        "timing/rollout_s": seconds,
        "rollout/tokens_per_s": n_tokens / max(seconds, 1e-9),
    }
    if any(s.turns is not None for s in samples):
        out.update(tool_metrics(samples, seconds))
    return out


def tool_metrics(samples: list, seconds: float) -> dict:
    """Per rollout with an environment: tool calls per completion, the share of calls that
    failed (a turn of several JSON calls counts each call, as TRL's ``tools/call_frequency``
    and ``tools/failure_frequency``), model turns per completion, the share of completion
    tokens the environment added, the calls' load (their seconds summed over the rollout's
    wall time: the mean number of calls running, not a share; it rises when calls overlap
    sampling), and the share
    the turn loop stood still waiting for calls with nothing to sample (``stalled``: the
    critical path's part)."""
    tools = [t for s in samples for t in s.turns or () if t["role"] == "tool"]
    counts = [turn_calls(t) for t in tools]  # a turn of several JSON calls counts each
    calls, failed = sum(c for c, _ in counts), sum(f for _, f in counts)
    turns = sum(sum(t["role"] == "assistant" for t in s.turns or ()) for s in samples)
    total = sum(len(s.completion_ids) for s in samples)
    env_tokens = sum(len(s.loss_mask) - sum(s.loss_mask) for s in samples if s.loss_mask)
    stalled = sum(t.get("stalled") or 0.0 for s in samples for t in s.turns or ())
    return {
        "tools/calls_per_completion": calls / len(samples),
        "tools/error_rate": failed / max(1, calls),
        "tools/turns_per_completion": turns / len(samples),
        "tools/token_share": env_tokens / max(1, total),
        "tools/seconds": sum(t["seconds"] for t in tools),
        "tools/call_load": sum(t["seconds"] for t in tools) / max(seconds, 1e-9),
        "tools/stall_s": stalled,
        "tools/stall_share": stalled / max(seconds, 1e-9),
    }


def rollout_shards(n_prompts: int) -> int:
    """How many replicas share an iteration's prompts (1: the local engine, or one replica,
    which samples what the local engine samples)."""
    return runtime.executor().rollout_shards(n_prompts)


HF_ENGINE = EngineSpec()  # the default: the hf engine, no environment


@task(name="rollout", task_run_name="{stage}-rollout-{iteration}", cache_policy=NO_CACHE)
def rollout(
    stage: str,
    iteration: int,
    policy_path: str,
    rl_path: str,
    out_path: str,
    rl: RLConfig,
    seed: int,
    engine: EngineSpec | None = None,
    force: bool = False,
) -> RolloutOutcome:
    """``engine``: what samples (default: the hf engine)."""
    engine = EngineSpec.of(engine)
    key = rollout_key(stage, iteration, policy_path, rl_path, rl, seed, engine)
    return cached(
        f"{stage} iteration {iteration} rollout",
        out_path,
        key,
        lambda: _rollout(stage, iteration, policy_path, rl_path, out_path, rl, seed, engine),
        force=force,
    )


def is_cached(stage, iteration, policy_path, rl_path, out_path, rl, seed, engine=None):
    """Whether :func:`rollout` would reuse ``out_path`` (the async schedule takes no
    snapshot of a policy whose rollouts are already there)."""
    from tasks.cache import lookup

    key = rollout_key(stage, iteration, policy_path, rl_path, rl, seed, EngineSpec.of(engine))
    return lookup(out_path, key) is not None


def rollout_key(stage, iteration, policy_path, rl_path, rl: RLConfig, seed, engine) -> str:
    """The rollout's cache key: what it samples, and the content hashes of the sampling
    policy and the prompts."""
    engine = EngineSpec.of(engine)
    params = {
        "prompts_per_iteration": rl.prompts_per_iteration,
        "num_generations": rl.num_generations,
        **dataclasses.asdict(rl.sampling),
        "iteration": iteration,
        "seed": seed,
        "stage": stage,
        "engine": engine.name,
    }
    shards = rollout_shards(rl.prompts_per_iteration)
    if shards > 1:  # each shard samples with its own seed: another sample than one process's
        params["rollout_shards"] = shards
    if engine.tools:  # the environment's settings (rollout.tools and its knobs)
        params["tools"] = engine.tools_settings()
        if engine.options.get("turn_cache") is False:  # the hf engine's re-read of each turn:
            params["hf_turn_cache"] = False  # other rounding (the default keeps keys as they were)
    code = tool_code(engine.tools)
    return stage_key("rollout", params, [policy_path, rl_path], code=code)


def _rollout(
    stage, iteration, policy_path, rl_path, out_path, rl: RLConfig, seed, engine: EngineSpec
) -> RolloutOutcome:
    rl_rows = cached_rows(rl_path)
    idx = select_prompts(len(rl_rows), rl.prompts_per_iteration, iteration, seed, stage)
    out = write_rollouts(
        policy_path,
        [rl_rows[i] for i in idx],
        out_path,
        rl.sampling.params(rl.num_generations, seed=seed * 100_003 + iteration),
        iteration,
        engine,
        desc=f"{stage} it{iteration} rollout",
    )
    logger(__name__).info(
        "%s iteration %d: %d completions, mean length %.1f, %.1fs",
        stage,
        iteration,
        len(idx) * rl.num_generations,
        out.metrics["completions/mean_length"],
        out.metrics["timing/rollout_s"],
    )
    return out

"""Evaluation task: pass@1 (greedy, or pass@1/pass@k/maj@k over ``eval.num_samples``
samples), format rate and length of a checkpoint on held-out rows; the per-sample table goes
to Parquet."""

from __future__ import annotations

import shutil

import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE

from cluster import runtime
from grpo_core.config.engine import EngineSpec
from grpo_core.config.stages import EvalConfig
from grpo_core.contracts.io import atomic_path, write_parquet
from grpo_core.contracts.prompts import load_rows
from grpo_core.engines.context import model_context
from grpo_core.engines.turns import SampleRequest
from tasks.cache import cached, lookup, stage_key, tool_code
from tasks.policies import loading
from tasks.results import EvalOutcome
from tasks.rollout import policy_for
from tasks.run_log import logger, timer


def evaluate_checkpoint(
    checkpoint: str,
    eval_path: str,
    cfg: EvalConfig,
    *,
    out_table: str | None = None,
    desc: str = "eval",
    force: bool = False,
    engine: EngineSpec | None = None,
    same_as: str | None = None,
) -> EvalOutcome:
    """Greedy eval; with ``out_table`` the result is cached on (checkpoint, data, eval config).
    ``engine``: what samples (default hf). ``same_as``: another eval
    table that may hold this very evaluation (an RL stage's last in-loop eval of the weights
    its final checkpoint links): when its manifest has the same key (same weights, data,
    config and code), it is copied instead of evaluated again."""
    engine = EngineSpec.of(engine)
    if out_table is None:
        return _evaluate(checkpoint, eval_path, cfg, None, desc, engine)
    key = eval_key(checkpoint, eval_path, cfg, engine)

    def compute() -> EvalOutcome:
        hit = None if force or not same_as else lookup(same_as, key)
        if hit is None:
            return _evaluate(checkpoint, eval_path, cfg, out_table, desc, engine)
        with atomic_path(out_table) as tmp:
            shutil.copyfile(same_as, tmp)
        logger(__name__).info("%s: same weights, data and settings as %s, reused", desc, same_as)
        fields = {k: v for k, v in hit.items() if k != "type"}
        return EvalOutcome(**{**fields, "table": out_table})

    return cached(desc, out_table, key, compute, force=force)


def eval_key(checkpoint: str, eval_path: str, cfg: EvalConfig, engine) -> str:
    """The eval's cache key: its settings, the engine (and environment) that samples, the
    reward code, and the contents of the policy and the held-out rows."""
    engine = EngineSpec.of(engine)
    settings = {**cfg.model_dump(), "engine": engine.name}
    if engine.tools:  # the environment the policy acts in
        settings["tools"] = engine.tools_settings()
    code = (cfg.accuracy_reward, cfg.format_reward, *tool_code(engine.tools))
    return stage_key("eval", settings, [checkpoint, eval_path], code=code)


def is_cached(checkpoint, eval_path, cfg: EvalConfig, out_table, engine=None) -> bool:
    """Whether :func:`evaluate_checkpoint` would reuse ``out_table`` (then the policy's
    weights are not needed)."""
    return lookup(out_table, eval_key(checkpoint, eval_path, cfg, engine)) is not None


def _evaluate(
    checkpoint: str,
    eval_path: str,
    cfg: EvalConfig,
    out_table: str | None,
    desc: str,
    engine: EngineSpec,
) -> EvalOutcome:
    from grpo_core.algorithm.evaluation import evaluate

    rows = load_rows(eval_path)
    if cfg.num_examples:
        rows = rows[: cfg.num_examples]
    # where the completions are sampled, as the executor says: the rollout replicas (ray:
    # no weights in this process), this process's warm engine (vllm, or an environment), or
    # HF generate on the policy in memory (run None)
    executor = runtime.executor()
    load = loading.options().load_kwargs(trainer=False)
    request = SampleRequest.of(engine, None, load_options=load, desc="eval")
    w = policy_for(executor, checkpoint, request)
    run = executor.eval_run(w, request)
    with timer() as t:
        result = evaluate(
            w.model,
            w.tokenizer,
            rows,
            max_new_tokens=cfg.max_completion_length,
            accuracy_reward=cfg.accuracy_reward,
            format_reward=cfg.format_reward,
            num_samples=cfg.num_samples,
            temperature=cfg.temperature,
            desc=desc,
            request=request,
            run=run,
            context=model_context(w.config),
        )
    if out_table:
        write_parquet(pa.Table.from_pylist(result.table), out_table)
    return EvalOutcome(
        accuracy=result.accuracy,
        format_rate=result.format_rate,
        mean_length=result.mean_length,
        num_examples=float(result.num_examples),
        num_samples=result.num_samples,
        pass_at_k=result.pass_at_k,
        maj_at_k=result.maj_at_k,
        wall_time_s=t["seconds"],
        table=out_table,
        policy_id=w.policy_id,
        samples=result.table[: cfg.sample_table_rows],
    )


@task(name="evaluate", task_run_name="eval-{stage}", cache_policy=NO_CACHE)
def evaluate_stage(
    stage: str,
    checkpoint: str,
    eval_path: str,
    cfg: EvalConfig,
    out_table: str,
    force: bool = False,
    engine: EngineSpec | None = None,
    same_as: str | None = None,
) -> EvalOutcome:
    out = evaluate_checkpoint(
        checkpoint,
        eval_path,
        cfg,
        out_table=out_table,
        desc=f"eval {stage}",
        force=force,
        engine=engine,
        same_as=same_as,
    )
    logger(__name__).info(
        "eval %s: accuracy %.3f, format %.3f, mean length %.1f",
        stage,
        out.accuracy,
        out.format_rate,
        out.mean_length,
    )
    return out

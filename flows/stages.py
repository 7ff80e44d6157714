"""One Prefect flow per stage, for standalone reruns from files (and the stage deployments).

    grpo rollout --policy CKPT [--data rl.jsonl] [--iteration N] [--out R.parquet]
    grpo score   --rollouts R.parquet [--out S.parquet]         # new reward mix: --set rewards=...
    grpo update  --scored S.parquet --policy CKPT [--out DIR]   # offline GRPO update
    grpo eval    --checkpoint CKPT [--data eval.jsonl]

Each takes the same ``--config``/``--set`` as ``grpo run`` (the ``rewards``, ``rl`` and
``eval`` sections apply) and plain parameters, so the Prefect UI can edit them. Outputs
default to content-named files beside the input or under ``<output_dir>/<run_name>/offline``;
stage caching applies as in the pipeline.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from prefect import flow

from flows.config import load_config
from flows.run_context import RunContext
from grpo_core.engines.factory_env import rollout_declarations
from tasks.evaluate import evaluate_stage
from tasks.evaluate import is_cached as eval_is_cached
from tasks.policies.trainer import open_trainer
from tasks.prepare import prepare
from tasks.rollout import is_cached, rollout
from tasks.score import score, score_options
from tasks.update import UpdateRequest, update
from tasks.workspace import Workspace


def _config(config: str | None, overrides: list[str] | None) -> RunContext:
    """The stage's config, its process set up for it (flows/run_context.py)."""
    return RunContext.open(load_config(config, list(overrides or [])))


def _tag(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:10]


def _default_data(ctx: RunContext, split: str) -> str:
    """The config's own split (the demo's is generated into the workspace, as `grpo run` does)."""
    cfg = ctx.cfg
    if cfg.data.source == "files":
        path = {"rl": cfg.data.rl_path, "eval": cfg.data.eval_path}[split]
        plain = Path(path).is_file() and Path(path).suffix in (".jsonl", ".json", ".parquet")
        json_tools = cfg.rollout.functions or cfg.rollout.environment_factory
        if plain and cfg.data.mapping().identity and not json_tools:
            return path  # else: mapped into the workspace, as `grpo run` does
    tools = rollout_declarations(cfg.rollout)
    return prepare.fn(cfg.data, cfg.model, cfg.seed, ctx.workspace, tools)[split]


@flow(name="stage-rollout")
def rollout_flow(
    policy: str,
    data: str | None = None,
    iteration: int = 0,
    out: str | None = None,
    config: str | None = None,
    overrides: list[str] | None = None,
) -> str:
    ctx = _config(config, overrides)
    data, cfg = data or _default_data(ctx, "rl"), ctx.cfg
    out = out or str(ctx.workspace.offline_rollouts(iteration))
    spec = cfg.rollout.engine_spec()
    if not is_cached("offline", iteration, policy, data, out, cfg.rl, cfg.seed, spec):
        open_trainer().sampleable(policy)  # a record whose weights were not kept: replayed
    return rollout("offline", iteration, policy, data, out, cfg.rl, cfg.seed, spec).path


@flow(name="stage-score")
def score_flow(
    rollouts: str,
    out: str | None = None,
    config: str | None = None,
    overrides: list[str] | None = None,
) -> dict:
    """Re-score a rollouts Parquet with the config's reward mix into a new scored file."""
    cfg = _config(config, overrides).cfg
    out = out or str(Workspace.rescored(rollouts, _tag([cfg.rewards, score_options(cfg.rl)])))
    if Path(out).resolve() == Path(rollouts).resolve():
        raise ValueError(f"{out}: scoring never rewrites the rollout file; choose another --out")
    res = score("offline", 0, rollouts, out, cfg.rewards, cfg.rl)
    return {"path": res.path, "cached": res.cached, **res.metrics}


@flow(name="stage-update")
def update_flow(
    scored: str,
    policy: str,
    out: str | None = None,
    config: str | None = None,
    overrides: list[str] | None = None,
) -> dict:
    """Offline GRPO update of ``policy`` on any scored Parquet; writes a new checkpoint."""
    ctx = _config(config, overrides)
    cfg = ctx.cfg
    knobs = cfg.rl.model_dump()
    out = out or str(ctx.workspace.offline_update(_tag([scored, policy, knobs])))
    res = update(UpdateRequest(policy, scored, out, cfg.rl, reference_checkpoint=policy), 0)
    return {
        "checkpoint": res.checkpoint,
        "global_step": res.global_step,
        "cached": res.cached,
        "steps": len(res.history),
    }


@flow(name="stage-eval")
def eval_flow(
    checkpoint: str,
    data: str | None = None,
    out: str | None = None,
    config: str | None = None,
    overrides: list[str] | None = None,
) -> dict:
    """Greedy held-out evaluation of a checkpoint; per-example table to Parquet."""
    ctx = _config(config, overrides)
    data, cfg = data or _default_data(ctx, "eval"), ctx.cfg
    out = out or str(
        Workspace.checkpoint_eval_table(checkpoint, _tag([data, cfg.eval.model_dump()]))
    )
    engine = cfg.rollout.engine_spec(cfg.eval.engine)
    if not eval_is_cached(checkpoint, data, cfg.eval, out, engine):
        open_trainer().sampleable(checkpoint)  # a record whose weights were not kept
    res = evaluate_stage("offline", checkpoint, data, cfg.eval, out, engine=engine)
    return {
        "accuracy": res.accuracy,
        "format_rate": res.format_rate,
        "mean_length": res.mean_length,
        "num_examples": res.num_examples,
        "table": res.table,
        "cached": res.cached,
    }

"""One RL stage (rl_1, rl_2): ``iterations`` x [rollout -> Parquet -> score -> update],
with a held-out eval of the starting checkpoint (``rl.eval_on_start``), every ``eval_every``
iterations and at the end. Its MLflow curves are plotted against iterations under the chart
keys of tasks/chart_keys.py; its Prefect artifact is flows/rl_report.py's.

Each iteration's rollouts, scores and checkpoint land under ``<stage>/iter_NNNN/``; the
policy stays warm in this process between tasks (tasks/policy_cache.py). The stage's final policy is
copied to ``checkpoints/<stage>``. Departures from DeepSeek-R1's GRPO: one generation batch
feeds ``steps_per_generation / gradient_accumulation_steps`` optimizer steps (TRL's settings of
the same names; the demo takes 4), beta = 0 by default (no reference model, as DAPO and TRL's
default), and the learning-rate schedule is ``rl.lr_scheduler_type`` (constant by default)
over the stage's optimizer steps.
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow

from cluster import storage
from flows.rl_log import HeldOut, StageLog
from flows.rl_report import IterationGroup
from flows.run_names import named
from grpo_core import rewards
from grpo_core.checkpoint import POLICY_ID, TRAINER_STATE, policy_id
from grpo_core.config import EvalConfig, RLConfig
from grpo_core.io import atomic_path, link_tree
from tasks import policy_cache
from tasks.mlflow_runs import stage_run
from tasks.results import RLStageOutcome
from tasks.rollout import rollout
from tasks.run_log import logger
from tasks.score import score
from tasks.tracking import Tracking
from tasks.update import update
from tasks.workspace import Workspace

KEEP_ITERATION_CHECKPOINTS = 2
# while a stage trains, its curves reach MLflow at most this often (and at its end)
METRICS_FLUSH_S = 10.0


@flow(name="rl-stage", flow_run_name="{tracking.run_name}/{stage}")
def rl_stage(
    stage: str,
    init_checkpoint: str,
    rl: RLConfig,
    rl_path: str,
    eval_path: str,
    eval_cfg: EvalConfig,
    weights: dict[str, float],
    ws: Workspace,
    tracking: Tracking,
    seed: int = 0,
    engine: dict | None = None,
    eval_engine: dict | None = None,
    force: bool = False,
) -> RLStageOutcome:
    config = {**rl.model_dump(), "rewards": weights, "seed": seed, "engine": engine}
    with stage_run(tracking, stage, {"init_checkpoint": init_checkpoint}, config=config) as run_id:
        _log_settings(tracking, run_id, stage, init_checkpoint, rl, weights)
        log = StageLog(tracking, run_id, stage, HeldOut(eval_path, eval_cfg, eval_engine, force))
        policy, step, t0, reused = init_checkpoint, 0, time.perf_counter(), 0
        last_table = None  # the last in-loop eval's table: the final checkpoint's weights
        start_eval = None
        if rl.eval_on_start:  # step 0 of the curves: what RL starts from
            start_eval = log.held_out(init_checkpoint, 0, step, ws.start_eval_table(stage))
        name = f"{tracking.run_name}/{stage}" if tracking.run_name else stage  # demo/rl_1/rollout-0
        for it in range(rl.iterations):
            if it % rl.eval_every == 0:
                last_it = min(it + rl.eval_every, rl.iterations) - 1
                group = IterationGroup.start(tracking, run_id, stage, it, last_it, config)
            roll = named(rollout, f"{name}/rollout-{it}")(
                stage,
                it,
                policy,
                rl_path,
                str(ws.rollouts(stage, it)),
                rl,
                seed,
                engine,
                force=force,
            )
            scored = named(score, f"{name}/score-{it}")(
                stage, it, roll.path, str(ws.scored(stage, it)), weights, rl, force=force
            )
            upd = named(update, f"{name}/update-{it}")(
                stage,
                it,
                policy,
                scored.path,
                str(ws.iteration_checkpoint(stage, it)),
                rl,
                reference_checkpoint=init_checkpoint,
                init_checkpoint=init_checkpoint,
                global_step=step,
                total_steps=rl.total_optimizer_steps,
                seed=seed,
                force=force,
            )
            it_cached = roll.cached and scored.cached and upd.cached
            reused += it_cached
            log.iteration(group, it, step, (roll, scored, upd), it_cached)
            step, policy = upd.global_step, upd.checkpoint
            _prune(ws, stage, it)
            done = it + 1  # the x-axis of the stage's curves: iterations done
            if done % rl.eval_every == 0 or done == rl.iterations:
                table = ws.iteration_eval_table(stage, it)
                last_table = log.block_end(group, policy, done, step, table, scored).table
            if not it_cached:  # live curves while training; replayed history goes in one call
                log.metrics.flush_every(METRICS_FLUSH_S)
        final = _final_checkpoint(ws.checkpoint(stage), policy)
        wall = log.finish(final, step, reused, rl.iterations, t0)
    return RLStageOutcome(
        checkpoint=str(final),
        run_id=run_id,
        global_step=step,
        wall_time_s=wall,
        evals=log.evals,
        eval_table=last_table,
        start_eval_table=start_eval and start_eval.table,
        cached_iterations=reused,
    )


def _log_settings(tracking, run_id, stage, init_checkpoint, rl, weights) -> None:
    """The stage's settings as its run's parameters and ``stage_config.json``; what it is
    about to do in the log."""
    knobs = rl.model_dump()
    sandbox = rewards.sandbox_params(weights)  # the code sandbox's isolation, resolved now
    tracking.log_params(run_id, {**knobs, "rewards": weights, "sandbox": sandbox})
    tracking.log_json(
        run_id,
        {"stage": stage, "init_checkpoint": init_checkpoint, "rewards": weights, **knobs},
        "stage_config.json",
    )
    logger(__name__).info(
        "%s: %d iterations of %d prompts x %d generations from %s",
        stage,
        rl.iterations,
        rl.prompts_per_iteration,
        rl.num_generations,
        init_checkpoint,
    )


def _final_checkpoint(final: Path, policy: str) -> Path:
    """``checkpoints/<stage>``: the last iteration's weights, hard-linked (its files are never
    rewritten), shared through the store, and known to the warm cache by its new path."""
    if not (final / POLICY_ID).exists() or policy_id(final) != policy_id(policy):
        with atomic_path(final) as tmp:
            link_tree(policy, tmp)
        storage.publish(final)
    policy_cache.relabel(final)  # same weights as the last iteration's checkpoint
    return final


def _prune(ws: Workspace, stage: str, it: int) -> None:
    """Drop the trainer state (optimizer, schedule, RNG) of iterations older than the last
    ``KEEP_ITERATION_CHECKPOINTS``. A rerun after a crash continues from the last finished
    iteration, whose state is kept: it trains exactly as the uninterrupted run. Weights,
    rollouts and scores of every iteration stay; an older iteration recomputed later (its
    inputs changed) has lost its optimizer state and starts AdamW fresh, with a warning."""
    old = it - KEEP_ITERATION_CHECKPOINTS
    if old >= 0:
        state = ws.iteration_checkpoint(stage, old) / TRAINER_STATE
        state.unlink(missing_ok=True)
        storage.remove(state)

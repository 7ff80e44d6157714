"""One RL stage (rl_1, rl_2): ``iterations`` x [rollout -> Parquet -> score -> update],
with a held-out eval every ``eval_every`` iterations and at the end.

Each iteration's rollouts, scores and checkpoint land under ``<stage>/iter_NNNN/``; the
policy stays warm in this process between tasks (tasks/warm.py). The stage's final policy is
copied to ``checkpoints/<stage>``. Departures from DeepSeek-R1's GRPO: one generation batch
feeds ``steps_per_generation / gradient_accumulation_steps`` optimizer steps (TRL's settings of
the same names; the demo takes 4), beta = 0 by default (no reference model, as DAPO and TRL's
default), and the learning-rate schedule is ``rl.lr_scheduler_type`` (constant by default)
over the stage's optimizer steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prefect import flow

from grpo_core import rewards
from grpo_core.checkpoint import POLICY_ID, TRAINER_STATE, policy_id
from grpo_core.config import EvalConfig, RLConfig
from grpo_core.io import atomic_path, link_tree
from tasks import storage, warm
from tasks.common import logger
from tasks.evaluate import evaluate_checkpoint
from tasks.mlflow_keys import metric_batch
from tasks.rollout import rollout
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
) -> dict:
    log = logger(__name__)
    knobs = rl.model_dump()
    config = {**knobs, "rewards": weights, "seed": seed, "engine": engine}
    run_id = tracking.start_child(stage, {"init_checkpoint": init_checkpoint}, config=config)
    sandbox = rewards.sandbox_params(weights)  # the code sandbox's isolation, resolved now
    tracking.log_params(run_id, {**knobs, "rewards": weights, "sandbox": sandbox})
    tracking.log_json(
        run_id,
        {"stage": stage, "init_checkpoint": init_checkpoint, "rewards": weights, **knobs},
        "stage_config.json",
    )
    total_steps = rl.total_optimizer_steps
    policy, step, t0 = init_checkpoint, 0, time.perf_counter()
    evals: list[dict] = []
    last_table = None  # the last in-loop eval's table: the final checkpoint's weights
    reused = 0
    metrics = tracking.pending(run_id)  # cached iterations are logged in one batch
    log.info(
        "%s: %d iterations of %d prompts x %d generations from %s",
        stage,
        rl.iterations,
        rl.prompts_per_iteration,
        rl.num_generations,
        init_checkpoint,
    )
    group: IterationGroup | None = None
    name = tracking.child_name(stage)  # demo/rl_1: Prefect task runs as MLflow runs
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
            total_steps=total_steps,
            seed=seed,
            force=force,
        )
        it_cached = roll.cached and scored.cached and upd.cached
        reused += it_cached
        group.cached &= bool(it_cached)
        for i, h in enumerate(upd.history):
            metrics.add(headline_first(h), step + i + 1)
            group.add(h, step + i + 1)
        iter_metrics = headline_first({**scored.metrics, **roll.metrics})
        iter_metrics["timing/update_s"] = upd.seconds
        step, policy = upd.global_step, upd.checkpoint
        metrics.add(iter_metrics, step)
        group.add(iter_metrics, step)
        _prune(ws, stage, it)
        last = it == rl.iterations - 1
        if (it + 1) % rl.eval_every == 0 or last:
            t_eval = time.perf_counter()
            ev = evaluate_checkpoint(
                policy,
                eval_path,
                eval_cfg,
                desc=f"{stage} it{it} eval",
                force=force,
                out_table=str(ws.iteration_eval_table(stage, it)),
                engine=eval_engine,
            )
            last_table = ev.table
            evals.append(
                {
                    "iteration": it,
                    "step": step,
                    **ev.summary_metrics(),
                }
            )
            eval_metrics = {f"eval/{k}": v for k, v in ev.summary_metrics().items()}
            metrics.add({**eval_metrics, "timing/eval_s": time.perf_counter() - t_eval}, step)
            group.end(step, eval_metrics, policy_id(policy))
            # tables the MLflow UI pages through: training completions with their rewards,
            # and held-out completions, at this eval point
            tracking.log_table(run_id, _rollout_sample(scored.path), f"samples/iter_{it:04d}.json")
            tracking.log_table(run_id, ev.samples, f"eval_samples/iter_{it:04d}.json")
            log.info(
                "%s iteration %d (step %d): held-out accuracy %.3f, reward %.3f",
                stage,
                it,
                step,
                ev.accuracy,
                scored.metrics["reward"],
            )
        if not it_cached:  # live curves while training; replayed history goes in one call
            metrics.flush_every(METRICS_FLUSH_S)
    final = ws.checkpoint(stage)
    if not (final / POLICY_ID).exists() or policy_id(final) != policy_id(policy):
        with atomic_path(final) as tmp:
            link_tree(policy, tmp)  # hard links: the iteration's files are never rewritten
        storage.publish(final)
    warm.relabel(final)  # same weights as the last iteration's checkpoint
    stage_tags = {
        "policy_id": policy_id(final),
        "cached": str(reused == rl.iterations).lower(),
        # bookkeeping: tags, not metrics
        "global_step": str(step),
        "cached_iterations": str(reused),
    }
    if reused:
        log.info("%s: %d of %d iterations reused from cache", stage, reused, rl.iterations)
    wall = time.perf_counter() - t0
    metrics.add({"wall_time_s": wall}, step)
    metrics.flush(tags=stage_tags)
    tracking.log_json(run_id, evals, "eval_history.json")
    tracking.end(run_id)
    return {
        "checkpoint": str(final),
        "run_id": run_id,
        "global_step": step,
        "wall_time_s": wall,
        "evals": evals,
        "eval_table": last_table,
        "cached_iterations": reused,
    }


@dataclass
class IterationGroup:
    """A run nested under the RL stage's run for iterations ``first..last`` (one eval
    block), named ``<run>/<stage>/iter_<first>-<last>``: the block's curves (every per-step
    and per-iteration metric at its global step), the eval at its end, and tags
    ``iterations``, ``policy_id`` (the block's last checkpoint), ``config_hash`` and
    ``cached``, so MLflow's compare view and ``search_runs`` can set blocks of one stage, or
    of different runs, side by side."""

    tracking: Tracking
    run_id: str
    batch: list = field(default_factory=list)
    cached: bool = True

    def add(self, metrics: dict, step: int) -> None:
        self.batch.extend(metric_batch(metrics, step))

    @classmethod
    def start(cls, tracking, stage_run_id, stage, first, last, config) -> IterationGroup:
        run_id = tracking.start_child(
            stage,
            {"iterations": f"{first}-{last}"},
            config=config,
            parent_run_id=stage_run_id,
            run_name=tracking.child_name(f"{stage}/iter_{first:04d}-{last:04d}"),
        )
        return cls(tracking, run_id)

    def end(self, step: int, eval_metrics: dict, policy: str) -> None:
        self.tracking.log_metric_batch(
            self.run_id,
            self.batch + metric_batch(eval_metrics, step),
            {"policy_id": policy, "cached": str(self.cached).lower()},
        )
        self.tracking.end(self.run_id)


HEADLINE = ("reward", "eval/accuracy", "accuracy", "loss", "kl", "entropy")


def headline_first(metrics: dict) -> dict:
    """``metrics`` with the headline curves (reward, accuracy, loss, KL, entropy) first:
    the order in which they are first logged."""
    return {
        **{k: metrics[k] for k in HEADLINE if k in metrics},
        **{k: v for k, v in metrics.items() if k not in HEADLINE},
    }


def named(call, name: str):
    """A Prefect task whose run is named ``name`` (``demo/rl_1/rollout-0``)."""
    return call.with_options(task_run_name=lambda: name)


def _rollout_sample(scored_path: str, n: int = 16) -> list[dict]:
    """A few scored completions (text, rewards, advantage) for the MLflow UI."""
    import pyarrow.parquet as pq

    table = pq.read_table(scored_path)
    keep = [
        c
        for c in table.column_names
        if c in ("prompt_text", "completion", "reward", "advantage", "finish_reason", "answer")
        or c.startswith("reward_")
    ]
    return table.select(keep).slice(0, n).to_pylist()


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

"""An RL stage's bookkeeping as it trains (flows/rl.py): its curves in its MLflow run, the
held-out evals, the nested run of each eval block and the Prefect report. Every point's
step is the number of iterations done (tasks/tracking/charts.py)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from flows.rl_report import IterationGroup, StageReport, rollout_sample
from grpo_core.config.engine import EngineSpec
from grpo_core.config.stages import EvalConfig, RLConfig
from tasks.evaluate import evaluate_checkpoint, is_cached
from tasks.policies import ref as policy_ref
from tasks.policies.trainer import Trainer, open_trainer
from tasks.policies.version import PolicyVersion
from tasks.results import EvalOutcome
from tasks.run_log import logger
from tasks.tracking.charts import chart_metrics, eval_point, iteration_means, step_metrics
from tasks.tracking.stages import PendingMetrics, Tracking


@dataclass(frozen=True)
class HeldOut:
    """How the stage evaluates a checkpoint: the held-out rows, settings and engine."""

    eval_path: str
    cfg: EvalConfig
    engine: EngineSpec | None = None
    force: bool = False
    trainer: Trainer | None = None  # the stage's (tasks/policies/trainer.py)

    def __call__(self, checkpoint, out_table: Path, desc: str) -> EvalOutcome:
        """The eval of ``checkpoint`` (a path, or a ``PolicyVersion``)."""
        checkpoint = os.fspath(checkpoint)
        if self.force or not is_cached(
            checkpoint, self.eval_path, self.cfg, str(out_table), self.engine
        ):
            trainer = self.trainer or open_trainer()
            trainer.sampleable(checkpoint)  # a rerun's cached updates left it unkept: replayed
        return evaluate_checkpoint(
            checkpoint,
            self.eval_path,
            self.cfg,
            desc=desc,
            force=self.force,
            out_table=str(out_table),
            engine=self.engine,
        )


@dataclass
class Blocks:
    """An RL stage's iterations in blocks of ``rl.eval_every``, each a nested MLflow run
    (flows/rl_report.py: IterationGroup) ended by a held-out eval; the last block ends at
    the stage's last iteration."""

    rl: RLConfig
    config: dict  # the stage's settings, on each block's run
    group: IterationGroup | None = None  # the block in progress
    last_table: str | None = None  # the last block eval's table: the final weights'

    def starts(self, it: int) -> bool:
        return it % self.rl.eval_every == 0

    def last(self, it: int) -> int:
        return min(it + self.rl.eval_every, self.rl.iterations) - 1

    def ends(self, it: int) -> bool:
        done = it + 1
        return done % self.rl.eval_every == 0 or done == self.rl.iterations


@dataclass
class StageLog:
    tracking: Tracking
    run_id: str
    stage: str
    evaluate: HeldOut
    blocks: Blocks
    evals: list[dict] = field(default_factory=list)  # each held-out eval's numbers
    metrics: PendingMetrics = field(init=False)  # cached iterations are logged in one batch
    report: StageReport = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = self.tracking.pending(self.run_id)
        self.report = StageReport(self.stage)

    def held_out(self, checkpoint: str, done: int, step: int, out_table: Path) -> EvalOutcome:
        """The held-out eval of ``checkpoint`` after ``done`` iterations (its MLflow step)
        and ``step`` optimizer steps."""
        t_eval = time.perf_counter()
        desc = f"{self.stage} it{done - 1} eval" if done else f"{self.stage} start eval"
        ev = self.evaluate(checkpoint, out_table, desc)
        self.evals.append({"iterations_done": done, "step": step, **ev.summary_metrics()})
        point = eval_point(ev.summary_metrics())
        self.metrics.add(
            chart_metrics({**point, "timing/eval_s": time.perf_counter() - t_eval}), done
        )
        self.report.evaluated(done, ev)
        self.tracking.log_table(self.run_id, ev.samples, f"eval_samples/step_{done:04d}.json")
        return ev

    def block_start(self, it: int) -> None:
        """Iteration ``it`` starts a block: its nested run opens."""
        b = self.blocks
        if b.starts(it):
            b.group = IterationGroup.start(
                self.tracking, self.run_id, self.stage, it, b.last(it), b.config
            )

    def iteration(self, it: int, step: int, results, cached: bool, extra=None) -> None:
        """Iteration ``it``'s point (its optimizer steps averaged, its scores and rollout
        numbers, ``extra``: the async schedule's) in the stage's run and its block's; the
        block also gets every step."""
        group = self.blocks.group
        roll, scored, upd = results
        group.cached &= bool(cached)
        for i, h in enumerate(upd.history):  # the nested run keeps every optimizer step
            group.add(step_metrics(h), step + i + 1)
        point = {**iteration_means(upd.history), **scored.metrics, **roll.metrics, **(extra or {})}
        point = chart_metrics({**point, "timing/update_s": upd.seconds})
        self.metrics.add(point, it + 1)
        group.add(point, it + 1)
        self.report.iteration(it, point, cached)

    def block_end(self, it: int, policy: PolicyVersion, step: int, table: Path, scored) -> None:
        """After iteration ``it``, when it ends a block: the held-out eval of ``policy``,
        the block's run ended with it, a sample of the training completions in the stage's
        run."""
        if not self.blocks.ends(it):
            return
        done = it + 1
        ev = self.held_out(policy, done, step, table)
        self.blocks.last_table = ev.table
        self.blocks.group.end(done, eval_point(ev.summary_metrics()), policy.policy_id)
        # the training completions the MLflow UI pages through, at this eval point
        self.tracking.log_table(
            self.run_id, rollout_sample(scored.path), f"samples/iter_{it:04d}.json"
        )
        logger(__name__).info(
            "%s iteration %d (step %d): held-out accuracy %.3f, reward %.3f",
            self.stage,
            it,
            step,
            ev.accuracy,
            scored.metrics["reward"],
        )

    def finish(self, final: Path, step: int, reused: int, iterations: int, t0: float) -> float:
        """The stage's last tags and metrics, its eval history and Prefect report; returns
        its wall time (from ``t0``)."""
        stage_tags = {
            "policy_id": policy_ref.policy_id(final),
            "cached": str(reused == iterations).lower(),
            # bookkeeping: tags, not metrics
            "global_step": str(step),
            "cached_iterations": str(reused),
        }
        if reused:
            logger(__name__).info(
                "%s: %d of %d iterations reused from cache", self.stage, reused, iterations
            )
        wall = time.perf_counter() - t0
        self.metrics.add({"wall_time_s": wall}, iterations)
        self.metrics.flush(tags=stage_tags)
        self.tracking.log_json(self.run_id, self.evals, "eval_history.json")
        self.report.publish(self.tracking, self.run_id, wall)
        return wall

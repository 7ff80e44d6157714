"""One RL stage (rl_1, rl_2): ``iterations`` x [rollout -> Parquet -> score -> update],
with a held-out eval of the starting checkpoint (``rl.eval_on_start``), every ``eval_every``
iterations and at the end. Its MLflow curves are plotted against iterations under the chart
keys of tasks/tracking/charts.py; its Prefect artifact is flows/rl_report.py's.

Each iteration's rollouts, scores and policy record (tasks/policies/ref.py) land under
``<stage>/iter_NNNN/``. The stage holds its policy as a value (tasks/policies/version.py:
``PolicyVersion``: the cold start's checkpoint, then each update's record) and opens the
trainer once (tasks/policies/trainer.py), whose learner keeps the weights in memory between
tasks. The full train state is kept every ``rl.save_steps`` iterations and
at the end, written in the background, and only the last ``rl.save_total_limit`` of those
stay; a rerun that needs an iteration in between replays the updates from the nearest kept
state on the cached scored files (no generation, no scoring). The stage's final policy is
hard-linked to ``checkpoints/<stage>``. Departures from DeepSeek-R1's GRPO: one generation batch
feeds ``steps_per_generation / gradient_accumulation_steps`` optimizer steps (TRL's settings of
the same names; the demo takes 4), beta = 0 by default (no reference model, as DAPO and TRL's
default), and the learning-rate schedule is ``rl.lr_scheduler_type`` (constant by default)
over the stage's optimizer steps.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from prefect import flow

from cluster import runtime, storage
from flows.rl_log import Blocks, HeldOut, StageLog
from flows.rl_schedule import Overlap
from flows.run_names import named
from grpo_core import rewards
from grpo_core.config.engine import EngineSpec
from grpo_core.config.stages import EvalConfig, RLConfig
from grpo_core.contracts.io import atomic_path, link_tree
from grpo_core.training.checkpoint import POLICY_ID, policy_id, save_checkpoint
from tasks.policies import ref as policy_ref
from tasks.policies.trainer import Trainer, open_trainer
from tasks.policies.version import PolicyVersion
from tasks.results import RLStageOutcome
from tasks.rollout import is_cached, rollout
from tasks.run_log import logger
from tasks.score import score
from tasks.tracking.charts import chart_metrics
from tasks.tracking.runs import stage_run
from tasks.tracking.stages import Tracking
from tasks.update import UpdateRequest, update
from tasks.workspace import Workspace

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
    engine: EngineSpec | None = None,
    eval_engine: EngineSpec | None = None,
    force: bool = False,
) -> RLStageOutcome:
    settings = engine.settings() if engine is not None else None
    config = {**rl.model_dump(), "rewards": weights, "seed": seed, "engine": settings}
    with stage_run(tracking, stage, {"init_checkpoint": init_checkpoint}, config=config) as run_id:
        _log_settings(tracking, run_id, stage, init_checkpoint, rl, weights)
        trainer = open_trainer()  # the learner this stage trains, and its lineage
        recovered = runtime.executor().recoveries()  # lost workers replaced before the stage
        held_out = HeldOut(eval_path, eval_cfg, eval_engine, force, trainer)
        log = StageLog(tracking, run_id, stage, held_out, blocks=Blocks(rl, config))
        t0, start_eval = time.perf_counter(), None
        if rl.eval_on_start:  # step 0 of the curves: what RL starts from
            start_eval = log.held_out(init_checkpoint, 0, 0, ws.start_eval_table(stage))
        tasks = _StageTasks(stage, f"{tracking.run_name}/{stage}" if tracking.run_name else stage,
                            init_checkpoint, rl, rl_path, weights, ws, seed, engine, force,
                            trainer)  # fmt: skip
        saves = SavePoints(ws, stage, rl, trainer)
        policy, step, reused = PolicyVersion.at(init_checkpoint), 0, 0
        with tasks:  # rl.async_level > 0: rollouts run ahead of the updates
            for it in range(rl.iterations):
                log.block_start(it)
                roll, scored, extra = tasks.scored(it, policy)
                upd = tasks.update(it, policy, scored.path, step)
                cached = roll.cached and scored.cached and upd.cached
                reused += cached
                log.iteration(it, step, (roll, scored, upd), cached, extra)
                step, policy = upd.global_step, PolicyVersion.at(upd.checkpoint)
                tasks.policy_known(it + 1, policy)  # what queued rollouts sample
                saves.after(it)
                log.block_end(it, policy, step, ws.iteration_eval_table(stage, it), scored)
                if not cached:  # live curves while training; replayed history goes in one call
                    log.metrics.flush_every(METRICS_FLUSH_S)
        saves.finish()
        if tasks.shares:
            log.metrics.add(chart_metrics(tasks.shares), rl.iterations)
        log.metrics.add(_recovered(recovered), rl.iterations)
        final = _final_checkpoint(ws.checkpoint(stage), policy, trainer)
        wall = log.finish(final, step, reused, rl.iterations, t0)
    return RLStageOutcome(
        checkpoint=str(final),
        run_id=run_id,
        global_step=step,
        wall_time_s=wall,
        evals=log.evals,
        eval_table=log.blocks.last_table,
        start_eval_table=start_eval and start_eval.table,
        cached_iterations=reused,
    )


@dataclass
class _StageTasks:
    """How the stage runs an iteration's tasks: rollout and scoring in line (on-policy), or
    submitted ahead by the async schedule (flows/rl_schedule.py), which runs while the
    stage is entered (``with``); then the update."""

    stage: str
    name: str
    init_checkpoint: str
    rl: RLConfig
    rl_path: str
    weights: dict
    ws: Workspace
    seed: int
    engine: EngineSpec | None
    force: bool
    trainer: Trainer
    overlap: Overlap | None = None
    shares: dict = field(default_factory=dict)  # the async schedule's idle shares, at the end

    def _args(self, it: int, policy: PolicyVersion) -> tuple:
        out = str(self.ws.rollouts(self.stage, it))
        return (self.stage, it, policy.path, self.rl_path, out, self.rl, self.seed, self.engine)

    def _score_args(self, it: int, rollouts: str) -> tuple:
        scored = str(self.ws.scored(self.stage, it))
        return (self.stage, it, rollouts, scored, self.rl.rewards_at(it, self.weights), self.rl)

    def scored(self, it: int, policy: PolicyVersion):
        """Iteration ``it``'s rollout and scoring results and the numbers the schedule adds."""
        if self.overlap is not None:
            return self.overlap.take(it)
        if self.force or not is_cached(*self._args(it, policy)):
            self.trainer.sampleable(policy)  # a rerun's cached updates left it unkept: replayed
        roll = named(rollout, f"{self.name}/rollout-{it}")(
            *self._args(it, policy), force=self.force
        )
        scored = named(score, f"{self.name}/score-{it}")(
            *self._score_args(it, roll.path), force=self.force
        )
        return roll, scored, {}

    def update(self, it: int, policy: PolicyVersion, scored_path: str, step: int):
        """Iteration ``it``'s update of ``policy`` (at optimizer step ``step``)."""
        rl, ws = self.rl, self.ws
        request = UpdateRequest(
            policy.path,
            scored_path,
            str(ws.iteration_checkpoint(self.stage, it)),
            rl,
            reference_checkpoint=self.init_checkpoint,
            init_checkpoint=self.init_checkpoint,
            stage=self.stage,
            global_step=step,
            total_steps=rl.total_optimizer_steps,
            seed=self.seed,
        )
        return named(update, f"{self.name}/update-{it}")(
            request,
            it,
            force=self.force,
            ref_path=str(ws.policy_ref(self.stage, it)),
            keep=rl.saves_at(it),
        )

    def submit(self, it: int, policy: PolicyVersion):
        """Iteration ``it``'s rollout task, and its scoring task once the file lands."""
        args = self._args(it, policy)
        roll = named(rollout, f"{self.name}/rollout-{it}").submit(*args, force=self.force)
        scored = named(score, f"{self.name}/score-{it}").submit(
            *self._score_args(it, args[4]), force=self.force, wait_for=[roll]
        )
        return roll, scored

    def policy_known(self, j: int, policy: PolicyVersion) -> None:
        """The async schedule starts the rollouts ``policy`` (``P_j``) samples."""
        if self.overlap is not None:
            self.overlap.policy_known(j, policy)

    def sampleable(self, policy: PolicyVersion):
        """A handle on ``policy``'s weights, replayed into the learner first when a rerun's
        cached updates left them neither in memory nor on disk."""
        self.trainer.sampleable(policy)
        return self.trainer.handle(policy)

    def __enter__(self) -> _StageTasks:
        """With ``rl.async_level`` > 0, the async schedule; its first rollouts are
        submitted now."""
        if not self.rl.async_level:
            return self
        executor = runtime.executor()
        executor.overlap(True)  # the local engine process: this process keeps the other cores
        self.overlap = Overlap(
            self.rl.async_level,
            self.rl.iterations,
            self.submit,
            cached=lambda it, policy: not self.force and is_cached(*self._args(it, policy)),
            executor=executor,
            load=self.sampleable,
            source=self.init_checkpoint,
        )
        self.policy_known(0, PolicyVersion.at(self.init_checkpoint))
        return self

    def __exit__(self, *exc) -> None:
        if self.overlap is not None:
            self.overlap.cancel()
            self.shares = self.overlap.shares()
        if self.rl.async_level:
            runtime.executor().overlap(False)


def _recovered(before: dict[str, float]) -> dict[str, float]:
    """``recovery/trainer_restarts``, ``recovery/trainer_seconds_lost`` and
    ``recovery/replicas_replaced`` during the stage (on Ray; 0 in a run nothing disturbed),
    so a recovered stage shows in MLflow."""
    now = runtime.executor().recoveries()
    return {f"recovery/{k}": float(max(0, v - before.get(k, 0))) for k, v in now.items()}


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


def _final_checkpoint(final: Path, policy: PolicyVersion, trainer: Trainer) -> Path:
    """``checkpoints/<stage>``: the last iteration's kept checkpoint, hard-linked (its files
    are never rewritten), shared through the store, and known to the warm cache by its new
    path."""
    kept = policy_ref.saved_at(policy)
    if kept is None:  # pruned, or lost with its background write: the weights are in memory
        trainer.sampleable(policy)
        w = trainer.handle(policy)
        with atomic_path(final) as tmp:
            save_checkpoint(w.model, w.tokenizer, tmp, expected_id=w.policy_id)
        storage.publish(final)
    elif not (final / POLICY_ID).exists() or policy_id(final) != policy_id(kept):
        with atomic_path(final) as tmp:
            link_tree(kept, tmp)
        storage.publish(final)
    trainer.relabel(policy_id(final), final)  # same weights as the last iteration's
    return final


@dataclass
class SavePoints:
    """What an RL stage keeps on disk: after iteration ``it`` (:meth:`after`), the
    checkpoints of the last ``rl.save_total_limit`` save points (``rl.save_steps``) stay
    and older ones go; a checkpoint written at another iteration (data-parallel ranks write
    every update's, for the rollout replicas) goes once the next one exists. Rollouts,
    scores and policy records of every iteration stay: a rerun replays from the nearest
    kept state. With ``rl.async_level`` k, the checkpoints queued rollouts read stay k
    iterations longer."""

    ws: Workspace
    stage: str
    rl: RLConfig
    trainer: Trainer

    def after(self, it: int) -> None:
        if it >= self.rl.async_level:
            self._prune(it - self.rl.async_level)

    def finish(self) -> None:
        """The stage's loop is over: the lagging iterations, and the background writes."""
        n, lag = self.rl.iterations, self.rl.async_level
        for it in range(max(0, n - lag), n):
            self._prune(it)
        self.trainer.drain()  # the kept checkpoints are in place

    def _prune(self, it: int) -> None:
        rl = self.rl
        saves = list(range(rl.save_steps - 1, it + 1, rl.save_steps))
        if rl.saves_at(it) and it not in saves:  # the stage's last iteration
            saves.append(it)
        older = set(saves[: -rl.save_total_limit]) | ({it - 1} - set(saves))
        for j in sorted(x for x in older if x >= 0):
            path = self.ws.iteration_checkpoint(self.stage, j)
            if not path.exists():
                continue
            if self.trainer.is_pending(path):
                self.trainer.drain()
            shutil.rmtree(path, ignore_errors=True)
            storage.remove(path)

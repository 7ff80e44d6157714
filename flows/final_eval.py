"""The recipe's last step: every stage's checkpoint on the same held-out rows with the same
decoding, logged to the pipeline's parent run (the stage progression), to its own
``final_evaluation`` run and to each stage's run. An RL stage's last in-loop eval and its
start eval are these very evaluations (same weights, data and settings): copied, not rerun."""

from __future__ import annotations

from dataclasses import dataclass

from flows.config import CHECKPOINT_STAGES, PipelineConfig
from flows.run_names import named
from tasks.evaluate import evaluate_stage
from tasks.results import EvalOutcome
from tasks.tracking.charts import eval_point, pipeline_stage_key
from tasks.tracking.runs import stage_run
from tasks.tracking.stages import Tracking
from tasks.workspace import Workspace


@dataclass(frozen=True)
class FinalEvalInputs:
    stage_runs: dict[str, str]  # stage -> its MLflow run
    same_as: dict[str, str | None]  # stage -> an eval table that may already be this one
    sft_steps: dict[str, int]  # SFT stage -> its last optimizer step (its eval's MLflow step)
    wall_times: dict[str, float]  # stage -> its wall time in this pipeline


def _table_rows(path: str | None) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist() if path else []


def final_evaluation(
    cfg: PipelineConfig,
    ws: Workspace,
    tracking: Tracking,
    eval_path: str,
    ckpts: dict[str, str],
    given: FinalEvalInputs,
) -> dict[str, EvalOutcome]:
    run = cfg.run_name
    results: dict[str, EvalOutcome] = {}
    with stage_run(tracking, "final_evaluation", config=cfg.eval.model_dump()) as eval_run:
        for index, stage in enumerate(CHECKPOINT_STAGES):
            ev = named(evaluate_stage, f"{run}/final_evaluation/{stage}")(
                stage,
                ckpts[stage],
                eval_path,
                cfg.eval,
                str(ws.eval_table(stage)),
                force=cfg.forced("final_evaluation"),
                engine=cfg.rollout.engine_spec(cfg.eval.engine),
                same_as=given.same_as.get(stage),
            )
            results[stage] = ev
            _log_stage(tracking, eval_run, index, stage, ev, given)
        tracking.log_table(
            eval_run,
            [{"stage": s, **r} for s in CHECKPOINT_STAGES for r in results[s].samples],
            "eval_samples.json",
        )
    return results


def _log_stage(
    tracking: Tracking,
    eval_run: str,
    index: int,
    stage: str,
    ev: EvalOutcome,
    given: FinalEvalInputs,
) -> None:
    """Stage ``index``'s final held-out numbers in the parent run, the final_evaluation run
    and the stage's own run."""
    parent = tracking.parent_run_id
    summary_metrics = ev.summary_metrics()
    numbers = {
        pipeline_stage_key(index, stage, k): v
        for k, v in {**summary_metrics, "wall_time_s": given.wall_times[stage]}.items()
    }
    # the stage progression as charts: one step per evaluated stage, in recipe order; the
    # parent's first keys, so MLflow's compare view starts on eval/accuracy (its latest
    # value: the final stage's), not on a number every run shares
    tracking.log_metrics(parent, eval_point(summary_metrics), index)
    tracking.log_metrics(parent, numbers)
    tracking.log_metrics(
        eval_run, {pipeline_stage_key(index, stage, k): v for k, v in summary_metrics.items()}
    )
    tracking.log_artifact(eval_run, ev.table, "eval_tables")  # Parquet: pandas / DuckDB
    tracking.log_table(eval_run, _table_rows(ev.table), f"eval_tables/{stage}.json")
    # the stage's own run gets its final held-out numbers, table and sample completions
    stage_run_id = given.stage_runs[stage]
    if stage in given.sft_steps:  # an RL stage's curve ends with this eval (same_as)
        tracking.log_metrics(stage_run_id, eval_point(summary_metrics), given.sft_steps[stage])
    tracking.log_artifact(stage_run_id, ev.table, "eval")
    tracking.log_table(stage_run_id, ev.samples, "eval/samples.json")

"""The DeepSeek-R1 recipe as one Prefect flow:

    prepare -> cold_start_sft -> rl_1 -> rejection_sampling -> re_sft -> rl_2
            -> final evaluation of every stage's checkpoint on the same held-out set

Each stage is a Prefect task (or subflow for RL) and an MLflow child run under one parent
run. Departures from the paper, at demo scale: re-SFT starts from the rl_1 checkpoint (R1
restarts from the base model with 800k samples; with a 1M-parameter model and a few hundred
samples, fine-tuning the RL policy on its own filtered samples is the stable choice), and
the cold-start SFT can stop early at a target dev accuracy so that RL starts in the band
where groups have reward variance. R1 mixed SFT data it already had into the re-SFT set;
here that is ``rejection_sampling.mix_sft_rows`` rows of the cold-start data (default none).
"""

from __future__ import annotations

import time

from prefect import flow

from flows.config import CHECKPOINT_STAGES, PipelineConfig
from flows.deployments import R1_FLOW
from flows.final_eval import FinalEvalInputs, final_evaluation
from flows.lock import acquire_workspace
from flows.model_registry import register_final_checkpoint
from flows.recipe import FINAL_STAGE, RECIPE, STAGES, RecipeRun, same_evaluations, sft_steps
from flows.run_context import RunContext
from flows.run_names import named
from flows.summary import COMPARE_PLOT, publish_pipeline_artifact, run_note
from grpo_core.engines.factory_env import rollout_declarations
from tasks.prepare import prepare
from tasks.tracking.run_states import end_open_runs
from tasks.tracking.runs import parent_run
from tasks.tracking.stages import Tracking, config_hash
from tasks.workspace import Workspace


def _end_tracking(flow, flow_run, state) -> None:
    """Flow hook: a failed pipeline ends its open MLflow runs FAILED; a crashed (interrupted:
    Ctrl-C, SIGTERM) or cancelled one ends them KILLED."""
    end_open_runs("FAILED" if state.is_failed() else "KILLED", flow_run=str(flow_run.id))


@flow(
    name=R1_FLOW,  # one flow, one history: `grpo run` and the deployments (r1_from_config)
    flow_run_name="{cfg.run_name}",
    log_prints=True,
    on_failure=[_end_tracking],
    on_crashed=[_end_tracking],
    on_cancellation=[_end_tracking],
)
def r1_pipeline(cfg: PipelineConfig) -> dict:
    """The recipe from a loaded config (`grpo run`, Python). The deployments run the same
    flow from a config path and overrides (flows/deployments.py: r1_from_config)."""
    return locked_pipeline(cfg)


def locked_pipeline(cfg: PipelineConfig) -> dict:
    # one run per workspace (the `grpo` CLI already holds the lock: this nests)
    with acquire_workspace(cfg.output_dir, cfg.run_name):
        return run_pipeline(cfg)


def run_pipeline(cfg: PipelineConfig) -> dict:
    """The recipe's body, in the r1-pipeline flow, with the workspace locked: prepare, the
    stages of flows/recipe.py in order, the final evaluation, the summary."""
    ws = RunContext.open(cfg).workspace  # the process's setup for this config, once
    # settings that change results; where outputs and logs go, and what to force, do not
    settings = cfg.model_dump(exclude={"run_name", "output_dir", "tracking", "force", "storage"})
    with parent_run(
        Tracking.open(cfg.tracking.uri, cfg.tracking.experiment),
        cfg.run_name,
        {"pipeline": "r1", "seed": str(cfg.seed), "config_hash": config_hash(settings)},
        params=cfg.model_dump(),
        workspace=ws.root,  # a killed run of this workspace: its runs end, its parent goes on
        system_metrics=CHECKPOINT_STAGES,  # the training stages (and their final eval)
    ) as tracking:
        _describe(cfg, tracking)
        timings: dict[str, float] = {}
        t_start = time.perf_counter()

        def timed(name, fn, *a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            timings[name] = time.perf_counter() - t0
            return out

        prefix = cfg.run_name  # Prefect's run names: demo/prepare, demo/rl_1
        data = timed(
            "prepare",
            named(prepare, f"{prefix}/prepare"),
            cfg.data,
            cfg.model,
            cfg.seed,
            ws,
            rollout_declarations(cfg.rollout),
        )
        run = RecipeRun(cfg, ws, tracking, data)
        for stage in RECIPE:
            args, kwargs = stage.inputs(run, stage)
            out = timed(stage.name, named(stage.task, f"{prefix}/{stage.name}"), *args, **kwargs)
            run.outcomes[stage.name] = out
            if stage.publish is not None:
                stage.publish(stage.name, out, tracking)
        # Final evaluation: every stage's checkpoint, same held-out rows, same greedy decoding.
        results = timed(
            "final_evaluation",
            final_evaluation,
            cfg,
            ws,
            tracking,
            data["eval"],
            {s: run.outcomes[s].checkpoint for s in CHECKPOINT_STAGES},
            FinalEvalInputs(
                stage_runs={s: run.outcomes[s].run_id for s in CHECKPOINT_STAGES},
                same_as=same_evaluations(run),
                sft_steps=sft_steps(run),
                wall_times=timings,
            ),
        )
        return _finish(run, results, _summary(run, results, timings, t_start))


def _describe(cfg: PipelineConfig, tracking: Tracking) -> None:
    """The parent run's description and ``config.yaml`` (the whole config)."""
    import yaml

    parent = tracking.parent_run_id
    tracking.set_tags(parent, {"mlflow.note.content": run_note(cfg, parent)})
    tracking.log_text(parent, yaml.safe_dump(cfg.model_dump(), sort_keys=False), "config.yaml")


REJECTION_COUNTS = (
    "sampled",
    "passed",
    "duplicates",
    "capped",
    "kept",
    "acceptance_rate",
    "mixed_sft_rows",
)


def _summary(run: RecipeRun, results: dict, timings: dict[str, float], t_start: float) -> dict:
    """The pipeline's result: ``summary.json``, the Prefect artifact, what `grpo run` prints."""
    cfg, tracking, parent = run.cfg, run.tracking, run.tracking.parent_run_id
    rows = [
        {
            "stage": s,
            **results[s].summary_metrics(),
            "wall_time_s": timings[s],
            "checkpoint": run.outcomes[s].checkpoint,
        }
        for s in CHECKPOINT_STAGES
    ]
    rejection = run.outcomes["rejection_sampling"].metrics
    return {
        "run_name": cfg.run_name,
        "parent_run_id": parent,
        "tracking_uri": cfg.tracking.uri,
        "parent_run_url": tracking.run_url(parent),
        "experiment_url": tracking.experiment_url(),
        "prefect_ui": _flow_run_url(),
        "workspace": str(run.ws.root),
        "stages": rows,
        "rejection_sampling": {
            k: rejection[k]
            for k in REJECTION_COUNTS
            if k in rejection  # a result recorded before passed / duplicates were counted
        },
        "timings": timings,
        "total_time_s": time.perf_counter() - t_start,
    }


def _finish(run: RecipeRun, results: dict, summary: dict) -> dict:
    """Register the final checkpoint (when this run trained it), then the parent run's last
    tags, metrics and artifacts."""
    cfg, tracking, parent = run.cfg, run.tracking, run.tracking.parent_run_id
    final = run.outcomes[FINAL_STAGE]
    settings = STAGES[FINAL_STAGE].settings(cfg)
    if final.cached_iterations < settings.iterations or cfg.forced(FINAL_STAGE):
        mv = register_final_checkpoint(
            cfg.tracking.uri,
            parent,
            final.checkpoint,
            {s: results[s].summary_metrics() for s in CHECKPOINT_STAGES},
            final_stage=FINAL_STAGE,
        )
        summary["registered_model"] = f"{mv.name}/{mv.version}"
        summary["champion"] = mv.champion()  # flows.model_registry.registration_line prints both
    else:  # the same weights were registered by the run that trained them
        summary["registered_model"] = None
    note = run_note(cfg, parent, summary["stages"])
    policy = results[FINAL_STAGE].policy_id
    tracking.set_tags(parent, {"policy_id": policy, "mlflow.note.content": note})
    tracking.log_metrics(parent, {"total_time_s": summary["total_time_s"]})
    plot = _compare_plot(tracking, run.ws)
    tracking.log_json(parent, summary, "summary.json")
    publish_pipeline_artifact(summary, tracking, plot)
    return summary


def _flow_run_url() -> str | None:
    """This flow run's page in the Prefect UI, for a standing server (PREFECT_API_URL set)."""
    import os

    from prefect.runtime import flow_run
    from prefect.settings import PREFECT_UI_URL

    ui = PREFECT_UI_URL.value()
    if not os.environ.get("PREFECT_API_URL") or not ui or not flow_run.id:
        return None
    return f"{ui.rstrip('/')}/runs/flow-run/{flow_run.id}"


def _compare_plot(tracking: Tracking, ws: Workspace) -> str | None:
    """``grpo compare``'s table and PNG for this run, the PNG logged to the parent run
    (``compare/grpo-compare.png``); returns that artifact path."""
    import io

    from rich.console import Console

    from flows.compare import compare

    out = ws.root / "grpo-compare.png"
    compare(
        tracking.uri,
        [tracking.parent_run_id],
        output=out,
        log_artifact=True,
        console=Console(file=io.StringIO()),
    )
    return COMPARE_PLOT

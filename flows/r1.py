"""The DeepSeek-R1 recipe as one Prefect flow:

    prepare -> cold_start_sft -> rl_1 -> rejection_sampling -> re_sft -> rl_2
            -> final evaluation of every stage's checkpoint on the same held-out set

Each stage is a Prefect task (or subflow for RL) and an MLflow child run under one parent
run. Departures from the paper, at demo scale: re-SFT starts from the rl_1 checkpoint (R1
restarts from the base model with 800k samples; with a 1M-parameter model and a few hundred
samples, fine-tuning the RL policy on its own filtered samples is the stable choice), and
the cold-start SFT can stop early at a target dev accuracy so that RL starts in the band
where groups have reward variance.
"""

from __future__ import annotations

import time

from prefect import flow

from flows.config import CHECKPOINT_STAGES, PipelineConfig
from flows.deployments import R1_FLOW
from flows.final_eval import FinalEvalInputs, final_evaluation
from flows.lock import acquire_workspace
from flows.registry import register_final_checkpoint
from flows.rl import rl_stage
from flows.run_context import RunContext
from flows.run_names import named
from flows.summary import COMPARE_PLOT, publish_pipeline_artifact, publish_sft_artifact, run_note
from tasks.prepare import prepare
from tasks.rejection import rejection_sampling
from tasks.run_states import end_open_runs
from tasks.sft import sft_stage
from tasks.tracking import Tracking, config_hash
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
    """The recipe's body, in the r1-pipeline flow, with the workspace locked."""
    import yaml

    ws = RunContext.open(cfg).workspace  # the process's setup for this config, once
    # settings that change results; where outputs and logs go, and what to force, do not
    settings = cfg.model_dump(exclude={"run_name", "output_dir", "tracking", "force", "storage"})
    tracking = Tracking.open(cfg.tracking.uri, cfg.tracking.experiment).start_parent(
        cfg.run_name,
        {"pipeline": "r1", "seed": str(cfg.seed), "config_hash": config_hash(settings)},
        params=cfg.model_dump(),
        workspace=ws.root,  # a killed run of this workspace: its runs end, its parent goes on
        system_metrics=CHECKPOINT_STAGES,  # the training stages (and their final eval)
    )
    parent = tracking.parent_run_id
    tracking.set_tags(parent, {"mlflow.note.content": run_note(cfg, parent)})
    tracking.log_text(parent, yaml.safe_dump(cfg.model_dump(), sort_keys=False), "config.yaml")
    timings: dict[str, float] = {}
    ckpts: dict[str, str] = {}
    t_start = time.perf_counter()

    def timed(name, fn, *a, **kw):
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        timings[name] = time.perf_counter() - t0
        return out

    run = cfg.run_name
    data = timed("prepare", named(prepare, f"{run}/prepare"), cfg.data, cfg.model, cfg.seed, ws)
    common_rl = dict(
        rl_path=data["rl"],
        eval_path=data["eval"],
        eval_cfg=cfg.eval,
        weights=cfg.rewards,
        ws=ws,
        tracking=tracking,
        seed=cfg.seed,
        engine=cfg.rollout.engine_spec(),
        eval_engine=cfg.rollout.engine_spec(cfg.eval.engine),
    )

    sft = timed(
        "cold_start_sft",
        named(sft_stage, f"{run}/cold_start_sft"),
        "cold_start_sft",
        data["base"],
        data["sft"],
        str(ws.checkpoint("cold_start_sft")),
        cfg.sft,
        tracking,
        dev_path=data.get("dev"),
        max_completion_length=cfg.eval.max_completion_length,
        seed=cfg.seed,
        force=cfg.forced("cold_start_sft"),
    )
    ckpts["cold_start_sft"] = sft.checkpoint
    publish_sft_artifact("cold_start_sft", sft, tracking)

    rl1 = timed(
        "rl_1",
        named(rl_stage, f"{run}/rl_1"),
        "rl_1",
        ckpts["cold_start_sft"],
        cfg.rl,
        **common_rl,
        force=cfg.forced("rl_1"),
    )
    ckpts["rl_1"] = rl1.checkpoint

    rs = timed(
        "rejection_sampling",
        named(rejection_sampling, f"{run}/rejection_sampling"),
        ckpts["rl_1"],
        data["rl"],
        str(ws.stage_dir("rejection_sampling")),
        cfg.rejection_sampling,
        cfg.rewards,
        tracking,
        cfg.seed,
        force=cfg.forced("rejection_sampling"),
        engine=cfg.rollout.engine_spec(cfg.rejection_sampling.engine),
    )

    re = timed(
        "re_sft",
        named(sft_stage, f"{run}/re_sft"),
        "re_sft",
        ckpts["rl_1"],
        rs.path,
        str(ws.checkpoint("re_sft")),
        cfg.re_sft_config(),
        tracking,
        max_completion_length=cfg.eval.max_completion_length,
        seed=cfg.seed,
        force=cfg.forced("re_sft"),
    )
    ckpts["re_sft"] = re.checkpoint
    publish_sft_artifact("re_sft", re, tracking)

    rl2 = timed(
        "rl_2",
        named(rl_stage, f"{run}/rl_2"),
        "rl_2",
        ckpts["re_sft"],
        cfg.rl_2_config(),
        **common_rl,
        force=cfg.forced("rl_2"),
    )
    ckpts["rl_2"] = rl2.checkpoint

    # Final evaluation: every stage's checkpoint, same held-out rows, same greedy decoding.
    t0 = time.perf_counter()
    results = final_evaluation(
        cfg,
        ws,
        tracking,
        data["eval"],
        ckpts,
        FinalEvalInputs(
            stage_runs={
                "cold_start_sft": sft.run_id,
                "rl_1": rl1.run_id,
                "re_sft": re.run_id,
                "rl_2": rl2.run_id,
            },
            # an RL stage's last in-loop eval is this evaluation of its final weights, and its
            # start eval that of the stage before
            same_as={
                "cold_start_sft": rl1.start_eval_table,
                "rl_1": rl1.eval_table,
                "re_sft": rl2.start_eval_table,
                "rl_2": rl2.eval_table,
            },
            sft_steps={"cold_start_sft": sft.steps, "re_sft": re.steps},
            wall_times=timings,
        ),
    )
    timings["final_evaluation"] = time.perf_counter() - t0

    rows = [
        {
            "stage": s,
            **results[s].summary_metrics(),
            "wall_time_s": timings[s],
            "checkpoint": ckpts[s],
        }
        for s in CHECKPOINT_STAGES
    ]
    summary = {
        "run_name": cfg.run_name,
        "parent_run_id": parent,
        "tracking_uri": cfg.tracking.uri,
        "parent_run_url": tracking.run_url(parent),
        "experiment_url": tracking.experiment_url(),
        "prefect_ui": _flow_run_url(),
        "workspace": str(ws.root),
        "stages": rows,
        "rejection_sampling": {
            k: rs.metrics[k]
            for k in ("sampled", "passed", "duplicates", "capped", "kept", "acceptance_rate")
            if k in rs.metrics  # a result recorded before passed / duplicates were counted
        },
        "timings": timings,
        "total_time_s": time.perf_counter() - t_start,
    }
    if rl2.cached_iterations < cfg.rl_2_config().iterations or cfg.forced("rl_2"):
        mv = register_final_checkpoint(
            cfg.tracking.uri,
            parent,
            ckpts["rl_2"],
            {s: results[s].summary_metrics() for s in CHECKPOINT_STAGES},
            final_stage="rl_2",
        )
        summary["registered_model"] = f"{mv.name}/{mv.version}"
        summary["champion"] = mv.champion()  # flows.registry.registration_line prints both
    else:  # the same weights were registered by the run that trained them
        summary["registered_model"] = None
    note = run_note(cfg, parent, rows)
    tracking.set_tags(parent, {"policy_id": results["rl_2"].policy_id, "mlflow.note.content": note})
    tracking.log_metrics(parent, {"total_time_s": summary["total_time_s"]})
    plot = _compare_plot(tracking, ws)
    tracking.log_json(parent, summary, "summary.json")
    publish_pipeline_artifact(summary, tracking, plot)
    tracking.end(parent)
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

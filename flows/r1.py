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
from flows.lock import acquire_workspace
from flows.registry import register_final_checkpoint
from flows.rl import rl_stage
from flows.summary import publish_stage_artifact
from tasks.evaluate import evaluate_stage
from tasks.prepare import prepare
from tasks.rejection import rejection_sampling
from tasks.results import EvalOutcome
from tasks.run_states import end_open_runs
from tasks.sft import sft_stage
from tasks.tracking import Tracking, config_hash
from tasks.workspace import Workspace


def _end_tracking(flow, flow_run, state) -> None:
    """Flow hook: a failed pipeline ends its open MLflow runs FAILED; a crashed (interrupted:
    Ctrl-C, SIGTERM) or cancelled one ends them KILLED."""
    end_open_runs("FAILED" if state.is_failed() else "KILLED", flow_run=str(flow_run.id))


@flow(
    name="r1-pipeline",
    flow_run_name="{cfg.run_name}",
    log_prints=True,
    on_failure=[_end_tracking],
    on_crashed=[_end_tracking],
    on_cancellation=[_end_tracking],
)
def r1_pipeline(cfg: PipelineConfig) -> dict:
    # one run per workspace (the `grpo` CLI already holds the lock: this nests)
    with acquire_workspace(cfg.output_dir, cfg.run_name):
        return run_pipeline(cfg)


def run_pipeline(cfg: PipelineConfig) -> dict:
    """The recipe's body, in the r1-pipeline flow, with the workspace locked."""
    import yaml

    if cfg.torch_threads:
        import torch

        torch.set_num_threads(cfg.torch_threads)
    ws = Workspace.create(cfg.output_dir, cfg.run_name)
    # settings that change results; where outputs and logs go, and what to force, do not
    settings = cfg.model_dump(exclude={"run_name", "output_dir", "tracking", "force"})
    tracking = Tracking.open(cfg.tracking.uri, cfg.tracking.experiment).start_parent(
        cfg.run_name,
        {"pipeline": "r1", "seed": str(cfg.seed), "config_hash": config_hash(settings)},
        params=cfg.model_dump(),
        workspace=ws.root,  # a killed run of this workspace: its runs end, its parent goes on
    )
    parent = tracking.parent_run_id
    tracking.log_text(parent, yaml.safe_dump(cfg.model_dump(), sort_keys=False), "config.yaml")
    timings: dict[str, float] = {}
    ckpts: dict[str, str] = {}
    t_start = time.perf_counter()

    def timed(name, fn, *a, **kw):
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        timings[name] = time.perf_counter() - t0
        return out

    data = timed("prepare", prepare, cfg.data, cfg.model, cfg.seed, ws)
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
        sft_stage,
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

    rl1 = timed(
        "rl_1",
        rl_stage,
        "rl_1",
        ckpts["cold_start_sft"],
        cfg.rl,
        **common_rl,
        force=cfg.forced("rl_1"),
    )
    ckpts["rl_1"] = rl1["checkpoint"]

    rs = timed(
        "rejection_sampling",
        rejection_sampling,
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
        sft_stage,
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

    rl2 = timed(
        "rl_2",
        rl_stage,
        "rl_2",
        ckpts["re_sft"],
        cfg.rl_2_config(),
        **common_rl,
        force=cfg.forced("rl_2"),
    )
    ckpts["rl_2"] = rl2["checkpoint"]

    # Final evaluation: every stage's checkpoint, same held-out rows, same greedy decoding.
    t0 = time.perf_counter()
    eval_run = tracking.start_child("final_evaluation", config=cfg.eval.model_dump())
    results: dict[str, EvalOutcome] = {}
    stage_runs = {
        "cold_start_sft": sft.run_id,
        "rl_1": rl1["run_id"],
        "re_sft": re.run_id,
        "rl_2": rl2["run_id"],
    }
    for stage in CHECKPOINT_STAGES:
        ev = evaluate_stage(
            stage,
            ckpts[stage],
            data["eval"],
            cfg.eval,
            str(ws.eval_table(stage)),
            force=cfg.forced("final_evaluation"),
            engine=cfg.rollout.engine_spec(cfg.eval.engine),
        )
        results[stage] = ev
        summary_metrics = ev.summary_metrics()
        metrics = {f"{stage}/eval/{k}": v for k, v in summary_metrics.items()}
        tracking.log_metrics(parent, metrics)
        tracking.log_metrics(eval_run, metrics)
        tracking.log_artifact(eval_run, ev.table, "eval_tables")
        # the stage's own run gets its final held-out numbers, table and sample completions
        tracking.log_metrics(
            stage_runs[stage], {f"final_eval/{k}": v for k, v in summary_metrics.items()}
        )
        tracking.log_artifact(stage_runs[stage], ev.table, "eval")
        tracking.log_json(stage_runs[stage], ev.samples, "eval_samples.json")
        publish_stage_artifact(
            stage, summary_metrics, stage_runs[stage], cfg.tracking.uri, ev.samples
        )
    tracking.log_json(
        eval_run, {s: results[s].samples for s in CHECKPOINT_STAGES}, "eval_samples.json"
    )
    tracking.end(eval_run)
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
        "workspace": str(ws.root),
        "stages": rows,
        "rejection_sampling": {k: rs.metrics[k] for k in ("sampled", "kept", "acceptance_rate")},
        "timings": timings,
        "total_time_s": time.perf_counter() - t_start,
    }
    if rl2["cached_iterations"] < cfg.rl_2_config().iterations or cfg.forced("rl_2"):
        mv = register_final_checkpoint(
            cfg.tracking.uri,
            parent,
            ckpts["rl_2"],
            {s: results[s].summary_metrics() for s in CHECKPOINT_STAGES},
            final_stage="rl_2",
        )
        summary["registered_model"] = f"{mv.name}/{mv.version}"
    else:  # the same weights were registered by the run that trained them
        summary["registered_model"] = None
    tracking.set_tags(parent, {"policy_id": results["rl_2"].policy_id})
    tracking.log_metrics(parent, {"total_time_s": summary["total_time_s"]})
    tracking.log_json(parent, summary, "summary.json")
    tracking.end(parent)
    return summary

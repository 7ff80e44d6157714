"""SFT stage task (cold start and re-SFT): load, train on completions, save, log.

Cached on (SFT config, init checkpoint weights, data files, code version): an unchanged
rerun records a child run tagged ``cached=true`` with the stored summary and trains nothing.
Every ``checkpoint_every`` steps the training state goes to ``<checkpoint>.resume/``
(``Workspace.resume_checkpoint``); a rerun with the same cache key continues from there, and
the directory is deleted once the stage's output and manifest are written.
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
from dataclasses import dataclass
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from cluster import process, storage
from grpo_core.config.stages import SFTConfig
from grpo_core.config.tools import tool_spec_of
from grpo_core.contracts.prompts import load_rows
from grpo_core.training.checkpoint import policy_id, save_checkpoint
from tasks.cache import cached, stage_key, tool_code
from tasks.policies import loading
from tasks.policies.trainer import open_trainer
from tasks.results import SFTOutcome
from tasks.run_log import logger, pull, timer
from tasks.tracking.runs import stage_run
from tasks.tracking.stages import Tracking
from tasks.workspace import Workspace


@dataclass(frozen=True)
class SFTRequest:
    """One SFT stage's training: from ``init_checkpoint`` on ``data_path`` to
    ``out_checkpoint`` with ``cfg``; ``dev_path``: the dev rows of early stopping
    (``cfg.target_accuracy``), sampled up to ``max_completion_length`` tokens, with ``tools``
    (``rollout.tools``' settings) and scored by ``accuracy_reward``; ``resume_key``: a run
    with the same key resumes from the mid-stage checkpoint (``cfg.checkpoint_every``)."""

    stage: str
    init_checkpoint: str
    data_path: str
    out_checkpoint: str
    cfg: SFTConfig
    dev_path: str | None = None
    max_completion_length: int = 48
    seed: int = 0
    tools: Any = None
    accuracy_reward: str = "accuracy"
    resume_key: str = ""


def train_stage(
    request: SFTRequest, *, on_step=None, on_resume=None, data_parallel=None
) -> SFTOutcome:
    """Train as ``request`` says; save; the summary.

    With ``cfg.checkpoint_every`` > 0 the state is saved every K steps beside the output
    (``Workspace.resume_checkpoint``) and a run with the same ``resume_key`` resumes from it.
    ``data_parallel``: this is one rank of the trainer group (:func:`run_sft`); rank 0
    writes the checkpoint.
    """
    from grpo_core.training.memory import PeakMemory  # torch: only when the stage really trains
    from grpo_core.training.parallel import LOCAL
    from grpo_core.training.sft import train_sft

    r, cfg, stage = request, request.cfg, request.stage
    init_checkpoint, out_checkpoint, dev_path = r.init_checkpoint, r.out_checkpoint, r.dev_path
    data_path = r.data_path
    log = logger(__name__)
    dp = data_parallel or LOCAL
    pull(init_checkpoint, data_path, dev_path)  # a rank on a node without the run folder
    rows = load_rows(data_path, required=("prompt", "completion"))
    w = open_trainer().learner_at(init_checkpoint, lora_base=init_checkpoint)
    w.train = None  # SFT builds its own optimizer; an RL stage's must not ride through it
    w.policy_id = None  # the weights change from here: no id until they are saved
    dp.prepare_model(w.model, lora=bool(w.lora_info()))  # ranks: equal, or sharded
    dev_rows = load_rows(dev_path) if dev_path and cfg.target_accuracy is not None else None
    log.info(
        "%s: %d examples, up to %d steps from %s", stage, len(rows), cfg.max_steps, init_checkpoint
    )

    with timer() as t, PeakMemory(w.model.device) as mem:
        result = train_sft(
            w.model,
            w.tokenizer,
            rows,
            cfg.training,
            seed=r.seed,
            dev_eval=_dev_eval(
                w, dev_rows, r.max_completion_length, stage, r.tools, r.accuracy_reward
            ),
            on_step=on_step,
            desc=stage,
            resume_dir=Workspace.resume_checkpoint(out_checkpoint),
            resume_key=r.resume_key,
            on_resume=on_resume,
            logger=log,
            parallel=dp,
        )
    info = {"stage": stage, "steps": result.steps, "resumed_from": result.resumed_from}
    _save(w, out_checkpoint, {**info, **w.lora_info()}, dp)
    w.trained(out_checkpoint, policy_id(out_checkpoint))
    log.info(
        "%s: %d steps in %.1fs, final loss %.4f, peak memory %.2f GiB%s",
        stage,
        result.steps,
        t["seconds"],
        result.final_loss,
        mem.gib,
        " (dev target reached)" if result.stopped_early else "",
    )
    return SFTOutcome(
        checkpoint=str(out_checkpoint),
        steps=result.steps,
        final_loss=result.final_loss,
        stopped_early=bool(result.stopped_early),
        wall_time_s=t["seconds"],
        train_examples=len(rows),
        policy_id=w.policy_id,
        peak_memory_gib=mem.gib,
        history=result.history if data_parallel is not None else None,
    )


def _save(w, out_checkpoint: str, info: dict, dp) -> None:
    """The trained policy to ``out_checkpoint``; on ranks, written by rank 0 (a sharded
    model's weights gathered to it first) and shared through the store."""
    weights = dp.full_state_dict(w.model) if dp.sharded else None  # a collective
    if dp.rank == 0:
        save_checkpoint(w.model, w.tokenizer, out_checkpoint, info=info, state_dict=weights)
        if dp.world_size > 1:
            storage.publish(out_checkpoint)
    dp.barrier()  # the checkpoint exists when any rank returns
    if dp.rank != 0:
        pull(out_checkpoint)


def sft_on_rank(data_parallel, model_options, request: SFTRequest) -> SFTOutcome:
    """One rank of the trainer group (a Ray actor): the run's model load options, then
    :func:`train_stage` with this rank's ``data_parallel``."""
    process.load_policies_with(model_options)
    return train_stage(request, data_parallel=data_parallel)


def run_sft(request: SFTRequest, *, on_step=None, on_resume=None) -> SFTOutcome:
    """:func:`train_stage` where this process's executor trains: here, with the live step
    callbacks, or on every rank of the trainer group (``cluster.backend: ray``), whose
    per-step metrics ``on_resume`` gets once rank 0 returns them."""
    from cluster import runtime

    out = runtime.executor().update(
        functools.partial(train_stage, on_step=on_step, on_resume=on_resume),
        functools.partial(sft_on_rank, model_options=loading.options()),
        {"request": request},
        what=f"{request.stage} SFT",
        out_checkpoint=request.out_checkpoint,
    )
    if out.history is not None and on_resume is not None:
        on_resume(out.steps, out.history)
    return dataclasses.replace(out, history=None)


def _dev_eval(
    w,
    dev_rows: list[dict] | None,
    max_completion_length: int,
    stage: str,
    tools=None,
    accuracy_reward: str = "accuracy",
):
    """Greedy accuracy of the model in training on ``dev_rows`` (early stopping) by
    ``accuracy_reward`` (``eval.accuracy_reward``); None without dev rows. ``tools``
    (``rollout.tools``' settings): the episodes sample with the tool through the turn loop,
    as the held-out evals do (an environment's own reward included)."""
    if not dev_rows:
        return None
    from grpo_core.algorithm.evaluation import evaluate

    def dev_eval() -> float:
        return evaluate(
            w.model,
            w.tokenizer,
            dev_rows,
            max_new_tokens=max_completion_length,
            desc=f"{stage} dev",
            tools=tools or None,
            accuracy_reward=accuracy_reward,
        ).accuracy

    return dev_eval


@task(name="sft", task_run_name="{stage}", cache_policy=NO_CACHE)
def sft_stage(
    stage: str,
    init_checkpoint: str,
    data_path: str,
    out_checkpoint: str,
    cfg: SFTConfig,
    tracking: Tracking,
    *,
    dev_path: str | None = None,
    max_completion_length: int = 48,
    seed: int = 0,
    force: bool = False,
    tools: dict | None = None,
    accuracy_reward: str = "accuracy",
) -> SFTOutcome:
    """``tools``: ``rollout.tools``' settings, for a dev eval (``target_accuracy``) of a
    tool-using policy; ``accuracy_reward``: what the dev eval scores (``eval.accuracy_reward``)."""
    # checkpoint_every changes where training can resume from, not its result
    knobs = cfg.model_dump(exclude={"checkpoint_every"})
    settings = {**knobs, "max_completion_length": max_completion_length, "seed": seed}
    tools = tool_spec_of(tools)
    if tools:  # the dev eval's environment decides where early stopping stops
        settings["tools"] = tools.as_dict()
    if accuracy_reward != "accuracy" and cfg.target_accuracy is not None:  # the default:
        settings["accuracy_reward"] = accuracy_reward  # left out, keys stay as they were
    with stage_run(
        tracking, stage, {"init_checkpoint": init_checkpoint}, config=settings
    ) as run_id:
        tracking.log_params(run_id, cfg.model_dump())
        tracking.log_json(
            run_id,
            {"stage": stage, "init_checkpoint": init_checkpoint, "data": data_path, **settings},
            "stage_config.json",
        )
        inputs = [init_checkpoint, data_path] + (
            [dev_path] if dev_path and cfg.target_accuracy is not None else []
        )
        code = tool_code(tools) if cfg.target_accuracy is not None else ()
        key = stage_key("sft", settings, inputs, code=code)

        log_step, log_restored = _step_loggers(tracking, run_id)
        out = cached(
            stage,
            out_checkpoint,
            key,
            force=force,
            compute=lambda: run_sft(
                SFTRequest(
                    stage=stage,
                    init_checkpoint=init_checkpoint,
                    data_path=data_path,
                    out_checkpoint=out_checkpoint,
                    cfg=cfg,
                    dev_path=dev_path,
                    max_completion_length=max_completion_length,
                    seed=seed,
                    tools=tools,
                    accuracy_reward=accuracy_reward,
                    resume_key=key,
                ),
                on_step=log_step,
                on_resume=log_restored,
            ),
        )
        # done (trained or reused): the mid-stage checkpoint is no longer needed
        shutil.rmtree(Workspace.resume_checkpoint(out_checkpoint), ignore_errors=True)
        _log_outcome(tracking, run_id, out, key)
    return dataclasses.replace(out, run_id=run_id)


def _step_loggers(tracking: Tracking, run_id: str):
    """The SFT loop's callbacks: every 10th step (and each dev eval) to the stage's run, and
    a resumed stage's restored curve up to its resume point."""

    def logged(step: int, m: dict) -> bool:
        return step % 10 == 0 or "dev/accuracy" in m

    def log_step(step: int, m: dict) -> None:
        if logged(step, m):
            tracking.log_metrics(run_id, m, step)

    def log_restored(_: int, history: list[dict]) -> None:
        pending = tracking.pending(run_id)
        for step, m in enumerate(history, 1):
            if logged(step, m):
                pending.add(m, step)
        pending.flush()

    return log_step, log_restored


def _log_outcome(tracking: Tracking, run_id: str, out: SFTOutcome, key: str) -> None:
    """The stage's summary metrics at its last step, and its tags."""
    summary = {
        "steps": out.steps,
        "final_loss": out.final_loss,
        "stopped_early": float(out.stopped_early),
        "wall_time_s": out.wall_time_s,
        "train_examples": out.train_examples,
        "peak_memory_gib": out.peak_memory_gib,
    }
    tracking.log_metrics(run_id, summary, out.steps)
    tracking.set_tags(
        run_id, {"policy_id": out.policy_id, "cache_key": key, "cached": str(out.cached).lower()}
    )

"""The DeepSeek-R1 recipe as a table: each stage's name, the task or subflow it runs, its
settings, and where its inputs come from (prepare's files or an earlier stage's output).
flows/r1.py runs the table in order; the benchmarks run single stages of it with the same
arguments (:func:`sft_inputs`, :func:`rl_inputs`).

Each stage returns a typed result (tasks/results.py): the SFT stages an ``SFTOutcome``, the
RL stages an ``RLStageOutcome``, rejection sampling a ``RejectionOutcome`` (its ``path`` is
re-SFT's data).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from flows.config import PipelineConfig
from flows.rl import rl_stage
from flows.summary import publish_sft_artifact
from tasks.rejection import rejection_sampling
from tasks.results import RejectionOutcome, RLStageOutcome, SFTOutcome
from tasks.sft import sft_stage
from tasks.tracking.stages import Tracking
from tasks.workspace import Workspace

StageResult = SFTOutcome | RLStageOutcome | RejectionOutcome


@dataclass
class RecipeRun:
    """What the stages of one pipeline share, and the results of those that ran."""

    cfg: PipelineConfig
    ws: Workspace
    tracking: Tracking
    data: dict[str, str]  # prepare's files: base (checkpoint), sft, rl, eval[, dev]
    outcomes: dict[str, StageResult] = field(default_factory=dict)  # stage -> its result

    def checkpoint(self, source: str) -> str:
        """A stage's starting checkpoint: prepare's ``base`` or an earlier stage's."""
        return self.data[source] if source in self.data else self.outcomes[source].checkpoint

    def file(self, source: str) -> str:
        """A stage's data: a split prepare wrote or an earlier stage's file."""
        return self.data[source] if source in self.data else self.outcomes[source].path


@dataclass(frozen=True)
class Stage:
    name: str
    task: Any  # the Prefect task or flow it runs
    inputs: Callable[[RecipeRun, Stage], tuple[tuple, dict]]  # its arguments
    settings: Callable[[PipelineConfig], Any]  # its config section
    init: str  # its starting checkpoint: prepare's ``base`` or an earlier stage's
    data: str | None = None  # its data (SFT, rejection sampling): a split or a stage's file
    dev: str | None = None  # the dev split an SFT stage may stop early on
    publish: Callable | None = None  # its Prefect artifact, published when it ends


def sft_inputs(run: RecipeRun, stage: Stage) -> tuple[tuple, dict]:
    cfg = run.cfg
    args = (
        stage.name,
        run.checkpoint(stage.init),
        run.file(stage.data),
        str(run.ws.checkpoint(stage.name)),
        stage.settings(cfg),
        run.tracking,
    )
    kwargs = {
        "max_completion_length": cfg.eval.max_completion_length,
        "seed": cfg.seed,
        "force": cfg.forced(stage.name),
    }
    if stage.dev:
        kwargs = {"dev_path": run.data.get(stage.dev), **kwargs}
        if stage.settings(cfg).target_accuracy is not None:
            kwargs["accuracy_reward"] = cfg.eval.accuracy_reward
        tools = cfg.rollout.tool_spec()
        if tools and stage.settings(cfg).target_accuracy is not None:
            kwargs["tools"] = tools  # the dev eval samples with the tool, as the evals do
    return args, kwargs


def rl_inputs(run: RecipeRun, stage: Stage) -> tuple[tuple, dict]:
    cfg = run.cfg
    kwargs = {
        "rl_path": run.data["rl"],
        "eval_path": run.data["eval"],
        "eval_cfg": cfg.eval,
        "weights": cfg.rewards,
        "ws": run.ws,
        "tracking": run.tracking,
        "seed": cfg.seed,
        "engine": cfg.rollout.engine_spec(),
        "eval_engine": cfg.rollout.engine_spec(cfg.eval.engine),
        "force": cfg.forced(stage.name),
    }
    return (stage.name, run.checkpoint(stage.init), stage.settings(cfg)), kwargs


def rejection_inputs(run: RecipeRun, stage: Stage) -> tuple[tuple, dict]:
    cfg = run.cfg
    settings = stage.settings(cfg)
    args = (
        run.checkpoint(stage.init),
        run.file(stage.data),
        str(run.ws.stage_dir(stage.name)),
        settings,
        cfg.rewards,
        run.tracking,
        cfg.seed,
    )
    kwargs = {"force": cfg.forced(stage.name), "engine": cfg.rollout.engine_spec(settings.engine)}
    if settings.mix_sft_rows:  # some of the cold-start data goes into the re-SFT set
        kwargs["cold_start_data"] = run.data["sft"]
    return args, kwargs


# The recipe in order; its departures from the paper are in flows/r1.py's docstring.
RECIPE: tuple[Stage, ...] = (
    Stage(
        "cold_start_sft",
        sft_stage,
        sft_inputs,
        PipelineConfig.sft_config,
        init="base",
        data="sft",
        dev="dev",
        publish=publish_sft_artifact,
    ),
    Stage("rl_1", rl_stage, rl_inputs, attrgetter("rl"), init="cold_start_sft"),
    Stage(
        "rejection_sampling",
        rejection_sampling,
        rejection_inputs,
        attrgetter("rejection_sampling"),
        init="rl_1",
        data="rl",
    ),
    Stage(
        "re_sft",
        sft_stage,
        sft_inputs,
        PipelineConfig.re_sft_config,
        init="rl_1",
        data="rejection_sampling",
        publish=publish_sft_artifact,
    ),
    Stage("rl_2", rl_stage, rl_inputs, PipelineConfig.rl_2_config, init="re_sft"),
)
STAGES = {stage.name: stage for stage in RECIPE}
FINAL_STAGE = RECIPE[-1].name  # its checkpoint is the one registered


def same_evaluations(run: RecipeRun) -> dict[str, str | None]:
    """Stage -> an eval table that is already its final evaluation: an RL stage's last
    in-loop eval is that of its final weights, and its start eval that of the stage it
    starts from."""
    same: dict[str, str | None] = {}
    for stage in RECIPE:
        if stage.inputs is rl_inputs:
            out = run.outcomes[stage.name]
            same[stage.init] = out.start_eval_table
            same[stage.name] = out.eval_table
    return same


def sft_steps(run: RecipeRun) -> dict[str, int]:
    """SFT stage -> its last optimizer step (the MLflow step of its final evaluation)."""
    return {s.name: run.outcomes[s.name].steps for s in RECIPE if s.inputs is sft_inputs}

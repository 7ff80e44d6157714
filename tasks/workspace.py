"""Named locations of a pipeline run (nanochat's checkpoint manager): stages hand over
through these paths, never ad-hoc ones.

    runs/<run_name>/
      data/{sft,rl,dev,eval}.jsonl         demo data (or the user's files, referenced)
      checkpoints/base/                     the initial model
      checkpoints/<stage>/                  stage outputs (cold_start_sft, rl_1, re_sft, rl_2)
      checkpoints/<stage>.resume/           an SFT stage's last mid-stage checkpoint, until done
      <rl stage>/iter_0007/rollouts.parquet, scored.parquet, policy.json, eval.parquet
      <rl stage>/iter_0009/checkpoint/      an RL save point's state (rl.save_steps, save_total_limit)
      rejection_sampling/rollouts.parquet, scored.parquet, sft.jsonl
      eval/<stage>.parquet                  held-out eval table per stage checkpoint
      offline/rollouts-0000.parquet, update-<tag>/   standalone stage runs (flows/stages.py)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from grpo_core.contracts.run_folder import RUN_MARKER

ROLLOUTS = "rollouts.parquet"
SCORED = "scored.parquet"


@dataclass(frozen=True)
class Workspace:
    root: Path

    @classmethod
    def create(cls, output_dir: str | Path, run_name: str) -> Workspace:
        root = Path(output_dir).resolve() / run_name
        root.mkdir(parents=True, exist_ok=True)
        (root / RUN_MARKER).touch()  # cache records hold paths relative to this folder
        return cls(root)

    def data(self, split: str) -> Path:
        return self.root / "data" / f"{split}.jsonl"

    def checkpoint(self, stage: str) -> Path:
        return self.root / "checkpoints" / stage

    def iteration_dir(self, stage: str, iteration: int) -> Path:
        return self.root / stage / f"iter_{iteration:04d}"

    def rollouts(self, stage: str, iteration: int) -> Path:
        return self.iteration_dir(stage, iteration) / ROLLOUTS

    def scored(self, stage: str, iteration: int) -> Path:
        return self.iteration_dir(stage, iteration) / SCORED

    def iteration_checkpoint(self, stage: str, iteration: int) -> Path:
        """The checkpoint an RL iteration's update keeps at a save point (``rl.save_steps``)."""
        return self.iteration_dir(stage, iteration) / "checkpoint"

    def policy_ref(self, stage: str, iteration: int) -> Path:
        """The record of an RL iteration's new policy (tasks/policies/ref.py), kept or not."""
        return self.iteration_dir(stage, iteration) / "policy.json"

    def start_eval_table(self, stage: str) -> Path:
        """The held-out eval of an RL stage's starting checkpoint (its curves' step 0)."""
        return self.stage_dir(stage) / "eval_start.parquet"

    def iteration_eval_table(self, stage: str, iteration: int) -> Path:
        return self.iteration_dir(stage, iteration) / "eval.parquet"

    def eval_table(self, stage: str) -> Path:
        return self.root / "eval" / f"{stage}.parquet"

    def stage_dir(self, stage: str) -> Path:
        return self.root / stage

    def offline_rollouts(self, iteration: int) -> Path:
        return self.root / "offline" / f"rollouts-{iteration:04d}.parquet"

    def offline_update(self, tag: str) -> Path:
        return self.root / "offline" / f"update-{tag}"

    @staticmethod
    def rescored(rollouts: str | Path, tag: str) -> Path:
        """A re-scored copy of any rollouts file, beside it, named by the scoring settings."""
        return Path(rollouts).with_name(f"scored-{tag}.parquet")

    @staticmethod
    def resume_checkpoint(checkpoint: str | Path) -> Path:
        """Beside a stage's output checkpoint: the mid-stage checkpoint a rerun resumes from
        (SFT writes it every ``checkpoint_every`` steps and deletes it once its output is
        saved)."""
        return Path(checkpoint).with_name(f"{Path(checkpoint).name}.resume")

    @staticmethod
    def checkpoint_eval_table(checkpoint: str | Path, tag: str) -> Path:
        """An eval table of any checkpoint, beside it, named by the eval settings."""
        return Path(checkpoint).with_name(f"{Path(checkpoint).name}.eval-{tag}.parquet")


@dataclass(frozen=True)
class SamplingDir:
    """A sampling stage's directory (rejection sampling): rollouts, their scores, and the
    SFT data kept from them."""

    root: Path

    @property
    def rollouts(self) -> Path:
        return self.root / ROLLOUTS

    @property
    def scored(self) -> Path:
        return self.root / SCORED

    @property
    def sft_data(self) -> Path:
        return self.root / "sft.jsonl"

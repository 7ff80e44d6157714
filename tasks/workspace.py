"""Named locations of a pipeline run (nanochat's checkpoint manager): stages hand over
through these paths, never ad-hoc ones.

    runs/<run_name>/
      data/{sft,rl,dev,eval}.jsonl         demo data (or the user's files, referenced)
      checkpoints/base/                     the initial model
      checkpoints/<stage>/                  stage outputs (cold_start_sft, rl_1, re_sft, rl_2)
      <rl stage>/iter_0007/rollouts.parquet, scored.parquet, checkpoint/
      rejection_sampling/sft.jsonl, scored.parquet
      eval/<stage>.parquet                  held-out eval table per stage checkpoint
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Workspace:
    root: Path

    @classmethod
    def create(cls, output_dir: str | Path, run_name: str) -> Workspace:
        root = Path(output_dir).resolve() / run_name
        root.mkdir(parents=True, exist_ok=True)
        return cls(root)

    def data(self, split: str) -> Path:
        return self.root / "data" / f"{split}.jsonl"

    def checkpoint(self, stage: str) -> Path:
        return self.root / "checkpoints" / stage

    def iteration_dir(self, stage: str, iteration: int) -> Path:
        return self.root / stage / f"iter_{iteration:04d}"

    def rollouts(self, stage: str, iteration: int) -> Path:
        return self.iteration_dir(stage, iteration) / "rollouts.parquet"

    def scored(self, stage: str, iteration: int) -> Path:
        return self.iteration_dir(stage, iteration) / "scored.parquet"

    def iteration_checkpoint(self, stage: str, iteration: int) -> Path:
        return self.iteration_dir(stage, iteration) / "checkpoint"

    def eval_table(self, stage: str) -> Path:
        return self.root / "eval" / f"{stage}.parquet"

    def stage_dir(self, stage: str) -> Path:
        return self.root / stage

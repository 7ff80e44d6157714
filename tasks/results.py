"""What the stage tasks return: small typed records, not mixed dicts.

``metrics`` holds only numbers with TRL's names (what goes to MLflow); whether the result
came from the stage cache is ``cached``, never a metric. The cache (tasks/cache.py) records
each result as JSON and rebuilds the same type on a hit. A field marked ``NOT_RECORDED``
(the MLflow run id, set after the cached call with ``dataclasses.replace``) is left out of
the record, so a hit never replays another run's id. Every record here is an ``...Outcome``
(what a stage task returns); grpo_core's functions return ``...Result`` (``ScoreResult``: one
batch's scores, ``SFTResult``: the training loop's history, ``EvalResult``), which these
summarise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

NOT_RECORDED = {"record": False}  # field metadata: not written to the cache manifest


@dataclass(frozen=True)
class RolloutOutcome:
    path: str  # the rollouts Parquet
    metrics: dict[str, float]  # completions/*, timing/rollout_s, rollout/tokens_per_s
    cached: bool = False
    # (start, end) on time.monotonic of the engine process's work on it (rl.async_level)
    engine_busy: tuple | None = field(default=None, metadata=NOT_RECORDED)


@dataclass(frozen=True)
class ScoreOutcome:
    path: str  # the scored Parquet
    metrics: dict[str, float]  # reward, reward_std, rewards/<fn>/*, frac_reward_zero_std, ...
    cached: bool = False


@dataclass(frozen=True)
class UpdateOutcome:
    checkpoint: str  # the policy after the update (its record, tasks/policies/ref.py, in a stage)
    global_step: int  # optimizer steps so far in the stage
    history: list[dict[str, float]] = field(default_factory=list)  # one entry per step
    seconds: float = 0.0  # wall time of the optimizer steps
    peak_memory_gib: float = 0.0  # grpo_core.training.memory.PeakMemory of the update
    policy_id: str = ""  # the new weights' content hash (grpo_core/training/weights_id.py)
    kept: bool = True  # a checkpoint of the new weights (and trainer state) was written
    cached: bool = False


@dataclass(frozen=True)
class SFTOutcome:
    checkpoint: str  # the trained policy
    steps: int  # optimizer steps taken
    final_loss: float  # training loss of the last step
    stopped_early: bool  # stopped at SFTConfig.target_accuracy on the dev split
    wall_time_s: float  # wall time of the training loop
    train_examples: int  # rows in the SFT data file
    policy_id: str  # weights hash of ``checkpoint``
    peak_memory_gib: float = 0.0  # grpo_core.training.memory.PeakMemory of the training loop
    run_id: str | None = field(default=None, metadata=NOT_RECORDED)  # the stage's MLflow run
    cached: bool = False
    # trained on the trainer group's ranks: each step's metrics, for the driver to log
    history: list[dict] | None = field(default=None, metadata=NOT_RECORDED)


@dataclass(frozen=True)
class EvalOutcome:
    """A checkpoint's held-out greedy evaluation (``grpo_core.algorithm.evaluation.EvalResult.summary``
    plus where it came from); named apart from that class, which holds the whole table."""

    accuracy: float  # pass@1: share of completions with full accuracy reward (all tests pass)
    format_rate: float  # mean of the format reward
    mean_length: float  # mean completion length in tokens
    num_examples: float  # rows evaluated (a float, as in EvalResult.summary)
    wall_time_s: float  # wall time of the evaluation
    table: str | None  # the per-example Parquet, or None when not written
    policy_id: str  # weights hash of the evaluated checkpoint
    samples: list[dict[str, Any]] = field(default_factory=list)  # first rows of the table
    cached: bool = False
    num_samples: int = 1  # k completions per problem (eval.num_samples); 1: greedy
    pass_at_k: float | None = None  # k > 1: Chen et al.'s unbiased pass@k
    maj_at_k: float | None = None  # k > 1: majority vote of extracted answers (None for code)

    def summary_metrics(self) -> dict[str, float]:
        """The held-out numbers logged per stage (accuracy, format_rate, mean_length; with
        eval.num_samples > 1 also pass_at_k and maj_at_k when there is one)."""
        out = {
            "accuracy": self.accuracy,
            "format_rate": self.format_rate,
            "mean_length": self.mean_length,
        }
        if self.num_samples > 1:
            out["pass_at_k"] = self.pass_at_k
            if self.maj_at_k is not None:
                out["maj_at_k"] = self.maj_at_k
        return out


@dataclass(frozen=True)
class RejectionOutcome:
    path: str  # the SFT JSONL of kept completions (prompt, completion, answer, ...)
    # sampled, passed (met the requirements), duplicates and capped (passed, dropped as a
    # repeat / by max_per_prompt), kept (= passed - duplicates - capped), pass_rate (passed /
    # sampled), acceptance_rate (kept / sampled), prompts_covered, reward, rewards/<fn>/*,
    # completions/mean_length
    metrics: dict[str, float]
    run_id: str | None = field(default=None, metadata=NOT_RECORDED)  # the stage's MLflow run
    cached: bool = False


@dataclass(frozen=True)
class RLStageOutcome:
    """What an RL stage (flows/rl.py, a subflow) hands to the recipe."""

    checkpoint: str  # the stage's final policy (checkpoints/<stage>)
    run_id: str  # the stage's MLflow run
    global_step: int  # optimizer steps of the stage
    wall_time_s: float
    evals: list[dict[str, Any]]  # each held-out eval: iterations_done, step, its metrics
    eval_table: str | None  # the last in-loop eval's table (of the final weights)
    start_eval_table: str | None  # the starting checkpoint's (rl.eval_on_start), or None
    cached_iterations: int  # iterations reused from the stage cache

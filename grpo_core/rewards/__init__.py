"""Reward functions with TRL's signature, a registry, and failure-tolerant batch scoring.

    from grpo_core import rewards
    fn = rewards.get("accuracy")                  # or "my_pkg.my_mod:my_reward"
    fn(prompts, completions, answer=answers)      # -> list[float | None]
    rewards.score_completions(prompts, completions, {"answer": answers},
                              {"accuracy": 1.0, "format": 0.5})   # -> ScoreResult

Built-in names: ``accuracy``, ``math_verify``, ``format``, ``tag_count``,
``language_consistency``, ``soft_overlong``, ``cosine``, ``repetition``, ``code_tests``,
``code_compiles``, ``code_runs``, ``code_ruff_clean``, ``test_has_assert``. Each is
registered once with what else the pipeline needs to know of it (``spec(name)``: the data
columns it reads, its answer extraction, whether it runs the program). See docs/rewards.md.
"""

from grpo_core.rewards import accuracy as _accuracy  # noqa: F401  (registers)
from grpo_core.rewards import code as _code  # noqa: F401
from grpo_core.rewards import environment as _environment  # noqa: F401
from grpo_core.rewards import format as _format  # noqa: F401
from grpo_core.rewards import length as _length  # noqa: F401
from grpo_core.rewards.base import (
    REWARDS,
    RewardFn,
    RewardSpec,
    RewardUnavailable,
    Scores,
    completion_text,
    executing,
    get,
    load_user_function,
    names,
    register,
    spec,
)
from grpo_core.rewards.code import (
    extract_program,
    isolation_label,
    run_many,
    sandbox_params,
    sandboxed,
)
from grpo_core.rewards.length import cosine_scaled, repetition_penalty, soft_overlong_penalty
from grpo_core.rewards.scoring import ScoreResult, score_completions
from grpo_core.sandbox import (
    Limits,
    RunResult,
    SandboxUnavailable,
    detect_isolation,
    run_program,
)

__all__ = [
    "REWARDS",
    "RewardFn",
    "RewardSpec",
    "RewardUnavailable",
    "SandboxUnavailable",
    "ScoreResult",
    "Scores",
    "Limits",
    "RunResult",
    "completion_text",
    "cosine_scaled",
    "detect_isolation",
    "executing",
    "extract_program",
    "isolation_label",
    "repetition_penalty",
    "run_many",
    "run_program",
    "sandbox_params",
    "sandboxed",
    "soft_overlong_penalty",
    "get",
    "load_user_function",
    "names",
    "register",
    "score_completions",
    "spec",
]

"""This process's state: the one object a config sets (``STATE``), a leaf every module of
``cluster`` may read without importing the code that sets it. ``cluster/process.py: set_up``
writes it (through ``storage.configure``, ``runtime.configure`` and
:func:`load_policies_with`); a Ray trainer rank and the local engine process, handed the
run's model options, call :func:`load_policies_with` alone. What each field holds:
cluster/process.py's docstring."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cluster.config import ClusterConfig
from grpo_core.config.model import ModelConfig


@dataclass
class ProcessState:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    executor: Any = None  # cluster/executor.py: Local or OnRay (a leaf: not imported here)
    store: Any = None  # cluster/storage.py: RunStore, or None
    store_env: str | None = None
    model: ModelConfig = field(default_factory=ModelConfig)
    trained_policy: Callable[[str], Any] | None = None


STATE = ProcessState()


def load_policies_with(
    model: ModelConfig, trained_policy: Callable[[str], Any] | None = None
) -> None:
    """How this process loads policies from now on: the run context's ``model`` section, or
    the one a trainer rank is handed (cluster/trainer_group.py runs ranks in other
    processes). Models already in memory that were loaded otherwise are not reused.
    ``trained_policy(policy_id)``: the model in memory holding those weights, or None
    (``tasks/policies/memo.py: holding``; kept when not given)."""
    STATE.model = model
    if trained_policy is not None:
        STATE.trained_policy = trained_policy

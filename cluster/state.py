"""This process's state: the one object a config sets (``STATE``), a leaf every module of
``cluster`` may read without importing the code that sets it. ``cluster/process.py: set_up``
writes it (through ``storage.configure``, ``runtime.configure`` and
:func:`load_policies_with`); a Ray trainer rank and the local engine process, handed the
run's model options, call :func:`load_policies_with` alone. What each field holds:
cluster/process.py's docstring."""

from __future__ import annotations

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


STATE = ProcessState()


def load_policies_with(model: ModelConfig) -> None:
    """How this process loads policies from now on: the run context's ``model`` section, or
    the one a trainer rank is handed (cluster/trainer_group.py runs ranks in other
    processes). Models already in memory that were loaded otherwise are not reused
    (tasks/policies/trainer.py)."""
    STATE.model = model

"""This process's setup for a config, and the long-lived things it holds: the one place of
process-wide state that a config sets.

``RunContext.open`` (flows/run_context.py) is the only caller of :func:`set_up`, once per
config, at every entry point (``grpo run``, the stage commands and flows, the deployments,
the data-parallel update's ranks, the benchmarks). What it holds:

- ``cluster``: where rollouts, scoring and updates run (the ``cluster:`` section);
  ``executor`` is built from it on first use (cluster/executor.py; it keeps the process's
  rollout engines);
- ``store`` / ``store_env``: the run folder's shared store (cluster/storage.py), or None, and
  the ``GRPO_STORAGE`` value it was last read from (a parent process passes its store to
  the processes it starts through that variable);
- ``model``: how policies are loaded (``model.dtype``, ``lora``, ...: tasks/policies/trainer.py
  loads with it, and the stage cache keys name what of it changes results).

What else a process keeps are caches and records of what it has open, each beside the code
that uses it and emptied by it: the policies in memory (the executor's, cluster/policies.py:
the learner the stages train and what was loaded read-only), the Ray rollout
replicas and trainer group (cluster/rollout_workers.py, cluster/trainer_group.py), the MLflow
runs it has open (tasks/tracking/run_states.py, for the signal handlers) and the workspace locks it
holds (flows/lock.py).
"""

from __future__ import annotations

from typing import Any

from cluster.config import ClusterConfig
from cluster.state import STATE, ProcessState, load_policies_with
from grpo_core.config.model import ModelConfig

__all__ = ["STATE", "ProcessState", "load_policies_with", "set_up"]


def set_up(
    *,
    cluster: ClusterConfig,
    model: ModelConfig,
    store_url: str | None,
    local: Any,
    store_options: dict | None = None,
) -> ProcessState:
    """Set this process up for one config: its cluster setting, its shared store (None: no
    ``storage.url``) and how it loads policies."""
    from cluster import runtime, storage

    storage.configure(store_url, local, store_options)
    runtime.configure(cluster)
    load_policies_with(model)
    return STATE

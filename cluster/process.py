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
- ``model``: how policies are loaded (``model.dtype``, ``lora``, ...: tasks/policies/memo.py loads
  with it, and the stage cache keys name what of it changes results);
- ``trained_policy``: where this process's policies in memory are found by ``policy_id``
  (the run context and the trainer ranks pass ``tasks/policies/memo.py: holding``), for a trainer rank sending its weights to the
  rollout replicas (cluster/weight_bus.py).

What else a process keeps are caches and records of what it has open, each beside the code
that uses it and emptied by it: the policies in memory (tasks/policies/memo.py), the Ray rollout
replicas and trainer group (cluster/rollout_workers.py, cluster/trainer_group.py), the MLflow
runs it has open (tasks/tracking/run_states.py, for the signal handlers) and the workspace locks it
holds (flows/lock.py).
"""

from __future__ import annotations

from collections.abc import Callable
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
    trained_policy: Callable[[str], Any] | None = None,
) -> ProcessState:
    """Set this process up for one config: its cluster setting, its shared store (None: no
    ``storage.url``), how it loads policies and where its trained policies are found."""
    from cluster import runtime, storage

    storage.configure(store_url, local, store_options)
    runtime.configure(cluster)
    load_policies_with(model, trained_policy)
    return STATE

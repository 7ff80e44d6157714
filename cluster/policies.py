"""What a process holds of the policies its stages train and sample, kept by its executor
(cluster/executor.py: ``Local.policies``; a trainer rank's process has its own).

- ``learner``: the policy the stages train (grpo_core/algorithm/learner.py), with its train
  state and checkpoint writer; between the tasks of a stage (rollout, score, update, eval)
  its weights stay in memory, and rollouts and evals of those weights sample it;
- ``loaded``: models loaded read-only by slot (``"policy"``: a checkpoint sampled that the
  learner does not hold; ``"reference"``: the reference model of an update with beta > 0);
- ``stats``: loads from disk, hits, replays (the tests and benchmarks read them).

This module only holds them. Which one a task gets, and how an iteration's policy whose
weights are neither here nor on disk is made again, is tasks/policies/trainer.py's.
"""

from __future__ import annotations

import threading
from typing import Any


class Policies:
    def __init__(self) -> None:
        self.learner: Any = None  # grpo_core.algorithm.learner.Learner
        self.loaded: dict[str, Any] = {}  # slot -> a read-only Learner (never trained)
        self.stats = {"loads": 0, "hits": 0, "replays": 0}
        self.lock = threading.RLock()

    def holding(self, policy_id: str):
        """The learner's model when its weights are ``policy_id``, else None (a trainer rank
        sends it to the rollout replicas: cluster/weight_bus.py)."""
        learner = self.learner
        return learner.model if learner is not None and learner.policy_id == policy_id else None

    def optimizer_to_cpu(self) -> None:
        """The learner's optimizer state to CPU memory, before an engine in this process
        wakes (``offload_optimizer``); its next update brings it back."""
        if self.learner is not None:
            self.learner.offload_optimizer()

    def drain(self) -> None:
        """The learner's queued checkpoint writes, finished."""
        if self.learner is not None:
            self.learner.drain()

    def drop_unless(self, loaded_with: dict) -> None:
        """Forget what was loaded with other options than ``loaded_with`` (a new setup
        loads anew); the learner's pending writes finish first."""
        with self.lock:
            if self.learner is not None and self.learner.loaded_with != loaded_with:
                self.learner.drain()
                self.learner = None
            for slot, held in list(self.loaded.items()):
                if held.loaded_with != loaded_with:
                    del self.loaded[slot]

    def clear(self) -> None:
        """Hold nothing (as a new process would); queued writes finish first."""
        with self.lock:
            self.drain()
            self.learner = None
            self.loaded.clear()

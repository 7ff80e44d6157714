"""A policy as a value: which weights, made how, kept where.

A stage holds the policy it trains as a :class:`PolicyVersion` (flows/rl.py), not as a path
it looks up again: the cold start's checkpoint folder, then each iteration's record
(tasks/policies/ref.py) as the update makes it. The ``policy_id`` (the weights' content
hash) stays the id, and ``path`` is what a task hashes for its cache key, so a stage's keys
are the same whether it is handed the version or its path. Where a task takes a path, it
takes a version (``os.fspath``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tasks.policies import ref as policy_ref


@dataclass(frozen=True)
class PolicyVersion:
    policy_id: str  # the weights' content hash (grpo_core/training/weights_id.py)
    path: str  # the checkpoint folder, or the iteration record, that names these weights
    step: int = 0  # the stage's optimizer steps when they were made (0: a checkpoint folder)
    kept: str | None = None  # the folder they are written to (the folder itself; a save point)
    parent: str | None = None  # the path of the version they were updated from

    @classmethod
    def at(cls, path: str | os.PathLike) -> PolicyVersion:
        """The version ``path`` names: a checkpoint folder (its weights hashed and verified)
        or an iteration's record (what it recorded)."""
        if isinstance(path, PolicyVersion):
            return path
        at = policy_ref.locate(path)
        if at.record is None:
            return cls(at.policy_id, str(at.path), kept=str(at.path))
        r = at.record
        return cls(r.policy_id, str(at.path), r.global_step, r.checkpoint, str(r.parent))

    def __fspath__(self) -> str:
        return self.path

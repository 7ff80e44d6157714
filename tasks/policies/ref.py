"""An RL iteration's policy without its weights on disk: ``iter_NNNN/policy.json``.

An RL update keeps its new weights in memory (the learner: tasks/policies/trainer.py) and
writes them only at
the stage's save points (``rl.save_steps``; grpo_core/training/checkpoint_writer.py). What it always
writes is this small record: the new weights' ``policy_id`` (their content hash, computed in
memory), the optimizer step reached, the kept checkpoint folder when there is one, and how
to make the weights again: the policy the update started from (another record, or a
checkpoint folder) and the update's own arguments, whose scored file is in the run folder.
A task handed a record whose weights are neither in memory nor kept replays the updates from
the nearest kept state (:meth:`tasks.policies.trainer.Trainer.learner_at`); on CPU, where the update is
deterministic, that gives the same weights bit for bit, and the record's ``policy_id`` is
checked. Paths are stored relative to the run folder (tasks/cache.py: ``portable``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from grpo_core.contracts.io import write_json
from grpo_core.contracts.run_folder import localised, portable, run_root

REF_NAME = "policy.json"
KIND = "grpo-policy-ref"


@dataclass(frozen=True)
class PolicyRef:
    policy_id: str
    global_step: int  # the stage's optimizer steps after the update
    checkpoint: str | None  # the kept checkpoint folder with these weights, if any
    update: dict  # tasks.update.update's arguments: replaying them gives these weights

    @property
    def parent(self) -> str:
        return self.update["policy_path"]

    def kept(self) -> Path | None:
        """The kept checkpoint folder when it exists (it may have been pruned)."""
        if self.checkpoint and (Path(self.checkpoint) / "config.json").exists():
            return Path(self.checkpoint)
        return None


@dataclass(frozen=True)
class Located:
    """A policy path, read once: a checkpoint folder (``record`` None) or an iteration's
    record, and the ``policy_id`` of the weights it names."""

    path: Path
    policy_id: str
    record: PolicyRef | None = None

    def saved(self) -> Path | None:
        """:func:`saved_at` ``path``: the folder itself, or the record's kept checkpoint."""
        return self.record.kept() if self.record is not None else self.path


def locate(path: str | Path) -> Located:
    """``path``'s policy: a checkpoint folder's weights hashed (verified), or a record read
    (the hash it recorded)."""
    from grpo_core.training.checkpoint import policy_id as checkpoint_policy_id

    path = Path(path)
    if is_ref(path):
        ref = read_ref(path)
        return Located(path, ref.policy_id, ref)
    return Located(path, checkpoint_policy_id(path))


def is_ref(path: str | Path) -> bool:
    return Path(path).name == REF_NAME and Path(path).is_file()


def policy_id(path: str | Path) -> str:
    """The ``policy_id`` of a checkpoint folder (its weights' hash, verified) or of a record
    (the hash it recorded)."""
    return locate(path).policy_id


def saved_at(path: str | Path) -> Path | None:
    """Where the weights ``path`` names are on disk: a checkpoint folder itself, a record's
    kept checkpoint, or None when that was not kept (or is gone)."""
    return read_ref(path).kept() if is_ref(path) else Path(path)


def write_ref(path: str | Path, ref: PolicyRef) -> Path:
    body = portable({"kind": KIND, **asdict(ref)}, run_root(path))
    return write_json(body, path)


def read_ref(path: str | Path) -> PolicyRef:
    body = localised(json.loads(Path(path).read_text()), run_root(path))
    if not isinstance(body, dict) or body.get("kind") != KIND:
        raise ValueError(f"{path}: not a policy record (expected kind {KIND!r})")
    body.pop("kind")
    return PolicyRef(**body)

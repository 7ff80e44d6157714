"""A policy that this process does not load: for work done elsewhere.

With ``cluster.backend: ray`` the rollout replicas sample, the trainer group trains, and the
driver (on a head that may have no GPU and little memory) needs of a policy only its id, its
tokenizer and its config: the replicas load the weights from the checkpoint the trainer
group wrote (``cluster/rollout_workers.py``), so the driver never holds the model nor ships
a second copy of it through Ray's object store. :func:`files` hands out that light handle;
where the weights exist only in memory (this process's learner holds them, or the stage
replayed them there: tasks/policies/trainer.py), it returns a handle with the ``model``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.policies import ref as policy_ref
from tasks.policies.trainer import open_trainer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass
class PolicyFiles:
    """A policy's weights on disk (``checkpoint``: a save_pretrained folder), its id, and
    what of it the driver reads: tokenizer and config. ``model`` is None: nothing loaded."""

    checkpoint: Path
    policy_id: str
    tokenizer: Any
    config: Any
    model: None = None


def files(checkpoint: str | Path):
    """``checkpoint``'s :class:`PolicyFiles`, or a handle on the weights in memory
    (``Trainer.handle``) when this process's learner holds them or they are on no disk."""
    at = policy_ref.locate(checkpoint)
    pid = at.policy_id
    weights = at.saved()  # the folder itself, or a record's kept one
    on_disk = weights is not None and (Path(weights) / "config.json").exists()
    trainer = open_trainer()
    if trainer.holding(pid) is not None or not on_disk:
        return trainer.handle(checkpoint)
    from transformers import AutoConfig

    weights = Path(weights)
    return PolicyFiles(weights, pid, _tokenizer(weights), AutoConfig.from_pretrained(weights))


_TOKENIZERS: dict[str, Any] = {}  # tokenizer files' hash -> tokenizer (one per run, mostly)


def _tokenizer(folder: Path):
    """``folder``'s tokenizer, loaded once per distinct tokenizer files (every checkpoint of
    a run has the same)."""
    from grpo_core.training.checkpoint import load_tokenizer

    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = folder / name
        if path.exists():
            h.update(name.encode() + path.read_bytes())
    key = h.hexdigest()
    if key not in _TOKENIZERS:
        _TOKENIZERS.clear()
        _TOKENIZERS[key] = load_tokenizer(folder)
    return _TOKENIZERS[key]

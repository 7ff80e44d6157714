"""Checkpoints: Hugging Face ``save_pretrained`` directories plus trainer state for resume.

A checkpoint is written to a temporary directory and renamed into place. Its ``policy_id``
is a content hash of the weights, stamped on every rollout the policy samples.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

from grpo_core.io import atomic_path, write_json

if TYPE_CHECKING:  # torch/transformers load on first use: hashing a checkpoint needs neither
    import torch
    from transformers import PreTrainedModel

WEIGHTS = "model.safetensors"
TRAINER_STATE = "trainer_state.pt"
POLICY_ID = "policy_id.txt"


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def save_checkpoint(
    model: PreTrainedModel,
    tokenizer,
    out_dir: str | Path,
    *,
    trainer_state: dict | None = None,
    info: dict | None = None,
) -> Path:
    """``save_pretrained`` model and tokenizer (safetensors) into ``out_dir`` atomically."""
    import torch

    out_dir = Path(out_dir)
    with atomic_path(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if trainer_state is not None:
            torch.save(trainer_state, tmp / TRAINER_STATE)
        (tmp / POLICY_ID).write_text(_weights_hash(tmp))
        if info:
            write_json(info, tmp / "checkpoint_info.json")
    return out_dir


def _weights_hash(ckpt_dir: Path) -> str:
    files = sorted(ckpt_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{ckpt_dir}: no *.safetensors weights found")
    h = hashlib.sha256()
    for f in files:
        h.update(file_sha256(f).encode())
    return h.hexdigest()[:16]


def policy_id(ckpt_dir: str | Path) -> str:
    """Content hash of a checkpoint's weights (cached in ``policy_id.txt``)."""
    ckpt_dir = Path(ckpt_dir)
    stamp = ckpt_dir / POLICY_ID
    return stamp.read_text().strip() if stamp.exists() else _weights_hash(ckpt_dir)


def load_checkpoint(ckpt_dir: str | Path, *, dtype: torch.dtype | None = None):
    """Load ``(model, tokenizer)`` through the Auto classes, as for any hub model
    (``dtype`` default: float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / "config.json").exists():
        raise FileNotFoundError(f"{ckpt_dir} is not a checkpoint: config.json missing")
    tokenizer = AutoTokenizer.from_pretrained(ckpt_dir)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(ckpt_dir, dtype=dtype or torch.float32)
    return model, tokenizer


def load_trainer_state(ckpt_dir: str | Path) -> dict | None:
    import torch

    p = Path(ckpt_dir) / TRAINER_STATE
    return torch.load(p, weights_only=False) if p.exists() else None

"""Checkpoints: Hugging Face ``save_pretrained`` directories plus trainer state for resume.

A checkpoint is written to a temporary directory and renamed into place. Its ``policy_id``
is a content hash of the weights, stamped on every rollout the policy samples. It is never
taken on trust from a file: ``policy_id.txt`` is only a memo of the hash together with the
size and modification time of each weight file it was computed from, and the weights are
hashed again whenever one of those differs.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import logging
import os
import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from grpo_core.io import atomic_path, write_json

if TYPE_CHECKING:  # torch/transformers load on first use: hashing a checkpoint needs neither
    import torch
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
TRAINER_STATE = "trainer_state.pt"
POLICY_ID = "policy_id.txt"
INFO = "checkpoint_info.json"

# The files of a checkpoint that make the model: what ``from_pretrained`` reads (model,
# tokenizer, generation config). A checkpoint's content hash covers these and nothing else:
# the trainer state (pruned from older RL iterations), the policy_id memo and the info file
# may come and go without the model changing.
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
MODEL_DIRS = ("additional_chat_templates",)  # extra named chat templates (*.jinja)

STATS = {"files_hashed": 0}  # files read in full by file_sha256 (tests count them)
_MEMO: dict[tuple[int, int, int, int], str] = {}  # (dev, inode, size, mtime_ns) -> sha256
_MEMO_LOCK = threading.Lock()


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    """sha256 of the file's bytes (always reads the file)."""
    STATS["files_hashed"] += 1
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def stamp(path: str | Path) -> tuple[int, int]:
    """``(size, mtime_ns)`` of a file: the cheap check that it is still as it was."""
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def memo_sha256(path: str | Path) -> str:
    """:func:`file_sha256`, memoised in this process on the file's identity, size and
    modification time (a rename, e.g. a checkpoint moved into place, keeps the memo)."""
    st = os.stat(path)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    digest = _MEMO.get(key)
    if digest is None:
        digest = file_sha256(path)
        with _MEMO_LOCK:
            if len(_MEMO) >= 4096:
                _MEMO.clear()
            _MEMO[key] = digest
    return digest


def weight_files(ckpt_dir: str | Path) -> list[Path]:
    """The ``*.safetensors`` files of a checkpoint (sorted); raises when there are none."""
    with os.scandir(ckpt_dir) as entries:
        files = sorted(
            Path(e.path)
            for e in entries
            if e.name.endswith(".safetensors") and not e.name.startswith(".") and e.is_file()
        )
    if not files:
        raise FileNotFoundError(f"{ckpt_dir}: no *.safetensors weights found")
    return files


_MODEL_FILE = re.compile("|".join(fnmatch.translate(pattern) for pattern in MODEL_FILES))


def _model_entries(ckpt_dir: str | Path) -> list[tuple[str, str]]:
    """``(relative path, path)`` of each model file, sorted; one ``scandir`` (plus the
    files of :data:`MODEL_DIRS` when there are any), so the cheap check stays cheap."""
    out = []
    with os.scandir(ckpt_dir) as entries:
        for e in entries:
            if e.name.startswith("."):  # temporaries of atomic writes
                continue
            if e.is_dir():
                if e.name in MODEL_DIRS:
                    out += [
                        (f.relative_to(ckpt_dir).as_posix(), str(f))
                        for f in Path(e.path).rglob("*")
                        if f.is_file()
                    ]
            elif _MODEL_FILE.match(e.name):
                out.append((e.name, e.path))
    return sorted(out)


def model_files(ckpt_dir: str | Path) -> list[Path]:
    """The files of ``ckpt_dir`` that make the model (:data:`MODEL_FILES`, and the files
    of :data:`MODEL_DIRS`), sorted."""
    return [Path(path) for _, path in _model_entries(ckpt_dir)]


def checkpoint_stamp(ckpt_dir: str | Path) -> dict[str, list[int]]:
    """``{relative path: [size, mtime_ns]}`` of the model files (no file is read)."""
    return {rel: list(stamp(path)) for rel, path in _model_entries(ckpt_dir)}


def checkpoint_sha256(ckpt_dir: str | Path) -> str:
    """Content hash of a checkpoint directory: sha256 over the name and sha256 of each of
    its model files (weights, config, generation config, tokenizer, chat template)."""
    h = hashlib.sha256()
    for rel, path in _model_entries(ckpt_dir):
        h.update(f"{rel}\0{memo_sha256(path)}\n".encode())
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
        files = weight_files(tmp)
        _write_memo(tmp / POLICY_ID, _weights_hash(files), {f.name: stamp(f) for f in files})
        if info:
            write_json(info, tmp / "checkpoint_info.json")
    return out_dir


def _weights_hash(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(memo_sha256(f).encode())
    return h.hexdigest()[:16]


def _read_memo(path: Path) -> tuple[str, dict[str, tuple[int, int]]] | None:
    """``(policy_id, {weight file: (size, mtime_ns)})`` from ``policy_id.txt``, or None.

    Format: the policy id on the first line, then ``<size> <mtime_ns> <file name>`` for
    each weight file it was computed from. A memo without stamps (older checkpoints) has
    no stamps to match, so the weights are hashed again."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    if not lines or not lines[0].strip():
        return None
    stamps = {}
    for line in lines[1:]:
        parts = line.split(" ", 2)
        if len(parts) != 3 or not (parts[0].isdigit() and parts[1].isdigit()):
            return None
        stamps[parts[2]] = (int(parts[0]), int(parts[1]))
    return lines[0].strip(), stamps


def _write_memo(path: Path, pid: str, stamps: dict[str, tuple[int, int]]) -> None:
    lines = [pid, *(f"{size} {mtime} {name}" for name, (size, mtime) in sorted(stamps.items()))]
    with atomic_path(path) as tmp:
        tmp.write_text("\n".join(lines) + "\n")


def policy_id(ckpt_dir: str | Path) -> str:
    """Content hash of a checkpoint's weights: the first 16 hex digits of a sha256 over the
    sha256 of every ``*.safetensors`` file.

    ``policy_id.txt`` is a memo, trusted only while every weight file has the size and
    modification time it records; otherwise the weights are hashed again and an existing
    memo is rewritten (a directory without one, e.g. a model from the hub, gets none)."""
    ckpt_dir = Path(ckpt_dir)
    files = weight_files(ckpt_dir)
    stamps = {f.name: stamp(f) for f in files}
    memo_path = ckpt_dir / POLICY_ID
    memo = _read_memo(memo_path)
    if memo is not None and memo[1] == stamps:
        return memo[0]
    pid = _weights_hash(files)
    if memo_path.exists():
        if memo is not None and memo[0] != pid:
            log.warning(
                "%s: weights changed since %s was written (policy %s, now %s)",
                ckpt_dir,
                POLICY_ID,
                memo[0],
                pid,
            )
        with contextlib.suppress(OSError):  # read-only: the hash stays memoised in-process
            _write_memo(memo_path, pid, stamps)
    return pid


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

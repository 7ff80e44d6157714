"""Checkpoints: Hugging Face ``save_pretrained`` directories plus trainer state for resume.

A checkpoint is written to a temporary directory and renamed into place. Its ``policy_id``
is a content hash of the weights (grpo_core/training/weights_id.py: the same for the weights in
memory and in files), stamped on every rollout the policy samples. It is never taken on
trust from a file: ``policy_id.txt`` is only a memo of the hash together with the size and
modification time of each weight file it was computed from, and the weights are hashed
again whenever one of those differs.
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

from grpo_core.contracts.io import atomic_path, write_json
from grpo_core.contracts.run_folder import info_paths_relative
from grpo_core.training.weights_id import files_id, savable_state_dict

if TYPE_CHECKING:  # torch/transformers load on first use: hashing a checkpoint needs neither
    import torch
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
TRAINER_STATE = "trainer_state.pt"
POLICY_ID = "policy_id.txt"
_MEMO_KIND = "# tensor-sha256"  # the memo's second line: how its id was computed
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
# extra named chat templates (*.jinja); a LoRA checkpoint's adapter (grpo_core/training/lora.py)
MODEL_DIRS = ("additional_chat_templates", "adapter")

STATS = {"files_hashed": 0}  # files read in full by file_sha256 or policy_id (tests count them)
_MEMO: dict[tuple, str] = {}  # (dev, inode, size, mtime_ns, ctime_ns) -> sha256
_MEMO_LOCK = threading.Lock()


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    """sha256 of the file's bytes (always reads the file)."""
    STATS["files_hashed"] += 1
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def stamp(path: str | Path) -> tuple[int, int, int]:
    """``(size, mtime_ns, ctime_ns)`` of a file: the cheap check that it is still as it was
    (the inode change time catches an edit whose mtime was restored with ``touch -r``)."""
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns


def memo_sha256(path: str | Path) -> str:
    """:func:`file_sha256`, memoised in this process on the file's identity, size and
    modification time (a rename, e.g. a checkpoint moved into place, keeps the memo)."""
    st = os.stat(path)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
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
    """``{relative path: [size, mtime_ns, ctime_ns]}`` of the model files (no file is read)."""
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
    state_dict: dict | None = None,
    expected_id: str | None = None,
) -> Path:
    """``save_pretrained`` model and tokenizer (safetensors) into ``out_dir`` atomically.

    A ``peft`` model is saved as its merged weights plus its adapter in ``adapter/``
    (grpo_core/training/lora.py). ``state_dict``: the weights to write instead of the model's own (a
    sharded model's gathered weights, grpo_core/training/fsdp.py; a CPU copy written in the
    background, grpo_core/training/checkpoint_writer.py). ``expected_id``: the ``policy_id`` those
    weights had in memory; written files that hash otherwise raise, and nothing is moved
    into place."""
    out_dir = Path(out_dir)
    try:
        return _save_checkpoint(model, tokenizer, out_dir, trainer_state, info, state_dict,
                                expected_id)  # fmt: skip
    except Exception as exc:  # safetensors and torch.save say "disk full" in their own types
        if (full := _disk_full(exc, out_dir)) is None:
            raise
        raise full from exc


def _disk_full(exc: BaseException, out_dir: Path) -> OSError | None:
    """``exc`` as the ``OSError(ENOSPC)`` naming ``out_dir`` when it says the disk is full
    (safetensors and ``torch.save`` report it in their own exception types), else None."""
    import errno

    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return None  # already says so, with its file
    text = str(exc)
    if "No space left on device" in text or "os error 28" in text:
        return OSError(errno.ENOSPC, "No space left on device (the checkpoint is not kept)",
                       str(out_dir))  # fmt: skip
    return None


def _save_checkpoint(model, tokenizer, out_dir: Path, trainer_state, info, state_dict,
                     expected_id) -> Path:  # fmt: skip
    import torch

    from grpo_core.training import lora

    with atomic_path(out_dir) as tmp:
        weights = savable_state_dict(model) if state_dict is None else state_dict
        if lora.is_peft(model):
            lora.save_merged(model, tmp, state=weights)
            lora.save_adapter(model, tmp / lora.ADAPTER_DIR)
        else:  # a copy of the dict: save_pretrained pops from it
            model.save_pretrained(tmp, state_dict=dict(weights), safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if trainer_state is not None:
            torch.save(trainer_state, tmp / TRAINER_STATE)
        files = weight_files(tmp)
        pid = files_id(files)
        if expected_id is not None and pid != expected_id:
            raise RuntimeError(
                f"{out_dir}: the written weights hash to policy {pid}, the weights in memory "
                f"to {expected_id}; the checkpoint is not kept"
            )
        _write_memo(tmp / POLICY_ID, pid, {f.name: stamp(f) for f in files})
        if info:
            write_json(info_paths_relative(info, Path(out_dir)), tmp / "checkpoint_info.json")
    return out_dir


def _read_memo(path: Path) -> tuple[str, dict[str, tuple[int, int]]] | None:
    """``(policy_id, {weight file: (size, mtime_ns, ctime_ns)})`` from ``policy_id.txt``, or
    None.

    Format: the policy id on the first line, how it was computed on the second
    (:data:`_MEMO_KIND`), then ``<size> <mtime_ns> <ctime_ns> <file name>`` for each weight
    file it was computed from. A memo without them (older checkpoints, whose ids were
    computed another way) is not trusted, so the weights are hashed again."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    if len(lines) < 2 or not lines[0].strip() or lines[1] != _MEMO_KIND:
        return None  # empty, or an id computed another way (older checkpoints)
    stamps = {}
    for line in lines[2:]:
        parts = line.split(" ", 3)
        if len(parts) != 4 or not all(x.isdigit() for x in parts[:3]):
            return None
        stamps[parts[3]] = (int(parts[0]), int(parts[1]), int(parts[2]))
    return lines[0].strip(), stamps


def _write_memo(path: Path, pid: str, stamps: dict[str, tuple[int, int, int]]) -> None:
    lines = [
        pid,
        _MEMO_KIND,
        *(f"{a} {b} {c} {name}" for name, (a, b, c) in sorted(stamps.items())),
    ]
    with atomic_path(path) as tmp:
        tmp.write_text("\n".join(lines) + "\n")


def policy_id(ckpt_dir: str | Path) -> str:
    """Content hash of a checkpoint's weights: the first 16 hex digits of a sha256 over
    every tensor of its ``*.safetensors`` files (grpo_core/training/weights_id.py).

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
    pid = files_id(files)
    STATS["files_hashed"] += len(files)
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


def dtype_name(model) -> str:
    """The dtype of ``model``'s (first) parameters as the rollout files and configs name it:
    ``float32``, ``bfloat16``, ..."""
    return str(next(model.parameters()).dtype).removeprefix("torch.")


COMPUTE_DTYPE_ATTR = "grpo_compute_dtype"  # set by a wrapper that computes in another dtype


def compute_dtype_name(model) -> str:
    """The dtype ``model`` computes in: its parameters', unless a wrapper casts them for the
    forward (FSDP2's ``param_dtype``, ``cluster.trainer.fsdp_param_dtype``, records itself
    under ``COMPUTE_DTYPE_ATTR``): float32 master weights computing in bf16 are not a float32
    trainer, and the ``auto`` old-log-prob and engine-correction rules must see that."""
    return getattr(model, COMPUTE_DTYPE_ATTR, None) or dtype_name(model)


def resolve_model_path(value: str | Path, field: str = "model.path") -> Path:
    """A ``save_pretrained`` directory, or a hub id resolved to its snapshot in the local
    Hugging Face cache (``local_files_only``: nothing is downloaded)."""
    from grpo_core.errors import UserError

    p = Path(value).expanduser()
    if p.is_dir():
        return p.resolve()
    try:
        from huggingface_hub import constants, snapshot_download

        cache = constants.HF_HUB_CACHE
    except ImportError:  # pragma: no cover - a dependency of transformers
        snapshot_download, cache = None, "~/.cache/huggingface/hub"
    if snapshot_download is not None and not p.is_absolute():
        with contextlib.suppress(Exception):  # not cached, or not a valid repo id
            return Path(snapshot_download(str(value), local_files_only=True))
    raise UserError(
        f"{field} {str(value)!r}: no such directory ({p.resolve()}) and no snapshot of a hub "
        f"model of that id in the local Hugging Face cache ({cache}); give a save_pretrained "
        "directory, download the model into the cache first, or import a GGUF file with "
        "`grpo import-gguf`"
    )


def load_tokenizer(ckpt_dir: str | Path):
    """A checkpoint's tokenizer as :func:`load_checkpoint` sets it up (left padding, a pad
    token), without the model."""
    from grpo_core.training.tokenizers import saved_tokenizer

    tokenizer = saved_tokenizer(ckpt_dir)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_checkpoint(
    ckpt_dir: str | Path,
    *,
    dtype: torch.dtype | str | None = None,
    attn_implementation: str | None = None,
    gradient_checkpointing: bool = False,
    load_in_4bit: bool = False,
    device: str | None = "auto",
):
    """Load ``(model, tokenizer)`` through the Auto classes, as for any hub model.

    ``dtype``: a torch dtype, ``"auto"`` (the config's ``dtype``) or a name (default
    float32); ``attn_implementation``: transformers' (``eager``, ``sdpa``,
    ``flash_attention_2``; default its own choice); ``gradient_checkpointing`` turns it on
    with ``use_reentrant=False``; ``load_in_4bit``: NF4 weights through bitsandbytes
    (QLoRA; needs a CUDA GPU); ``device``: where the model goes (:func:`resolve_device`:
    ``auto`` is this process's current CUDA device when there is one, else the CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_core.errors import UserError

    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / "config.json").exists():
        raise FileNotFoundError(f"{ckpt_dir} is not a checkpoint: config.json missing")
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    kwargs: dict = {"dtype": dtype or torch.float32}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if load_in_4bit:
        if not torch.cuda.is_available():
            raise UserError(
                "model.load_in_4bit (QLoRA) needs a CUDA GPU with bitsandbytes; this machine "
                "has none: set model.load_in_4bit=false (LoRA on full-precision weights)"
            )
        from transformers import BitsAndBytesConfig

        compute = kwargs["dtype"] if isinstance(kwargs["dtype"], torch.dtype) else torch.bfloat16
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute,
        )
        kwargs["device_map"] = {"": torch.cuda.current_device()}
    tokenizer = load_tokenizer(ckpt_dir)
    model = AutoModelForCausalLM.from_pretrained(ckpt_dir, **kwargs)
    target = resolve_device(device)
    if not load_in_4bit and target.type != "cpu":  # 4-bit weights are placed by device_map
        model = model.to(target)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, tokenizer


def resolve_device(device: str | None = "auto"):
    """The torch device of ``model.device``: ``auto`` (or None) is the current CUDA device
    when CUDA is available (the one ``torch.cuda.set_device`` or Ray's
    ``CUDA_VISIBLE_DEVICES`` chose for this rank), else the CPU; ``cpu``, ``cuda`` and
    ``cuda:N`` are taken as given, and a CUDA device on a machine without one is refused."""
    import torch

    from grpo_core.errors import UserError

    cuda = torch.cuda.is_available()
    if device in (None, "auto"):
        return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError):
        raise UserError(
            f"model.device: expected auto, cpu, cuda or cuda:N, got {device!r}"
        ) from None
    if target.type == "cuda":
        if not cuda:
            raise UserError(
                f"model.device: {device!r} but this machine has no CUDA device torch can use; "
                "set model.device=auto (or cpu)"
            )
        if target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
    elif target.type != "cpu":
        raise UserError(f"model.device: expected auto, cpu, cuda or cuda:N, got {device!r}")
    return target


def load_trainer_state(ckpt_dir: str | Path) -> dict | None:
    import torch

    p = Path(ckpt_dir) / TRAINER_STATE
    return torch.load(p, weights_only=False) if p.exists() else None

"""A policy's content hash, the same whether its weights are in memory or in safetensors files.

``policy_id`` is the first 16 hex digits of a sha256 over every tensor of the weights, in
name order: its name, safetensors dtype code, shape and raw bytes. It does not depend on how
the tensors are split into files (one ``model.safetensors`` or a sharded index), on the
files' metadata, or on where the tensors live: :func:`state_dict_id` hashes a state dict in
memory (an RL update's new weights, which are then kept in memory and written only at the
stage's save points) and :func:`files_id` the files ``save_pretrained`` wrote from it, and
the two agree (tests/core/test_weights_id.py). The tensors hashed in memory are those a
checkpoint holds: :func:`savable_state_dict` drops the tied copies that ``save_pretrained``
leaves out (the LM head tied to the input embeddings) and merges a LoRA adapter.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # hashing files needs no torch
    import torch

# torch dtype name -> safetensors dtype code (the header's "dtype")
_CODES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
_CHUNK = 1 << 24


def _entry(h, name: str, code: str, shape) -> None:
    h.update(f"{name}\0{code}\0{list(shape)}\n".encode())


def tied_copies(model, state: dict) -> list[tuple[str, str]]:
    """The ``(target, source)`` pairs of the model's ``_tied_weights_keys`` found in
    ``state`` whose target is the same parameter of ``model`` as its source (or, where a name
    is no parameter of it, whose tensor in ``state`` shares its source's storage). ``state``
    may hold copies (a gathered state dict): the model decides."""
    tied = getattr(model, "_tied_weights_keys", None) or {}
    if isinstance(tied, dict):
        pairs = tied.items()
    else:  # older transformers: a list of tied names, their source the input embeddings
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        src = next((k for k, v in state.items() if emb is not None and v is emb.weight), None)
        src = src or next((k for k, v in model.named_parameters() if emb is not None
                           and v is emb.weight), None)  # fmt: skip
        pairs = [(k, src) for k in tied] if src else []
    return [(t, s) for t, s in pairs if t in state and s in state and _tied(model, state, t, s)]


def retie(model, state: dict) -> dict:
    """``state`` (gathered copies) with each tied copy the very tensor of its source, as in
    the model's own state dict: ``save_pretrained`` then writes it once."""
    for target, source in tied_copies(model, state):
        state[target] = state[source]
    return state


def _tied(model, state: dict, target: str, source: str) -> bool:
    try:
        return model.get_parameter(target) is model.get_parameter(source)
    except AttributeError:  # not parameters of this model (e.g. merged LoRA names)
        return state[target].data_ptr() == state[source].data_ptr()


def savable_state_dict(model) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint of ``model`` holds (detached, where they live): the merged
    weights of a LoRA model (grpo_core/training/lora.py), else the state dict without the tied
    copies ``save_pretrained`` leaves out (a key of ``_tied_weights_keys`` that shares its
    storage with its source)."""
    from grpo_core.training import lora

    if lora.is_peft(model):
        state = lora.merged_state_dict(model)
        model = model.get_base_model()
    else:
        state = {k: v.detach() for k, v in model.state_dict().items()}
    for target, _ in tied_copies(model, state):
        del state[target]
    return state


def state_dict_id(state: dict[str, torch.Tensor]) -> str:
    """:data:`policy_id` of weights in memory (any device: each tensor is copied to the CPU
    for hashing when it is not there)."""
    import torch

    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach()
        code = _CODES.get(str(t.dtype).removeprefix("torch."))
        if code is None:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors code")
        _entry(h, name, code, t.shape)
        flat = t.reshape(-1)
        if flat.device.type != "cpu":
            flat = flat.cpu()
        if not flat.is_contiguous():
            flat = flat.contiguous()
        if flat.numel():
            h.update(memoryview(flat.view(torch.uint8).numpy()))
    return h.hexdigest()[:16]


def _header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


def files_id(files: list[Path]) -> str:
    """:data:`policy_id` of weights in safetensors files (one model's files, any split)."""
    entries = []
    for path in files:
        start, header = _header(Path(path))
        entries += [(name, path, start, info) for name, info in header.items()]
    names = [e[0] for e in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"{files[0].parent}: a tensor name occurs in two weight files")
    h = hashlib.sha256()
    handles: dict = {}
    try:
        for name, path, start, info in sorted(entries, key=lambda e: e[0]):
            _entry(h, name, info["dtype"], info["shape"])
            begin, end = info["data_offsets"]
            f = handles.get(path) or handles.setdefault(path, open(path, "rb"))  # noqa: SIM115
            f.seek(start + begin)
            left = end - begin
            while left:
                block = f.read(min(left, _CHUNK))
                if not block:
                    raise ValueError(f"{path}: {name} is cut short (a truncated file)")
                h.update(block)
                left -= len(block)
    finally:
        for f in handles.values():
            f.close()
    return h.hexdigest()[:16]

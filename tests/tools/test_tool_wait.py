"""``rollout.tool_wait_s``: a turn waits at most that long for its slowest tool calls, and the
episodes whose calls are answered go on without the late ones (grpo_core/engines/turns.py).
Null (the default) keeps one barrier per turn.

The model is benchmarks/bench_turn_prefill.py's: a random Qwen2 whose logits are clocked so
that every turn ends with a call; the environments below answer every call."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from benchmarks import bench_turn_prefill as BENCH
from grpo_core.config.stages import RolloutConfig
from grpo_core.engines.environments import Observation, ToolSpec
from grpo_core.engines.generation import SamplingParams
from grpo_core.engines.hf import HFEngine
from grpo_core.engines.turns import run_turns

TURNS, EPISODES = 4, 6
HERE = Path(__file__).resolve()


@pytest.fixture(scope="module")
def clocked():
    return BENCH.clock_model(hidden_size=32, layers=2)


class WaitsForTheOthers:
    """Episode 0's first call waits (up to 60 s) until every other episode has made its
    last call, and answers 11 if they did (under a barrier they cannot), else 00 (the tool
    demo's vocabulary: digits)."""

    def __init__(self, spec):
        self.spec, self.calls, self.lock = spec, {}, threading.Lock()
        self.others_done = threading.Event()

    def start(self, row):
        return _Episode(self, row["i"])

    def called(self, i: int) -> None:
        with self.lock:
            self.calls[i] = self.calls.get(i, 0) + 1
            if all(self.calls.get(j, 0) >= TURNS - 1 for j in range(1, EPISODES)):
                self.others_done.set()


class _Episode:
    def __init__(self, env, i):
        self.env, self.i, self.turn = env, i, 0

    def step(self, text):
        self.turn += 1
        self.env.called(self.i)
        body = "77"
        if self.i == 0 and self.turn == 1:
            body = "11" if self.env.others_done.wait(60) else "00"  # the others went on, or not
        return Observation(f"<tool_response>{body}</tool_response>")


def _run(model, tok, env: str, wait_s, rows=None):
    spec = ToolSpec(tools=(f"{HERE}:{env}",), max_turns=TURNS, max_tool_output_tokens=16,
                    tool_workers=EPISODES, tool_wait_s=wait_s)  # fmt: skip
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=BENCH.TURN * TURNS + 40, seed=5)
    return run_turns(HFEngine(model, tok), BENCH.prompts(tok, EPISODES), params, desc="t",
                     progress=False, tools=spec, rows=rows)  # fmt: skip


def test_answered_episodes_go_on_while_a_late_call_runs(clocked):
    model, tok = clocked
    rows = [{"i": i} for i in range(EPISODES)]
    out = _run(model, tok, "WaitsForTheOthers", 0.05, rows)
    late = out[0]
    assert late.turns[1]["role"] == "tool" and "11" in late.turns[1]["text"]
    # the late episode still gets every turn, from its own exact ids
    for sample in out:
        assert [t["role"] for t in sample.turns] == ["assistant", "tool"] * (TURNS - 1) + [
            "assistant"
        ]
        assert sample.finish_reason == "stop"
        model_tokens = sum(sample.loss_mask)
        assert model_tokens == sum(
            t["end"] - t["start"] for t in sample.turns if t["role"] == "assistant"
        )


def test_with_every_call_on_time_the_samples_are_the_barriers(clocked):
    """Calls answered within ``tool_wait_s``: the same rounds, so the same samples, bit
    for bit, as with the barrier."""
    model, tok = clocked
    barrier = _run(model, tok, "AlwaysCall", None)
    waiting = _run(model, tok, "AlwaysCall", 30.0)
    assert [s.completion_ids for s in waiting] == [s.completion_ids for s in barrier]
    assert [s.logprobs for s in waiting] == [s.logprobs for s in barrier]
    assert [[(t["role"], t["start"], t["end"]) for t in s.turns] for s in waiting] == [
        [(t["role"], t["start"], t["end"]) for t in s.turns] for s in barrier
    ]


class AlwaysCall(BENCH.AlwaysCall):
    pass


def test_the_knob_reaches_the_spec_and_the_key_only_when_set():
    assert RolloutConfig(tools=["python"]).tool_spec().tool_wait_s is None
    assert "wait_s" not in RolloutConfig(tools=["python"]).tool_spec().as_dict()
    spec = RolloutConfig(tools=["python"], tool_wait_s=0.2).tool_spec()
    assert spec.tool_wait_s == 0.2 and spec.as_dict()["wait_s"] == 0.2
    with pytest.raises(ValueError, match="tool_wait_s"):
        RolloutConfig(tools=["python"], tool_wait_s=-1)


class OneSlowCall:
    """Episode 1's first call takes 0.3 s; every other call answers at once."""

    def __init__(self, spec):
        self.spec = spec

    def start(self, row):
        return _SlowOnce(row["i"])


class _SlowOnce:
    def __init__(self, i):
        self.i, self.turn = i, 0

    def step(self, text):
        import time

        self.turn += 1
        if self.i == 1 and self.turn == 1:
            time.sleep(0.3)
        return Observation("<tool_response>77</tool_response>")


def test_the_barriers_wait_is_recorded_on_the_call_it_waited_for(clocked):
    """``stalled``: the seconds the loop stood still for a call. Under the barrier the wait
    for the slow call is recorded on its turn, and the rollout's ``tools/stall_s`` sums it;
    the instant calls' turns record next to nothing."""
    from tasks.rollout import tool_metrics

    model, tok = clocked
    rows = [{"i": i} for i in range(EPISODES)]
    samples = _run(model, tok, "OneSlowCall", None, rows)
    slow = [t for t in samples[1].turns if t["role"] == "tool"][0]
    assert slow["stalled"] >= 0.25
    others = [t["stalled"] for s in samples for t in s.turns if t is not slow]
    assert sum(others) < 0.25
    got = tool_metrics(samples, 2.0)
    assert got["tools/stall_s"] == pytest.approx(slow["stalled"] + sum(others))
    assert got["tools/stall_share"] == pytest.approx(got["tools/stall_s"] / 2.0)

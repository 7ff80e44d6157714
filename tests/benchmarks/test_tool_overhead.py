"""benchmarks/bench_tool_overhead.py's zero-cost replay: the recording wrapper keeps the real
tool's answers exactly (an output the vocabulary cannot spell included), and the replay gives
the episodes the same ids for every tool turn without running a call."""

from __future__ import annotations

import dataclasses

import benchmarks.bench_tool_overhead as bench
from grpo_core.engines.generation import SamplingParams
from tests.tools.test_turn_loop import PROMPTS, SPEC, ScriptedEngine

SCRIPT = [
    ["<think><tool_call>357*46</tool_call>", "<think><tool_call>12*</tool_call>"],
    ["</think><answer>16422</answer><|eos|>", "</think><answer>36</answer><|eos|>"],
]  # the second call fails: its error's letters are not in the demo's vocabulary


def test_the_replay_answers_as_the_real_tool_did_without_running_it():
    rows = [{"prompt_index": i} for i in range(len(PROMPTS))]
    params = SamplingParams(n=1, max_new_tokens=64, seed=0)
    bench.REAL["spec"], _ = SPEC, bench.ANSWERS.clear()
    recorded = dataclasses.replace(SPEC, tools=(bench.RECORD,))
    real, _ = bench.rollout(ScriptedEngine(SCRIPT), PROMPTS, rows, recorded, params)
    replayed = dataclasses.replace(SPEC, tools=(bench.REPLAY,))
    again, _ = bench.rollout(ScriptedEngine(SCRIPT), PROMPTS, rows, replayed, params)
    for r, a in zip(real, again, strict=True):
        tool_r = [t for t in r.turns if t["role"] == "tool"]
        tool_a = [t for t in a.turns if t["role"] == "tool"]
        assert len(tool_r) == 1
        assert r.completion_ids == a.completion_ids and r.loss_mask == a.loss_mask
        assert [t["seconds"] for t in tool_a] == [t["seconds"] for t in tool_r]
    assert "16422" in real[0].turns[1]["text"] and real[0].turns[1]["error"] is None
    assert "SyntaxError" in real[1].turns[1]["error"]
    assert [len(v) for v in bench.ANSWERS.values()] == [1, 1]

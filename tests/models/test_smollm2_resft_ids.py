"""The SmolLM2 tool preset's re-SFT trains the layout RL sampled: SmolLM2's real tokenizer
with the preset's tools template (configs/templates/smollm2-tools.jinja), a calculator call
answered through the template, then rejection sampling's row read back as SFT data. The ids
re-SFT trains are the episode's, id for id, and the decoded text (the old way) is not them:
its role markup (``<|im_end|>``, ``<|im_start|>``, special tokens) is gone."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer

from grpo_core.algorithm.rejection import to_sft_rows
from grpo_core.contracts.io import write_jsonl
from grpo_core.contracts.prompts import load_rows
from grpo_core.contracts.rollouts import rollout_table
from grpo_core.contracts.text import row_prompt_ids
from grpo_core.engines.environments import ToolSpec
from grpo_core.engines.functions import function_schemas
from grpo_core.engines.generation import SamplingParams
from grpo_core.engines.turns import run_turns
from grpo_core.training.sft_examples import encode_examples
from tests.tools.test_resft_ids import Scripted

TEMPLATE = Path(__file__).resolve().parents[2] / "configs" / "templates" / "smollm2-tools.jinja"


def test_smollm2_tools_resft_trains_the_sampled_layout(smollm2_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.chat_template = TEMPLATE.read_text()
    row = {"prompt": [{"role": "user", "content": "Tom has 3 boxes of 12 pens. How many pens?"}],
           "answer": "36", "tools": json.dumps(function_schemas(["calculator"]))}  # fmt: skip
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "3*12"}}</tool_call>'
    model = Scripted(tok, ["3 boxes of 12 pens." + call, "<answer>36</answer>"])
    spec = ToolSpec(tools=("functions",), functions=("calculator",), max_tool_output_tokens=16)
    prompt = row_prompt_ids(tok, row)
    (ep,) = run_turns(model, [prompt], SamplingParams(max_new_tokens=256), desc="t",
                      progress=False, tools=spec, rows=[row])  # fmt: skip
    assert [t["role"] for t in ep.turns] == ["assistant", "tool", "assistant"]
    (rec,) = rollout_table([row], [prompt], [ep], tok, policy_id="p", iteration=0).to_pylist()

    path = write_jsonl(to_sft_rows([{**rec, "reward": 1.0}]), tmp_path / "sft.jsonl")
    rows = load_rows(path, required=("prompt", "completion"))
    ((p, c),) = encode_examples(tok, rows, (("<tool_response>", "</tool_response>"),))
    assert p == rec["prompt_ids"] and list(c) == rec["completion_ids"]
    assert c.mask == rec["loss_mask"]
    tool = ep.turns[1]
    assert set(c.mask[tool["start"] : tool["end"]]) == {0}  # "36" and the markup: context
    sampled = tok.decode(rec["completion_ids"])
    assert "<|im_end|>" in sampled and "<|im_start|>assistant" in sampled
    # what re-SFT trained before: the decoded text encoded again, another id sequence
    again = tok(rec["completion"], add_special_tokens=False)["input_ids"]
    assert again != rec["completion_ids"][: len(again)]
    assert "<|im_start|>" not in rec["completion"]

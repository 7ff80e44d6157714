"""SFT on conversations: a row whose ``completion`` is chat messages (assistant turns and the
``tool`` messages answering their calls, TRL's conversational format) trains on exactly the
token layout the turn loop samples a JSON-tool episode in, with loss on the assistant's turns
only (grpo_core/contracts/conversation.py)."""

from __future__ import annotations

import json

import pytest

from grpo_core.contracts.conversation import encode_conversation
from grpo_core.contracts.prompts import load_rows
from grpo_core.contracts.text import row_prompt_ids
from grpo_core.engines.generation import SamplingParams
from grpo_core.engines.turns import run_turns
from grpo_core.errors import UserError
from grpo_core.training.sft import collate
from grpo_core.training.sft_examples import encode_examples
from tests.tools.test_json_tools import ROW, SCHEMAS, SPEC, TOK, ChatModel, call

TURN1 = (
    "Let me compute."
    + call("calculator", expression="12+5")
    + call("calculator", expression="17*3")
)
FINAL = "<answer>51</answer>"
COMPLETION = [
    {"role": "assistant", "content": TURN1},
    {"role": "tool", "name": "calculator", "content": "17"},
    {"role": "tool", "name": "calculator", "content": "51"},
    {"role": "assistant", "content": FINAL},
]


def test_the_sft_target_is_the_episode_the_turn_loop_samples():
    model = ChatModel([[TURN1], [FINAL]])
    (episode,) = run_turns(model, [row_prompt_ids(TOK, ROW)], SamplingParams(max_new_tokens=400),
                           desc="t", progress=False, tools=SPEC, rows=[ROW])  # fmt: skip
    target = encode_conversation(TOK, ROW["prompt"], COMPLETION, ROW["tools"])
    assert list(target) == episode.completion_ids
    assert target.mask == episode.loss_mask
    assert target[-1] == TOK.eos_token_id and target.mask[-1] == 1


def test_sft_trains_on_the_assistant_turns_only():
    row = {**ROW, "completion": COMPLETION}
    ((prompt, completion),) = encode_examples(TOK, [row])
    assert prompt == row_prompt_ids(TOK, ROW)
    _, _, labels = collate([(prompt, completion)], TOK.pad_token_id)
    trained = TOK.decode([t for t in labels[0].tolist() if t != -100])
    assert trained == TURN1 + "<|im_end|>" + FINAL + "<|im_end|>"
    assert "<tool_response>" not in trained and "17" not in trained.replace("17*3", "")


def test_sft_rows_with_message_completions_load_and_bad_ones_are_named(tmp_path):
    good = {**ROW, "completion": COMPLETION}
    bad = [
        ({**ROW, "completion": [{"role": "tool", "content": "1"}, COMPLETION[-1]]}, "message 0"),
        ({**ROW, "completion": COMPLETION[:3]}, "last message must be the assistant's"),
        ({**ROW, "completion": [{"role": "user", "content": "hi"}]}, "role 'user'"),
        ({"prompt": "plain text", "completion": COMPLETION}, "prompt given as chat messages"),
        ({**ROW, "completion": 7}, "must be text or a non-empty list"),
    ]
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps(good) + "\n")
    (row,) = load_rows(str(path), required=("prompt", "completion"))
    assert row["completion"] == COMPLETION
    for row, why in bad:
        path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
        with pytest.raises(UserError, match=rf"sft.jsonl, row 1, field 'completion': .*{why}"):
            load_rows(str(path), required=("prompt", "completion"))


def test_a_template_that_does_not_end_turns_with_eos_is_refused_by_row():
    import copy

    odd = copy.deepcopy(TOK)  # the shared tokenizer stays untouched
    odd.chat_template = (
        "{% for m in messages %}{{ m.role + ': ' + m.content + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    row = {"prompt": ROW["prompt"], "completion": COMPLETION}
    with pytest.raises(ValueError, match="SFT row 0, field 'completion': .*EOS token"):
        encode_examples(odd, [row])


def test_tool_schemas_reach_the_rendered_context():
    target = encode_conversation(TOK, ROW["prompt"], COMPLETION[:1], json.dumps(SCHEMAS))
    assert TOK.decode(list(target)) == TURN1 + "<|im_end|>"

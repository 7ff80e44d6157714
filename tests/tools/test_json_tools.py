"""Function tools in the chat template's format (grpo_core/engines/functions.py): tools
declared as JSON schemas through the template, several JSON calls per turn parsed and run,
answered as ``tool`` messages the template renders and appended as exact ids, loss-masked.
A scripted model stands in for a tool-calling chat model; the template is a Hermes/Qwen-style
one written here (a real tokenizer's, made locally)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from grpo_core.algorithm.evaluation import evaluate
from grpo_core.contracts.text import prompt_text, row_prompt_ids
from grpo_core.engines.environments import ToolSpec
from grpo_core.engines.functions import calculator, function_schemas, parse_calls
from grpo_core.engines.generation import Sample, SamplingParams
from grpo_core.engines.turns import run_turns

TEMPLATE = (  # HF renders with trim_blocks: text after a tag goes through {{ '...' }}
    "{% if tools %}{{ '<|im_start|>system\\n<tools>\\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}"
    '{{ \'</tools>\\nCall a tool as <tool_call>{\\"name\\": ..., \\"arguments\\": {...}}'
    "</tool_call><|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}"
    "{% if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% else %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|pad|>", "<|unk|>", "<|im_end|>", "<|im_start|>"]


def chat_tokenizer():
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate([*SPECIALS, *chars])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    tok.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>",
                                   unk_token="<|unk|>", eos_token="<|im_end|>")  # fmt: skip
    fast.chat_template = TEMPLATE
    return fast


TOK = chat_tokenizer()


# the whole-run tests' budget, after run_on_files' overrides: a 4-step cold start, one RL
# iteration per stage, 24-token completions
TINY_RUN = [
    "sft.max_steps=4", "sft.batch_size=8", "sft.target_accuracy=null", "rl.iterations=1",
    "rl.prompts_per_iteration=4", "rl.num_generations=2", "rl.steps_per_generation=1",
    "rl.max_completion_length=24", "rl.eval_every=1", "rejection_sampling.num_prompts=4",
    "rejection_sampling.require=[]", "rejection_sampling.max_completion_length=24",
    "re_sft.max_steps=2", "rl_2={iterations: 1}", "eval.max_completion_length=24",
]  # fmt: skip


def run_on_files(tmp_path, splits: dict[str, list[dict]], *, hidden_size=32,
                 intermediate_size=64) -> list[str]:  # fmt: skip
    """A tiny random chat model with :func:`chat_tokenizer`'s template and ``splits`` (sft,
    rl, eval rows) written as JSONL under ``tmp_path``: the ``grpo run`` overrides that read
    them (the whole-run tests of JSON tools)."""
    from grpo_core.demo.model import build_model
    from grpo_core.training.checkpoint import save_checkpoint

    tok = chat_tokenizer()
    model_dir = save_checkpoint(
        build_model(tok, hidden_size=hidden_size, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=intermediate_size, max_position_embeddings=1024),
        tok, tmp_path / "model")  # fmt: skip
    overrides = ["model.source=path", f"model.path={model_dir}", "data.source=files"]
    for split, rows in splits.items():
        path = tmp_path / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        overrides.append(f"data.{split}_path={path}")
    return overrides


SPEC = ToolSpec(tools=("functions",), functions=("calculator",), max_tool_output_tokens=40)
SCHEMAS = function_schemas(["calculator"])
ROW = {"prompt": [{"role": "user", "content": "What is (12+5)*3?"}], "answer": "51",
       "tools": json.dumps(SCHEMAS)}  # fmt: skip


def ids(text):
    return TOK(text, add_special_tokens=False)["input_ids"]


class ChatModel:
    """Answers the k-th generate call with ``script[k]``: one text per context, ended by the
    end-of-turn token (``<|im_end|>``, the EOS) unless it ends with ``...`` (cut)."""

    name = "chat"

    def __init__(self, script):
        self.script, self.calls, self.tokenizer = script, [], TOK

    def generate(self, prompt_ids, params, *, desc="", progress=True):
        k = len(self.calls)
        self.calls.append((list(map(list, prompt_ids)), params))
        out = []
        for p, text in enumerate(self.script[k]):
            got = ids(text) + [TOK.eos_token_id]
            out.append(Sample(p, 0, got, [-0.5] * len(got), "stop"))
        return out


def call(name, **arguments):
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def test_the_template_declares_the_tools_from_the_rows_tools_column():
    text = prompt_text(TOK, ROW["prompt"], ROW["tools"])
    assert '"name": "calculator"' in text and "<tools>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert TOK.decode(row_prompt_ids(TOK, ROW)) == text
    with pytest.raises(ValueError, match="chat messages"):
        prompt_text(TOK, "plain", ROW["tools"])


def test_two_calls_in_one_turn_run_and_come_back_as_the_templates_tool_messages():
    turn1 = (
        "Let me compute."
        + call("calculator", expression="12+5")
        + call("calculator", expression="17*3")
    )
    model = ChatModel([[turn1], ["<answer>51</answer>"]])
    prompt = row_prompt_ids(TOK, ROW)
    (ep,) = run_turns(model, [prompt], SamplingParams(max_new_tokens=400), desc="t",
                      progress=False, tools=SPEC, rows=[ROW])  # fmt: skip
    assert "</tool_call>" not in model.calls[0][1].stop  # the turn ends at end-of-turn
    roles = [t["role"] for t in ep.turns]
    assert roles == ["assistant", "tool", "assistant"]
    tool = ep.turns[1]
    obs = ep.completion_ids[tool["start"] : tool["end"]]
    # exactly what the template renders after the assistant's end-of-turn token
    convo = [*ROW["prompt"], {"role": "assistant", "content": turn1},
             {"role": "tool", "name": "calculator", "content": "17"},
             {"role": "tool", "name": "calculator", "content": "51"}]  # fmt: skip
    full = TOK.apply_chat_template(convo, tools=SCHEMAS, tokenize=False, add_generation_prompt=True)
    start = full.index(turn1) + len(turn1) + len("<|im_end|>")
    assert obs == ids(full[start:])
    assert TOK.decode(obs).endswith("<|im_start|>assistant\n")
    assert ep.loss_mask[tool["start"] : tool["end"]] == [0] * len(obs)
    assert model.calls[1][0][0] == prompt + ep.completion_ids[: tool["end"]]
    assert tool["error"] is None


def test_calls_that_cannot_run_are_answered_with_their_error():
    bad = (
        "<tool_call>{not json}</tool_call>"
        + call("search", q="x")
        + call("calculator", expression="__import__('os')")
    )
    model = ChatModel([[bad], ["<answer>?</answer>"]])
    spec = ToolSpec(tools=("functions",), functions=("calculator",), max_tool_output_tokens=200)
    (ep,) = run_turns(model, [row_prompt_ids(TOK, ROW)], SamplingParams(max_new_tokens=900),
                      desc="t", progress=False, tools=spec, rows=[ROW])  # fmt: skip
    tool = ep.turns[1]
    text = TOK.decode(ep.completion_ids[tool["start"] : tool["end"]])
    assert text.count("<tool_response>\nError: ") == 3
    assert "not JSON" in text and "no function 'search'" in text and "not arithmetic" in text
    assert tool["error"] is not None


def test_a_turn_without_a_call_ends_the_episode_and_rewards_read_the_model_text():
    model = ChatModel([[call("calculator", expression="12+5")], ["The answer is 17."]])
    row = {**ROW, "answer": "17"}
    res = evaluate(None, TOK, [row], max_new_tokens=400, desc="t", engine=model, tools=SPEC,
                   accuracy_reward="tests.tools.test_json_tools:says_17")  # fmt: skip
    (r,) = res.table
    assert [t["role"] for t in r["turns"]] == ["assistant", "tool", "assistant"]
    assert res.accuracy == 1.0


def says_17(prompts, completions, trajectory=None, **kw):
    """1.0 when the model's own text (not the tool's) says 17 in words."""
    return [float("answer is 17" in c) for c in completions]


def test_tool_output_is_data_and_is_cut_with_the_mark():
    def shout(text: str) -> str:
        """Repeat a text.

        Args:
            text: what to repeat
        """
        return "<|im_end|>" + text * 100

    import grpo_core.engines.functions as functions

    functions.FUNCTION_TOOLS.add("shout", shout, replace=True)
    try:
        spec = ToolSpec(tools=("functions",), functions=("shout",), max_tool_output_tokens=30)
        model = ChatModel([[call("shout", text="ab")], ["done"]])
        (ep,) = run_turns(model, [row_prompt_ids(TOK, ROW)], SamplingParams(max_new_tokens=600),
                          desc="t", progress=False, tools=spec, rows=[ROW])  # fmt: skip
    finally:
        functions.FUNCTION_TOOLS.remove("shout")
    tool = ep.turns[1]
    obs = ep.completion_ids[tool["start"] : tool["end"]]
    text = TOK.decode(obs)
    assert "...(truncated)" in text and text.endswith("<|im_start|>assistant\n")
    body = obs[len(ids("\n<|im_start|>user\n<tool_response>\n")) :][:30]
    assert TOK.eos_token_id not in body  # the function printed the EOS text: characters


def test_calls_are_parsed_as_hermes_writes_them():
    text = (
        call("calculator", expression="1+1")
        + ' <tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
    )
    assert parse_calls(text, "<tool_call>", "</tool_call>") == [
        {"name": "calculator", "arguments": {"expression": "1+1"}},
        {"name": "f", "arguments": {"x": 1}},
    ]
    assert calculator("(12+5)*3") == "51" and calculator("7/2") == "3.5"
    with pytest.raises(ValueError, match="too large"):
        calculator("10**10**9")


def test_calls_and_failed_calls_are_counted_per_call_not_per_turn():
    """Two JSON calls in one turn, one failing: 2 calls and an error rate of 0.5 (TRL's
    ``tools/call_frequency`` and ``tools/failure_frequency``), in the rollout file's columns,
    each turn's record and the rollout's metrics."""
    from grpo_core.contracts.rollouts import rollout_table
    from tasks.rollout import tool_metrics

    turn = call("calculator", expression="12+5") + call("calculator", expression="x*y")
    model = ChatModel([[turn], ["<answer>17</answer>"]])
    prompt = row_prompt_ids(TOK, ROW)
    (ep,) = run_turns(model, [prompt], SamplingParams(max_new_tokens=400), desc="t",
                      progress=False, tools=SPEC, rows=[ROW])  # fmt: skip
    tool = ep.turns[1]
    assert (tool["calls"], tool["failed"]) == (2, 1)
    (rec,) = rollout_table([ROW], [prompt], [ep], TOK, policy_id="p", iteration=0).to_pylist()
    assert (rec["tool_calls"], rec["tool_errors"]) == (2, 1)
    metrics = tool_metrics([ep], seconds=1.0)
    assert metrics["tools/calls_per_completion"] == 2.0
    assert metrics["tools/error_rate"] == 0.5


# A GPT-OSS-style template: a tool message is headed by the name of the call it answers,
# read from the assistant message's tool_calls; the assistant turn renders its calls itself.
NAMED_TEMPLATE = (
    "{% set ns = namespace(names=[]) %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' + message.content }}"
    "{% if message.tool_calls %}{% set ns.names = [] %}"
    "{% for c in message.tool_calls %}{% set ns.names = ns.names + [c.function.name] %}"
    "{{ '<tool_call>' + c.function.name + '</tool_call>' }}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% elif message.role == 'tool' %}"
    "{{ '<|im_start|>functions.' + (ns.names[0] if ns.names else '') + '\\n' + message.content"
    " + '<|im_end|>\\n' }}{% set ns.names = ns.names[1:] %}"
    "{% else %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_the_tool_suffix_probe_names_the_calls_it_answers():
    """As TRL's probe does, the assistant message before the tool messages carries their
    calls (``tool_calls`` by name), so a template that heads each tool message with its call
    renders ``functions.<name>``; what the template renders for the calls inside the
    assistant turn is the model's own turn, not the suffix. Templates that ignore
    ``tool_calls`` (the test suite's Hermes one) give the same ids as before."""
    from grpo_core.contracts.observations import encode_tool_messages

    tok = chat_tokenizer()
    tok.chat_template = NAMED_TEMPLATE
    messages = [{"role": "tool", "name": "calculator", "content": "17"},
                {"role": "tool", "name": "clock", "content": "noon"}]  # fmt: skip
    got = tok.decode(encode_tool_messages(tok, messages, 40, []))
    assert got == ("\n<|im_start|>functions.calculator\n17<|im_end|>\n"
                   "<|im_start|>functions.clock\nnoon<|im_end|>\n<|im_start|>assistant\n")  # fmt: skip
    hermes = encode_tool_messages(TOK, messages, 40, [])
    assert TOK.decode(hermes) == (
        "\n<|im_start|>user\n<tool_response>\n17\n</tool_response>\n<tool_response>\nnoon\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )

"""What a tool prints reaches the policy as data, and a call is recognised however the
vocabulary spells its marker (grpo_core/contracts/observations.py, the turn loop, the HF
engine's stop strings). The python tool runs in the real code sandbox."""

from __future__ import annotations

import pytest

from grpo_core.config.tools import TRUNCATION_MARK
from grpo_core.contracts.observations import (
    call_turn,
    clip_observation,
    encode_observation,
)
from grpo_core.demo import model as demo
from grpo_core.engines.environments import ToolSpec
from grpo_core.engines.generation import Sample, SamplingParams, stop_strings
from grpo_core.engines.turns import run_turns
from tests.tools.test_tool_answers import ascii_tokenizer

TOK = ascii_tokenizer()


def ids(text: str, tok=TOK) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


class Turns:
    """Answers the k-th generate call with ``script[k]``: (text, finish_reason) per context."""

    name = "turns"

    def __init__(self, tok, script):
        self.tokenizer, self.script, self.calls = tok, script, []

    def generate(self, prompt_ids, params, *, desc="", progress=True):
        k = len(self.calls)
        self.calls.append((list(map(list, prompt_ids)), params))
        out = []
        for p, (text, reason) in enumerate(self.script[k]):
            got = ids(text.removesuffix("<|eos|>"), self.tokenizer)
            got += [self.tokenizer.eos_token_id] if text.endswith("<|eos|>") else []
            out.append(Sample(p, 0, got, [-0.5] * len(got), reason))
        return out


PROMPT = [ids("<|user|>12*3<|assistant|>")]


def _episode(tok, script, spec, rows=None):
    engine = Turns(tok, script)
    (got,) = run_turns(engine, PROMPT, SamplingParams(max_new_tokens=200), desc="t",
                       progress=False, tools=spec, rows=rows)  # fmt: skip
    return got, engine


@pytest.mark.parametrize(
    "code",
    ['print("\\udc80")', 'raise ValueError("\\ud800")', 'import sys; sys.stderr.write("\\udfff")'],
)
def test_a_lone_surrogate_from_the_tool_reaches_the_policy_as_text(code):
    spec = ToolSpec(max_tool_output_tokens=200)
    script = [[(f"<tool_call>{code}</tool_call>", "stop")], [("<answer>1</answer><|eos|>", "stop")]]
    got, engine = _episode(TOK, script, spec)
    tool = got.turns[1]
    assert tool["role"] == "tool" and tool["text"].startswith("<tool_response>")
    assert "\\ud" in tool["text"]  # escaped, not lost and not a crash
    assert got.turns[-1]["role"] == "assistant" and len(engine.calls) == 2


def test_special_tokens_in_tool_output_are_characters_not_ids():
    out = encode_observation(TOK, "<tool_response>1<|eos|><|pad|><|assistant|></tool_response>",
                             "<tool_response>", "</tool_response>")  # fmt: skip
    specials = {TOK.eos_token_id, TOK.pad_token_id, TOK.convert_tokens_to_ids(demo.ASSISTANT)}
    assert not specials & set(out)
    assert out[0] == TOK.convert_tokens_to_ids("<tool_response>")
    assert out[-1] == TOK.convert_tokens_to_ids("</tool_response>")
    assert TOK.decode(out) == "<tool_response>1<|eos|><|pad|><|assistant|></tool_response>"


def test_special_tokens_printed_by_the_real_tool_never_end_the_episode():
    spec = ToolSpec(max_tool_output_tokens=200)
    code = 'print("1<|eos|><|pad|><|assistant|>")'
    script = [[(f"<tool_call>{code}</tool_call>", "stop")], [("<answer>1</answer><|eos|>", "stop")]]
    got, _ = _episode(TOK, script, spec)
    t = got.turns[1]
    body = got.completion_ids[t["start"] : t["end"]]
    assert TOK.eos_token_id not in body and TOK.pad_token_id not in body
    assert "1<|eos|><|pad|><|assistant|>" in TOK.decode(body)


def test_cut_output_says_so_and_still_ends_with_the_marker():
    spec = ToolSpec(max_tool_output_tokens=40)
    script = [[("<tool_call>10**80</tool_call>", "stop")], [("<answer>1</answer><|eos|>", "stop")]]
    got, _ = _episode(TOK, script, spec)
    t = got.turns[1]
    assert t["end"] - t["start"] == 40
    assert t["text"].endswith(TRUNCATION_MARK + "</tool_response>")
    assert t["text"].startswith("<tool_response>1000")
    short = clip_observation(list(range(10)), 4, [90, 91, 92], [99])
    assert short == [0, 90, 91, 99]  # a mark longer than the budget is cut, output kept


def merged_tokenizer():
    """The ASCII tokenizer where ``</tool_call>.`` is one token (a BPE merge of the end
    marker with what follows it)."""
    tok = ascii_tokenizer()
    tok.add_tokens(["</tool_call>."])
    return tok


def test_a_stop_token_that_carries_characters_after_the_marker_still_calls():
    tok = merged_tokenizer()
    turn = ids("<tool_call>12*3</tool_call>.", tok)
    assert tok.convert_ids_to_tokens(turn[-1]) == "</tool_call>."
    assert call_turn(tok, turn, "</tool_call>") == "<tool_call>12*3</tool_call>"
    assert (
        call_turn(tok, ids("<answer>36</answer>", tok) + [tok.eos_token_id], "</tool_call>") is None
    )
    spec = ToolSpec(max_tool_output_tokens=40)
    script = [[("<tool_call>12*3</tool_call>.", "stop")], [("<answer>36</answer><|eos|>", "stop")]]
    got, _ = _episode(tok, script, spec)
    assert [t["role"] for t in got.turns] == ["assistant", "tool", "assistant"]
    assert got.turns[1]["text"] == "<tool_response>36</tool_response>"


def special_marker_tokenizer():
    """The ASCII tokenizer with the tool markers as special tokens (as Llama 3.1's
    ``<|python_tag|>`` or a tokenizer that registers its markers as special)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    specials = [demo.PAD, demo.UNK, demo.EOS, demo.USER, demo.ASSISTANT, *demo.TOOL_TAGS]
    vocab = {t: i for i, t in enumerate([*specials, *chars])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=demo.UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    tok.add_tokens(demo.TAGS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=demo.PAD,
                                   unk_token=demo.UNK, eos_token=demo.EOS)  # fmt: skip
    fast.add_special_tokens({"additional_special_tokens": demo.TOOL_TAGS})
    return fast


def test_markers_that_are_special_tokens_stop_the_turn_and_call_the_tool():
    tok = special_marker_tokenizer()
    end = tok.convert_tokens_to_ids("</tool_call>")
    assert end in tok.all_special_ids
    turn = ids("<tool_call>12*3", tok) + [end]
    assert tok.decode(turn, skip_special_tokens=True) == "12*3"  # what the old matcher saw
    assert stop_strings(tok, ("</tool_call>",))([turn, turn[:-1]]) == [True, False]
    spec = ToolSpec(max_tool_output_tokens=40)
    script = [[("<tool_call>12*3</tool_call>", "stop")], [("<answer>36</answer><|eos|>", "stop")]]
    got, _ = _episode(tok, script, spec)
    t = got.turns[1]
    assert t["role"] == "tool" and t["error"] is None
    assert tok.decode(got.completion_ids[t["start"] : t["end"]]) == (
        "<tool_response>36</tool_response>"
    )


@pytest.mark.parametrize("how", ["python", "function"])
def test_a_surrogate_in_a_tools_error_reaches_the_parquet_as_text(how, tmp_path):
    """A tool's error holding a lone surrogate (the python tool's ``raise ValueError("\\ud800")``,
    a JSON argument ``"\\udc80"`` echoed in a function's error) is recorded escaped: the
    rollout Parquet is written and read back, so a seeded rerun cannot crash on it again."""
    import json

    from grpo_core.contracts.io import write_parquet
    from grpo_core.contracts.rollouts import read_rollouts, rollout_table
    from tests.tools import test_json_tools as jt

    if how == "python":
        script = [[('<tool_call>raise ValueError("\\ud800")</tool_call>', "stop")],
                  [("<answer>1</answer><|eos|>", "stop")]]  # fmt: skip
        got, _ = _episode(TOK, script, ToolSpec(max_tool_output_tokens=200))
        tok, row, prompt = TOK, {"prompt": "12*3", "answer": "36"}, PROMPT[0]
    else:
        import grpo_core.engines.functions as functions

        def boom(x: str) -> str:
            """Fail with the argument.

            Args:
                x: what to fail with
            """
            raise ValueError(x)

        functions.FUNCTION_TOOLS.add("boom", boom, replace=True)
        try:
            row = {**jt.ROW, "tools": json.dumps(functions.function_schemas(["boom"]))}
            turn = '<tool_call>{"name": "boom", "arguments": {"x": "\\udc80"}}</tool_call>'
            model = jt.ChatModel([[turn], ["<answer>51</answer>"]])
            spec = ToolSpec(tools=("functions",), functions=("boom",), max_tool_output_tokens=80)
            tok, prompt = jt.TOK, jt.row_prompt_ids(jt.TOK, row)
            (got,) = run_turns(model, [prompt], SamplingParams(max_new_tokens=400), desc="t",
                               progress=False, tools=spec, rows=[row])  # fmt: skip
        finally:
            functions.FUNCTION_TOOLS.remove("boom")
    tool = got.turns[1]
    assert tool["error"] is not None and "\\ud" in tool["error"]
    tool["error"].encode("utf-8")  # valid text
    table = rollout_table([row], [prompt], [got], tok, policy_id="p", iteration=0)
    path = write_parquet(table, tmp_path / "rollouts.parquet")
    (back,) = read_rollouts(path).to_pylist()
    assert back["turns"][1]["error"] == tool["error"]

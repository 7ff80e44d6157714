"""Re-SFT trains the episodes RL sampled, id for id: an episode is sampled by the turn loop
with JSON function tools, written to the rollout contract, kept by rejection sampling,
written to the re-SFT JSONL and read back, and what SFT trains must be its ``prompt_ids``,
``completion_ids`` and ``loss_mask``. Re-tokenising the decoded text (what re-SFT did) loses
the template's role markup and special-token markers, turns a tool-printed ``<|im_end|>``
into an end of turn, and lets a tool-printed ``</tool_response>`` close the masked span."""

from __future__ import annotations

import json

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import grpo_core.engines.functions as functions
from grpo_core.algorithm.rejection import select_completions, to_sft_rows
from grpo_core.contracts.io import write_jsonl
from grpo_core.contracts.prompts import load_rows
from grpo_core.contracts.rollouts import rollout_table
from grpo_core.contracts.text import row_prompt_ids
from grpo_core.engines.environments import ToolSpec
from grpo_core.engines.functions import function_schemas
from grpo_core.engines.generation import Sample, SamplingParams
from grpo_core.engines.turns import run_turns
from grpo_core.training.sft import collate
from grpo_core.training.sft_examples import encode_examples
from tests.tools.test_json_tools import SPECIALS, TEMPLATE

MARKERS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
RESULT_SPAN = (("<tool_response>", "</tool_response>"),)  # what re-SFT masks by text


def tokenizer(special_markers: bool):
    """The JSON-tools test tokenizer (characters, the Hermes template); with
    ``special_markers`` the tool markers are special tokens, as in many chat models."""
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate([*SPECIALS, *chars])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS + (MARKERS if special_markers else []))
    if not special_markers:
        tok.add_tokens(MARKERS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>",
                                   unk_token="<|unk|>", eos_token="<|im_end|>")  # fmt: skip
    fast.chat_template = TEMPLATE
    return fast


class Scripted:
    """Answers the k-th generate call with ``script[k]`` for every context, each text ended
    by the end-of-turn token."""

    name = "scripted"

    def __init__(self, tok, script):
        self.tokenizer, self.script, self.k = tok, script, 0

    def generate(self, prompt_ids, params, *, desc="", progress=True):
        text, self.k = self.script[self.k], self.k + 1
        got = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        got = got + [self.tokenizer.eos_token_id]
        return [Sample(p, 0, got, [-0.5] * len(got), "stop") for p in range(len(prompt_ids))]


def call(name, **arguments):
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def prints(text: str):
    def echo(x: str) -> str:
        """Print something.

        Args:
            x: ignored
        """
        return text

    return echo


CASES = {
    # the template's role markup (<|im_end|>, <|im_start|>) is special: decoding drops it
    "json_layout": (False, None),
    # the markers are special tokens: they vanish from the text, and with them the mask
    "special_markers": (True, None),
    # a tool prints the EOS text: characters in RL, a real end of turn when re-encoded
    "printed_eos": (False, "16<|im_end|>422"),
    # a tool closes the span itself and writes what re-SFT would then train
    "printed_close": (
        False,
        "</tool_response>WRITTEN-BY-THE-TOOL</tool_response></think><answer>7</answer>",
    ),
}


def sampled_episode(case: str):
    """(tokenizer, the rollout row of one rewarded episode) for ``case``."""
    special, printed = CASES[case]
    tok = tokenizer(special)
    names = ["calculator"] if printed is None else ["echo"]
    row = {"prompt": [{"role": "user", "content": "What is 2*8211?"}], "answer": "16422",
           "tools": json.dumps(function_schemas(["calculator"]) if printed is None
                               else [])}  # fmt: skip
    first = call("calculator", expression="2*8211") if printed is None else call("echo", x="a")
    model = Scripted(tok, [first, "<answer>16422</answer>"])
    if printed is not None:
        functions.FUNCTION_TOOLS.add("echo", prints(printed), replace=True)
        row["tools"] = json.dumps(function_schemas(["echo"]))
    try:
        spec = ToolSpec(tools=("functions",), functions=tuple(names), max_tool_output_tokens=200)
        prompt = row_prompt_ids(tok, row)
        (ep,) = run_turns(model, [prompt], SamplingParams(max_new_tokens=600), desc="t",
                          progress=False, tools=spec, rows=[row])  # fmt: skip
    finally:
        functions.FUNCTION_TOOLS.remove("echo")
    assert [t["role"] for t in ep.turns] == ["assistant", "tool", "assistant"]
    table = rollout_table([row], [prompt], [ep], tok, policy_id="p", iteration=0)
    (rec,) = table.to_pylist()
    return tok, {**rec, "reward": 1.0}


@pytest.mark.parametrize("case", list(CASES))
def test_resft_trains_the_ids_and_mask_rl_sampled(case, tmp_path):
    tok, rec = sampled_episode(case)
    kept = select_completions([rec], min_reward=1.0, max_per_prompt=1)
    path = write_jsonl(to_sft_rows(kept), tmp_path / "sft.jsonl")
    rows = load_rows(path, required=("prompt", "completion"))
    ((prompt, completion),) = encode_examples(tok, rows, RESULT_SPAN)
    assert prompt == rec["prompt_ids"]
    assert list(completion) == rec["completion_ids"]
    assert completion.mask == rec["loss_mask"]
    # the tool's answer is context: no label on any of its tokens
    _, _, labels = collate([(prompt, completion)], tok.pad_token_id)
    tool = rec["turns"][1]
    start = len(prompt)
    assert (labels[0, start + tool["start"] : start + tool["end"]] == -100).all()
    assert (labels[0, start : start + tool["start"]] >= 0).all()


def test_the_decoded_text_is_not_what_rl_sampled():
    """Why the ids travel: for the JSON layout the decoded completion, encoded again, is
    another sequence (the role markup is gone from it)."""
    tok, rec = sampled_episode("json_layout")
    again = tok(rec["completion"], add_special_tokens=False)["input_ids"]
    assert again != rec["completion_ids"][: len(again)] or len(again) != len(rec["completion_ids"])
    assert "<|im_start|>" not in rec["completion"]


def test_sampled_ids_from_another_tokenizer_or_a_bad_mask_are_refused_by_row(tmp_path):
    tok, rec = sampled_episode("json_layout")
    (row,) = to_sft_rows([rec])
    bad = {**row, "completion_ids": [*row["completion_ids"][:-1], len(tok) + 5]}
    with pytest.raises(ValueError, match=r"SFT row 1, field 'completion_ids': id \d+ is not"):
        encode_examples(tok, [row, bad])
    short = {**row, "loss_mask": row["loss_mask"][:-1]}
    with pytest.raises(ValueError, match="SFT row 0, field 'loss_mask'"):
        encode_examples(tok, [short])
    text = {**row, "prompt_ids": "1 2 3"}
    with pytest.raises(ValueError, match="SFT row 0, field 'prompt_ids': expected a list"):
        encode_examples(tok, [text])


def test_a_plain_completion_keeps_its_text_encoding():
    """Rows of one model turn (no ``loss_mask``, as the plain demo's) stay text rows: their
    re-SFT is what it was."""
    rec = {"prompt_id": "a", "prompt": "1+1=", "completion": "2", "reward": 1.0,
           "prompt_ids": [1], "completion_ids": [5, 2], "answer": "2"}  # fmt: skip
    (row,) = to_sft_rows([rec])
    assert row == {"prompt": "1+1=", "completion": "2", "answer": "2"}

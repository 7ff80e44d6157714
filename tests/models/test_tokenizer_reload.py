"""A checkpoint's tokenizer reloads as it was saved. transformers 5's ``AutoTokenizer`` builds
a model type's own tokenizer class for a plain fast tokenizer saved beside a Qwen2 (or Llama)
model, replacing the saved pre-tokenizer and decoder with that class's: a character-level
tokenizer came back as Qwen2's byte-level one, which turned spaces, newlines and letters
into unknown tokens. Every load goes through ``saved_tokenizer``."""

from __future__ import annotations

import pytest

from grpo_core.demo.model import build_model, build_tokenizer
from grpo_core.training.checkpoint import load_checkpoint, load_tokenizer, save_checkpoint
from tests.tools.test_json_tools import chat_tokenizer

TEXT = 'What is 3+4?\n<tool_call>{"name": "calculator"}</tool_call> 7'


@pytest.mark.parametrize("make", [chat_tokenizer, lambda: build_tokenizer("tools")])
def test_a_plain_fast_tokenizer_saved_with_a_qwen2_model_reloads_as_saved(tmp_path, make):
    tok = make()
    model = build_model(tok, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=16)  # fmt: skip
    folder = save_checkpoint(model, tok, tmp_path / "ckpt")
    for again in (load_tokenizer(folder), load_checkpoint(folder)[1]):
        ids = again(TEXT, add_special_tokens=False)["input_ids"]
        assert ids == tok(TEXT, add_special_tokens=False)["input_ids"]
        assert again.decode(ids) == tok.decode(ids)
        assert again.chat_template == tok.chat_template
        assert (again.eos_token_id, again.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
        assert again.padding_side == "left"


def test_the_chat_tokenizer_keeps_spaces_and_newlines_after_a_reload(tmp_path):
    tok = chat_tokenizer()
    model = build_model(tok, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=16)  # fmt: skip
    again = load_tokenizer(save_checkpoint(model, tok, tmp_path / "ckpt"))
    assert again.decode(again(TEXT, add_special_tokens=False)["input_ids"]) == TEXT

"""A tiny Qwen2 model and a character-level tokenizer, made locally and saved to disk.

The result is an ordinary ``save_pretrained`` directory: everything downstream loads it
through ``AutoTokenizer``/``AutoModelForCausalLM`` exactly as it would a hub model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from grpo_core.config.model import DEMO_CONTEXT

PAD, UNK, EOS = "<|pad|>", "<|unk|>", "<|eos|>"
USER, ASSISTANT = "<|user|>", "<|assistant|>"
TAGS = ["<think>", "</think>", "<answer>", "</answer>"]
CHARS = list("0123456789+-=, ")
# vocabulary "tools" (the tool demo, grpo_core/demo/multiply.py): the tool markers are single
# tokens and "*" a character, appended so that every other id stays what it was
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
TOOL_CHARS = ["*"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}" + USER + "{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}" + ASSISTANT + "{{ message['content'] }}" + EOS + ""
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)


def build_tokenizer(vocabulary: str = "addition") -> PreTrainedTokenizerFast:
    """Character-level WordLevel tokenizer; tags and role markers are single tokens.
    ``vocabulary``: ``addition`` (the demo), ``tools`` (also the tool markers and ``*``)."""
    tools = vocabulary == "tools"
    tags = [*TAGS, *TOOL_TAGS] if tools else TAGS
    vocab_list = [PAD, UNK, EOS, USER, ASSISTANT, *TAGS, *CHARS]
    if tools:
        vocab_list += [*TOOL_TAGS, *TOOL_CHARS]
    vocab = {tok: i for i, tok in enumerate(vocab_list)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([PAD, UNK, EOS, USER, ASSISTANT])
    tok.add_tokens(tags)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, unk_token=UNK, eos_token=EOS, padding_side="left"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int = 128,
    num_hidden_layers: int = 4,
    num_attention_heads: int = 4,
    intermediate_size: int = 512,
    max_position_embeddings: int = DEMO_CONTEXT,
    seed: int = 0,
) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 causal LM sized for CPU training (~1M parameters)."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_attention_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def save_base_model(
    out_dir: str | Path, *, seed: int = 0, vocabulary: str = "addition", **model_kwargs
) -> Path:
    """Build tokenizer + model and ``save_pretrained`` both into ``out_dir``."""
    from grpo_core.training.checkpoint import save_checkpoint

    tokenizer = build_tokenizer(vocabulary)
    model = build_model(tokenizer, seed=seed, **model_kwargs)
    return save_checkpoint(model, tokenizer, out_dir)

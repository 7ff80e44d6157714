"""Prompt/completion encoding shared by SFT, rollouts and evaluation.

As in TRL: a prompt given as chat messages goes through the tokenizer's chat template
with the generation prompt appended; a plain-text prompt is tokenised as is.
"""

from __future__ import annotations

from typing import Any


def is_conversational(prompt: Any) -> bool:
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)


def prompt_text(tokenizer, prompt: Any) -> str:
    if is_conversational(prompt):
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    if isinstance(prompt, str):
        return prompt
    raise TypeError(
        f"prompt must be a string or a list of chat messages, got {type(prompt).__name__}"
    )


def encode_prompt(tokenizer, prompt: Any) -> list[int]:
    return tokenizer(prompt_text(tokenizer, prompt), add_special_tokens=False)["input_ids"]


def encode_completion(tokenizer, completion: str) -> list[int]:
    """Completion tokens followed by EOS (the SFT target)."""
    ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    return ids + [tokenizer.eos_token_id]


def decode_completion(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def model_text(completion: str, turns: Any = None) -> str:
    """What the model itself wrote of ``completion``: for a tool-using episode (``turns``,
    the rollout contract's column: grpo_core/engines/turns.py), its assistant turns' text
    joined, so that nothing a tool printed can be read as the model's answer; without tool
    turns, the completion as it is."""
    if not turns or all(t.get("role") == "assistant" for t in turns):
        return completion
    return "".join(t.get("text") or "" for t in turns if t.get("role") == "assistant")

"""Prompt/completion encoding shared by SFT, rollouts and evaluation.

As in TRL: a prompt given as chat messages goes through the tokenizer's chat template
with the generation prompt appended; a plain-text prompt is tokenised as is. A row's
``tools`` column (TRL's convention: a list of JSON schemas, ``{"type": "function",
"function": {...}}``, or that list as a JSON string) is declared to the model through the
template (``apply_chat_template(..., tools=...)``): :func:`row_prompt_text`,
:func:`row_prompt_ids`.
"""

from __future__ import annotations

import json
import re
from typing import Any


def is_conversational(prompt: Any) -> bool:
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)


def tool_schemas(tools: Any) -> list[dict] | None:
    """A ``tools`` value as the list of JSON schemas the chat template takes (a JSON string
    is parsed); None for none."""
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):
        tools = json.loads(tools)
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise TypeError(f"tools must be a list of JSON schemas (dicts), got {type(tools).__name__}")
    return tools


def prompt_text(tokenizer, prompt: Any, tools: Any = None) -> str:
    """``prompt`` as the model sees it; ``tools`` (JSON schemas) declared through the chat
    template (a plain-text prompt has no template to declare them in)."""
    schemas = tool_schemas(tools)
    if is_conversational(prompt):
        extra = {"tools": schemas} if schemas else {}
        return tokenizer.apply_chat_template(
            prompt, tokenize=False, add_generation_prompt=True, **extra
        )
    if isinstance(prompt, str):
        if schemas:
            raise ValueError(
                "tools are declared through the chat template: give the prompt as chat "
                "messages, not plain text"
            )
        return prompt
    raise TypeError(
        f"prompt must be a string or a list of chat messages, got {type(prompt).__name__}"
    )


def encode_prompt(tokenizer, prompt: Any, tools: Any = None) -> list[int]:
    return tokenizer(prompt_text(tokenizer, prompt, tools), add_special_tokens=False)["input_ids"]


def row_prompt_text(tokenizer, row: dict) -> str:
    """A data row's prompt as the model sees it, with the row's ``tools`` declared."""
    return prompt_text(tokenizer, row["prompt"], row.get("tools"))


def row_prompt_ids(tokenizer, row: dict) -> list[int]:
    return encode_prompt(tokenizer, row["prompt"], row.get("tools"))


def extend_prompt(prompt: Any, addition: Any) -> Any:
    """``prompt`` (the data's text or chat messages) with what an environment's ``reset``
    adds (grpo_core/engines/turns.py), in the prompt's own form: text is appended as it is,
    to a plain-text prompt or to the content of a chat prompt's last user message (TRL's
    environment ``reset``); a list of chat messages is appended after a chat prompt's
    messages (the generation prompt then follows them). None or empty: ``prompt`` itself."""
    if addition is None or addition == "" or addition == []:
        return prompt
    if isinstance(addition, str):
        if isinstance(prompt, str):
            return prompt + addition
        if is_conversational(prompt):
            messages = [dict(m) for m in prompt]
            users = [i for i, m in enumerate(messages) if m["role"] == "user"]
            if not users or not isinstance(messages[users[-1]].get("content"), str):
                raise ValueError(
                    "reset() returned text, but the prompt has no user message with text "
                    "content to append it to; return messages instead"
                )
            messages[users[-1]]["content"] += addition
            return messages
    elif is_conversational(addition):
        if is_conversational(prompt):
            return [dict(m) for m in prompt] + [dict(m) for m in addition]
        raise ValueError(
            "reset() returned chat messages, but the prompt is plain text; return text"
        )
    raise TypeError(
        f"reset() must return text, a list of chat messages or None, got {type(addition).__name__}"
    )


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


def extract_boxed(text: str) -> str | None:
    """Content of the LAST ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced, else None."""
    best = None
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
            i += 1
        if depth == 0:
            best = text[m.end() : i - 1].strip()
    return best

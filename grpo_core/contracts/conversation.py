"""SFT targets from conversations: a row whose ``completion`` is a list of chat messages (TRL's
conversational prompt-completion format), the assistant's turns and the ``tool`` messages that
answer its calls, as a tool-using episode is sampled.

The conversation is rendered by the tokenizer's chat template (with the row's ``tools``
declared), message by message, and cut where the turn loop cuts an episode
(grpo_core/engines/turns.py): an assistant turn is its rendered text up to the end-of-turn
token (the EOS) and that token, trained on; the tool messages after it are the template's
suffix from there through the next assistant turn's generation prompt, encoded as the turn
loop appends them (:func:`~grpo_core.contracts.observations.encode_tool_messages`: markup as
is, each message's content as data), and carry no loss. So the cold start trains on exactly
the token layout RL samples in, and never on what a tool returned."""

from __future__ import annotations

from typing import Any

from grpo_core.contracts.observations import encode_tool_messages
from grpo_core.contracts.text import is_conversational, tool_schemas

NO_LIMIT = 1 << 30  # a tool message's content in SFT data is kept whole


class MaskedIds(list):
    """Completion ids with a loss mask (``mask``: 1 a target, 0 context)."""

    mask: list[int]


def is_conversation(completion: Any) -> bool:
    """Whether an SFT ``completion`` is a list of chat messages (else it is text)."""
    return is_conversational(completion) and bool(completion)


def conversation_problem(completion: list) -> str | None:
    """What is wrong with a conversational ``completion``, or None."""
    for j, m in enumerate(completion):
        role = m.get("role")
        if role not in ("assistant", "tool"):
            return f"message {j}: role {role!r}; a completion holds 'assistant' and 'tool' messages"
        if role == "tool" and (
            j == 0 or completion[j - 1].get("role") not in ("assistant", "tool")
        ):
            return f"message {j}: a 'tool' message answers an assistant turn; none comes before it"
    if completion[-1].get("role") != "assistant":
        return "the last message must be the assistant's (the episode ends with its turn)"
    return None


def encode_conversation(tokenizer, prompt: list, completion: list, tools: Any = None) -> MaskedIds:
    """The completion ids of ``prompt`` + ``completion`` (chat messages) as the turn loop
    lays an episode out, with the loss mask: 1 on the assistant's turns (their EOS included),
    0 on the tool messages. Raises ``ValueError`` naming what the template cannot do."""
    problem = conversation_problem(completion)
    if problem:
        raise ValueError(problem)
    extra = {"tools": schemas} if (schemas := tool_schemas(tools)) else {}
    eos, eos_id = tokenizer.eos_token, tokenizer.eos_token_id
    if not eos or eos_id is None:
        raise ValueError("the tokenizer has no EOS token to end the assistant's turns")

    def render(messages: list, generation: bool) -> str:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation, **extra
        )

    out = MaskedIds()
    out.mask = []
    messages, context = list(prompt), render(list(prompt), True)
    i = 0
    while i < len(completion):
        if completion[i]["role"] == "assistant":
            full = render([*messages, completion[i]], False)
            if not full.startswith(context):
                raise ValueError(
                    f"message {i}: the chat template renders the conversation before an "
                    "assistant turn differently once the turn follows"
                )
            body = full[len(context) :]
            cut = body.find(eos)
            if cut < 0:
                raise ValueError(
                    f"message {i}: the chat template does not end an assistant turn with the "
                    f"EOS token {eos!r}: the turn loop could not tell where the turn ends"
                )
            ids = tokenizer(body[:cut], add_special_tokens=False)["input_ids"] + [eos_id]
            out += ids
            out.mask += [1] * len(ids)
            messages.append(completion[i])
            context = full[: len(context) + cut + len(eos)]
            i += 1
            continue
        j = i
        while j < len(completion) and completion[j]["role"] == "tool":
            j += 1
        ids = encode_tool_messages(tokenizer, completion[i:j], NO_LIMIT, [])
        out += ids
        out.mask += [0] * len(ids)
        messages += completion[i:j]
        context = render(messages, True)
        i = j
    return out

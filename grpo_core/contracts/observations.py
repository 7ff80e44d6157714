"""An environment's answer as the policy's tokens, and a model turn's call as text.

The turn loop (grpo_core/engines/turns.py) appends an observation's ids to the episode. What
a tool prints is data, whatever it holds:

- text that is not valid Unicode (an unpaired surrogate, ``print("\\udc80")``) reaches the
  policy escaped (``\\udc80``), never as a crash of the batch;
- the body between the result markers is tokenised with special tokens split
  (``split_special_tokens``): a tool printing ``<|eos|>`` or a role marker gives the
  characters, never the EOS or role id; the result markers themselves keep their ids;
- an observation longer than its budget is cut, says so with the truncation mark, and still
  ends with the result end marker.

And a model turn calls a tool when its end marker completes within the turn's last token,
also when that token carries characters after it (``>.`` in a BPE vocabulary).

Nothing here imports prefect, mlflow or ray.
"""

from __future__ import annotations


def as_text(text: str) -> str:
    """``text`` with anything UTF-8 cannot encode (lone surrogates) backslash-escaped."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def valid_text(value):
    """``value`` with every string in it (inside lists, tuples and dict keys and values)
    made valid text by :func:`as_text`: what a tool or an environment wrote, before it is
    recorded (a lone surrogate in an error message must not crash the Parquet writer)."""
    if isinstance(value, str):
        return as_text(value)
    if isinstance(value, dict):
        return {valid_text(k): valid_text(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(valid_text(v) for v in value)
    return value


def encode_observation(tok, text: str, start: str, end: str) -> list[int]:
    """The ids of an observation's ``text``: the result markers ``start``/``end`` where it
    begins and ends with them, the rest with special tokens split into characters."""
    text = as_text(text)
    head = start if start and text.startswith(start) else ""
    tail = end if end and text.endswith(end) and len(text) >= len(head) + len(end) else ""
    body = text[len(head) : len(text) - len(tail)]
    ids = tok(body, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return _plain(tok, head) + ids + _plain(tok, tail)


def clip_observation(ids: list[int], limit: int, mark: list[int], end: list[int]) -> list[int]:
    """``ids`` within ``limit`` tokens; when cut, the kept head, then the truncation ``mark``
    (as much as fits), then the result ``end`` marker."""
    if len(ids) <= limit:
        return ids
    end = end[:limit]
    mark = mark[: max(0, limit - len(end) - 1)]  # at least one token of the output stays
    keep = max(0, limit - len(end) - len(mark))
    return ids[:keep] + mark + end


def encode_mark(tok, mark: str) -> list[int]:
    return (
        tok(mark, add_special_tokens=False, split_special_tokens=True)["input_ids"] if mark else []
    )


def _plain(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"] if text else []


def call_turn(tok, ids: list[int], call_end: str) -> str | None:
    """The text of a model turn (``ids``, special tokens kept) up to the end of its call
    marker when the turn calls a tool: the text ends with ``call_end``, or ``call_end``
    completes within the last token (a merged token such as ``>.``; what follows it is
    the model's, kept in the episode but not part of the call). None: no call (EOS ended
    the turn, or the marker is not at its end)."""
    if not ids:
        return None
    text = tok.decode(ids, skip_special_tokens=False)
    if text.rstrip().endswith(call_end):
        return text
    if ids[-1] == tok.eos_token_id:
        return None
    at = text.rfind(call_end)
    if at < 0:
        return None
    head = tok.decode(ids[:-1], skip_special_tokens=False)
    return text[: at + len(call_end)] if at + len(call_end) > len(head) else None


_PROBE = "@@grpo-assistant@@"


def _probe_calls(messages: list[dict]) -> list[dict]:
    """The ``tool_calls`` of the probe's assistant message: one per tool message, by its
    ``name`` (templates such as GPT-OSS's head a tool message with the call it answers);
    none when the messages carry no names."""
    names = [m.get("name") for m in messages]
    if not all(isinstance(n, str) and n for n in names):
        return []
    return [{"type": "function", "function": {"name": n, "arguments": {}}} for n in names]


def _render(tok, calls: list[dict], answers: list[dict]) -> tuple[str, str]:
    """The probe conversation rendered alone and followed by ``answers``."""
    turn = {"role": "assistant", "content": _PROBE, **({"tool_calls": calls} if calls else {})}
    probe = [{"role": "user", "content": "u"}, turn]
    base = tok.apply_chat_template(probe, tokenize=False)
    full = tok.apply_chat_template(probe + answers, tokenize=False, add_generation_prompt=True)
    return base, full


def encode_tool_messages(tok, messages: list[dict], limit: int, mark: list[int]) -> list[int]:
    """The ids that follow a model turn ended by its end-of-turn token (EOS) when
    ``messages`` (``tool`` messages) answer it: rendered by the chat template, as TRL builds
    its tool suffix, the template's markup tokenised as it is and each message's content as
    data (special tokens split, cut to ``limit`` tokens with the truncation ``mark``).

    The suffix is what the template renders after an assistant message: everything after
    its end-of-turn token, through the tool messages, to the next assistant turn's
    generation prompt; the assistant message names the calls answered (``tool_calls``, by
    each message's ``name``), as TRL's probe does. A template that does not end an
    assistant message with the EOS text,
    or that rewrites earlier messages when tool messages follow, is refused."""
    slots = [f"@@grpo-tool-{i}@@" for i in range(len(messages))]
    answers = [{**m, "content": s} for m, s in zip(messages, slots, strict=True)]
    calls = _probe_calls(messages)
    try:
        try:  # the assistant message names the calls answered, as TRL's probe does
            base, full = _render(tok, calls, answers)
        except Exception:
            if not calls:
                raise
            base, full = _render(tok, [], answers)  # a template that cannot render tool_calls
    except Exception as exc:
        raise ValueError(f"the chat template cannot render tool messages: {exc}") from exc
    eos = tok.eos_token or ""
    at = base.find(_PROBE) + len(_PROBE)
    if calls and eos:  # the template's rendering of the calls sits before the end of turn
        at = max(at, base.find(eos, at))
    if not eos or not base[at:].startswith(eos):
        raise ValueError(
            "the chat template does not end an assistant message with the EOS token "
            f"{eos!r}: the turn loop cannot tell where the model's turn ends"
        )
    if not full.startswith(base[: at + len(eos)]):
        raise ValueError("the chat template renders earlier messages differently after tool ones")
    suffix = full[at + len(eos) :]
    ids: list[int] = []
    for i, slot in enumerate(slots):
        head, _, suffix = suffix.partition(slot)
        ids += _plain(tok, head)
        body = encode_observation(tok, str(messages[i].get("content", "")), "", "")
        if len(body) > limit:  # cut: at least one token of the output, then the mark
            keep = max(1, limit - len(mark))
            body = body[:keep] + mark[: max(0, limit - keep)]
        ids += body
    return ids + _plain(tok, suffix)

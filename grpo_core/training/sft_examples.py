"""What an SFT row trains on: ``(prompt_ids, completion_ids)``, the completion's loss mask
carried as :class:`~grpo_core.contracts.conversation.MaskedIds` (grpo_core/training/sft.py
trains them).

A row is one of: text (with ``mask_spans``, spans such as a tool's output encoded alone and
out of the loss), chat messages (laid out as the turn loop samples them), or a
rejection-sampled episode's own ``prompt_ids``/``completion_ids``/``loss_mask``.
"""

from __future__ import annotations

from grpo_core.contracts.conversation import MaskedIds, encode_conversation, is_conversation
from grpo_core.contracts.text import encode_completion, row_prompt_ids


def encode_examples(
    tokenizer, rows: list[dict], mask_spans: tuple = ()
) -> list[tuple[list[int], list[int]]]:
    """(prompt_ids, completion_ids + eos) for rows with ``prompt`` and ``completion``. With
    ``mask_spans`` ((start, end) marker pairs), a completion holding such a span is encoded
    piece by piece, each span alone (as the turn loop tokenises an observation), and its
    tokens get no loss (:class:`MaskedIds`). A completion given as chat messages (assistant
    turns and the ``tool`` messages answering them) is laid out as the turn loop samples it,
    loss on the assistant's turns only (grpo_core/contracts/conversation.py). A row with
    ``completion_ids`` (a rejection-sampled episode: ``prompt_ids``, ``completion_ids`` and
    ``loss_mask``) is trained as it was sampled, those ids and that mask, not re-encoded."""
    out = []
    vocab = len(tokenizer)
    for i, row in enumerate(rows):
        if "prompt" not in row or "completion" not in row:
            raise ValueError(f"SFT row {i}: needs 'prompt' and 'completion', has {sorted(row)}")
        if row.get("completion_ids") is not None:
            out.append(sampled_example(row, i, vocab))
            continue
        text = row["completion"]
        if is_conversation(text):
            try:
                completion = encode_conversation(tokenizer, row["prompt"], text, row.get("tools"))
            except ValueError as e:
                raise ValueError(f"SFT row {i}, field 'completion': {e}") from None
            out.append((row_prompt_ids(tokenizer, row), completion))
            continue
        pieces = split_spans(text, mask_spans) if mask_spans else [(text, 1)]
        if len(pieces) == 1:
            completion = encode_completion(tokenizer, text)
        else:
            completion = MaskedIds()
            completion.mask = []
            for piece, keep in pieces:
                ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
                completion += ids
                completion.mask += [keep] * len(ids)
            completion.append(tokenizer.eos_token_id)
            completion.mask.append(1)
        out.append((row_prompt_ids(tokenizer, row), completion))
    return out


def sampled_example(row: dict, i: int, vocab: int) -> tuple[list[int], MaskedIds]:
    """(prompt_ids, completion_ids with ``loss_mask`` as the mask) of an SFT row that carries
    the ids an episode was sampled as. Raises ``ValueError`` naming the row and the field
    when they are not ids of this tokenizer (``vocab`` tokens) or the mask does not fit."""
    fields = {}
    for name in ("prompt_ids", "completion_ids", "loss_mask"):
        v = row.get(name)
        if not isinstance(v, list) or not all(type(t) is int for t in v):
            raise ValueError(
                f"SFT row {i}, field {name!r}: expected a list of integers (a rejection-sampled "
                f"episode carries prompt_ids, completion_ids and loss_mask), got {v!r:.80}"
            )
        fields[name] = v
    for name in ("prompt_ids", "completion_ids"):
        bad = [t for t in fields[name] if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"SFT row {i}, field {name!r}: id {bad[0]} is not in this tokenizer's "
                f"{vocab} tokens (the episode was sampled with another tokenizer)"
            )
    ids, mask = fields["completion_ids"], fields["loss_mask"]
    if len(mask) != len(ids) or any(m not in (0, 1) for m in mask):
        raise ValueError(
            f"SFT row {i}, field 'loss_mask': expected one 0 or 1 per completion id "
            f"({len(ids)}), got {len(mask)} values"
        )
    if not ids or not any(mask):
        raise ValueError(f"SFT row {i}, field 'completion_ids': no token the model wrote")
    completion = MaskedIds(ids)
    completion.mask = list(mask)
    return list(fields["prompt_ids"]), completion


def split_spans(text: str, spans: tuple) -> list[tuple[str, int]]:
    """``text`` cut into ``(piece, 1)`` and ``(span, 0)`` pieces, a span running from a start
    marker to the first end marker after it (to the text's end when none follows)."""
    if not all(a and b for a, b in spans):
        raise ValueError(f"mask_spans: {[list(s) for s in spans]}: markers must be non-empty")
    pieces, pos = [], 0
    while True:
        hits = [(text.find(a, pos), a, b) for a, b in spans if text.find(a, pos) >= 0]
        if not hits:
            break
        start, _, end_marker = min(hits)
        end = text.find(end_marker, start)
        end = len(text) if end < 0 else end + len(end_marker)
        if start > pos:
            pieces.append((text[pos:start], 1))
        pieces.append((text[start:end], 0))
        pos = end
    if pos < len(text) or not pieces:
        pieces.append((text[pos:], 1))
    return pieces

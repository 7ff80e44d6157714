"""Format rewards: the R1 template, tag counting (partial credit), language consistency."""

from __future__ import annotations

import re
import unicodedata
from typing import Any

from grpo_core.rewards.base import completion_text, register

TAGS = ("<think>", "</think>", "<answer>", "</answer>")

_R1_TEMPLATE = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


def is_r1_format(text: str) -> bool:
    """``<think>...</think><answer>...</answer>``, whitespace allowed around and between the
    two blocks, and each of the four tags exactly once (so a second ``<answer>`` block or a
    stray ``<think>`` inside the answer fails)."""
    return bool(_R1_TEMPLATE.match(text)) and all(text.count(t) == 1 for t in TAGS)


@register("format")
def format_reward(prompts: list, completions: list, **_: Any) -> list[float]:
    """1.0 iff the completion follows the R1 template exactly (see ``is_r1_format``)."""
    return [1.0 if is_r1_format(completion_text(c)) else 0.0 for c in completions]


@register("tag_count")
def tag_count_reward(prompts: list, completions: list, **_: Any) -> list[float]:
    """Partial credit, 0.25 per tag of ``<think> </think> <answer> </answer>`` present exactly
    once (open-r1's ``tag_count_reward`` without its newline requirements)."""
    out = []
    for c in completions:
        text = completion_text(c)
        out.append(sum(0.25 for t in TAGS if text.count(t) == 1))
    return out


# Script of a character, from its Unicode name's first word (stdlib only, no regex module).
_SCRIPT_ALIASES = {
    "en": "LATIN", "fr": "LATIN", "de": "LATIN", "es": "LATIN", "it": "LATIN", "pt": "LATIN",
    "latin": "LATIN", "zh": "CJK", "cjk": "CJK", "chinese": "CJK", "ja": "JAPANESE",
    "ru": "CYRILLIC", "cyrillic": "CYRILLIC", "ar": "ARABIC", "arabic": "ARABIC",
    "el": "GREEK", "greek": "GREEK", "he": "HEBREW", "hebrew": "HEBREW", "ko": "HANGUL",
    "hangul": "HANGUL", "hi": "DEVANAGARI", "devanagari": "DEVANAGARI", "th": "THAI",
}  # fmt: skip


def _char_script(ch: str) -> str | None:
    """Script family of a letter, or ``None`` for non-letters (digits, punctuation, math)."""
    if not unicodedata.category(ch).startswith("L"):
        return None
    name = unicodedata.name(ch, "")
    if name.startswith(("CJK", "KANGXI")):
        return "CJK"
    if name.startswith(("HIRAGANA", "KATAKANA")):
        return "KANA"
    first = name.split(" ", 1)[0]
    return first or None


def script_share(text: str, script: str) -> float | None:
    """Share of the letters of ``text`` written in ``script`` (``None`` if no letters)."""
    target = _SCRIPT_ALIASES.get(script.lower(), script.upper())
    wanted = {"CJK", "KANA"} if target == "JAPANESE" else {target}
    letters = [s for ch in text if (s := _char_script(ch)) is not None]
    if not letters:
        return None
    if target == "LATIN":  # fullwidth Latin counts as Latin
        return sum(s in ("LATIN", "FULLWIDTH") for s in letters) / len(letters)
    return sum(s in wanted for s in letters) / len(letters)


@register("language_consistency")
def language_consistency_reward(
    prompts: list, completions: list, language: list | None = None, **_: Any
) -> list[float | None]:
    """DeepSeek-R1's language-consistency reward: the share of the reasoning's letters (the
    ``<think>`` block, else the whole completion) written in the target script.

    The target comes from a ``language`` column (ISO code like ``"en"``, ``"zh"``, or a script
    name like ``"latin"``); without the column it is Latin. ``None`` when the reasoning has no
    letters at all (nothing to judge).
    """
    out: list[float | None] = []
    for i, c in enumerate(completions):
        text = completion_text(c)
        start, end = text.find("<think>"), text.find("</think>")
        if start >= 0:
            text = text[start + 7 : end if end > start else len(text)]
        target = (language[i] if language is not None else None) or "latin"
        out.append(script_share(text, str(target)))
    return out

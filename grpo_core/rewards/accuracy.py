"""Answer-checking rewards: ``accuracy`` (``<answer>`` tag) and ``math_verify`` (``\\boxed{}``).

Both compare the extracted answer with the row's gold ``answer`` column:
1. equal strings after stripping whitespace (and a surrounding ``$...$``): correct;
2. both parse as numbers (``42``, ``-3.5``, ``1,000``, ``3/4``, ``1e-3``): equal as exact
   fractions, or within ``rel_tol=1e-6`` when either is not an integer;
3. otherwise, when the ``math-verify`` package is installed, its LaTeX-aware ``verify``
   (fractions, sets, intervals, units, ...).
They return 1.0 (correct), 0.0 (wrong or no answer found), or ``None`` when the gold answer is
missing or unusable (None, NaN, empty, or unparseable by every method), so that the row does
not count in the weighted sum (TRL's convention).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

from grpo_core.contracts.text import extract_boxed
from grpo_core.rewards import mathverify
from grpo_core.rewards.base import Scores, completion_text, register

REL_TOL = 1e-6
ABS_TOL = 1e-9

MAX_EXPONENT = mathverify.MAX_DIGITS  # 1e<more> is not computed as an exact number
_EXPONENT_RE = re.compile(r"[eE]([+-]?\d+)$")
_NUMBER_RE = re.compile(
    r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?(?:[eE][+-]?\d+)?"
    r"|[+-]?\.\d+(?:[eE][+-]?\d+)?"
    r"|[+-]?\d+\s*/\s*\d+"
)


def extract_tag(text: str, tag: str = "answer") -> str | None:
    """Content of the LAST complete ``<tag>...</tag>`` in ``text`` (stripped), else ``None``.

    For ``"<answer>a<answer>b</answer>"`` this is ``"b"``: the innermost opening tag before
    the last closing one. An unterminated tag gives ``None``.
    """
    close = text.rfind(f"</{tag}>")
    if close < 0:
        return None
    start = text.rfind(f"<{tag}>", 0, close)
    if start < 0:
        return None
    return text[start + len(tag) + 2 : close].strip()


def parse_number(s: str) -> Fraction | None:
    """``s`` as an exact number if the whole string is one number, else ``None``."""
    s = s.strip().strip("$").strip()
    if s.startswith("\\(") and s.endswith("\\)"):
        s = s[2:-2].strip()
    if not _NUMBER_RE.fullmatch(s):
        return None
    exponent = _EXPONENT_RE.search(s)
    if exponent and abs(int(exponent.group(1))) > MAX_EXPONENT:
        return None  # Fraction("1e999999999") computes a billion-digit integer
    try:
        return Fraction(s.replace(",", "").replace(" ", ""))
    except (ValueError, ZeroDivisionError):
        return None


def numbers_equal(a: Fraction, b: Fraction) -> bool:
    if a == b:
        return True
    if a.denominator == 1 and b.denominator == 1:
        return False  # integers compare exactly: 1000000 != 1000001
    return math.isclose(float(a), float(b), rel_tol=REL_TOL, abs_tol=ABS_TOL)


def gold_text(gold: Any) -> str | None:
    """The usable gold answer as a string, or ``None`` (missing, NaN, empty).

    GSM8K-style golds (``"...#### 42"``), ``<answer>`` tags and ``\\boxed{}`` are unwrapped.
    """
    if gold is None or isinstance(gold, bool):
        return None if gold is None else str(gold)
    if isinstance(gold, float):
        if not math.isfinite(gold):
            return None
        return repr(gold)
    if isinstance(gold, bytes | bytearray):
        gold = bytes(gold).decode("utf-8", errors="replace")
    if not isinstance(gold, str):
        gold = str(gold)
    if "####" in gold:
        gold = gold.rsplit("####", 1)[1]
    gold = extract_tag(gold) or extract_boxed(gold) or gold
    gold = gold.strip()
    return gold or None


def _normalise(s: str) -> str:
    s = s.strip()
    if len(s) >= 2 and s.startswith("$") and s.endswith("$"):
        s = s.strip("$").strip()
    return s


def answers_match(pred: str, gold: str) -> bool:
    """Whether ``pred`` matches ``gold`` (rules 1-3 of the module docstring).

    Always ``True`` or ``False``: a gold that no rule can interpret still compares as a plain
    string. A missing or unusable gold is caught earlier, by :func:`gold_text` in ``_score``,
    which then returns ``None``.
    """
    p, g = _normalise(pred), _normalise(gold)
    if p == g:
        return True
    gnum = parse_number(g)
    if gnum is not None:
        pnum = parse_number(p)
        if pnum is not None:
            return numbers_equal(pnum, gnum)
    verdict = mathverify.verify(p, g)  # raises CheckFailed past its bounds
    if verdict is not None:
        return verdict
    # math-verify absent or gold unparseable by it: plain strings still compare as strings
    return False


def _score(pred: str | None, gold: Any, *, gold_required_parse: bool) -> float | None:
    g = gold_text(gold)
    if g is None:
        return None
    if gold_required_parse and parse_number(g) is None and not mathverify.parses(g):
        return None
    if pred is None or not pred.strip():
        return 0.0
    boxed = extract_boxed(pred)
    if boxed is not None:
        pred = boxed
    return 1.0 if answers_match(pred, g) else 0.0


def _scores(preds: list[str | None], golds: list, *, gold_required_parse: bool) -> Scores:
    """:func:`_score` of each row; a row whose answer math-verify could not check within its
    bounds (grpo_core/rewards/mathverify.py) scores 0.0 with the reason as its error."""
    values, errors = [], []
    for pred, gold in zip(preds, golds, strict=True):
        try:
            values.append(_score(pred, gold, gold_required_parse=gold_required_parse))
            errors.append(None)
        except mathverify.CheckFailed as e:
            values.append(0.0)
            errors.append(f"CheckFailed: {e}")
    return Scores(values, errors)


def boxed_or_tag(text: str) -> str | None:
    """``math_verify``'s answer: the last ``\\boxed{}``, else the last ``<answer>`` tag."""
    found = extract_boxed(text)
    return found if found is not None else extract_tag(text)


@register("accuracy", columns=("answer",), extract_answer=extract_tag)
def accuracy(
    prompts: list, completions: list, answer: list | None = None, **_: Any
) -> list[float | None]:
    """1.0 if the last ``<answer>...</answer>`` equals the gold ``answer`` (string, number,
    or math-verify equivalence), 0.0 if wrong or absent, None if the gold is unusable."""
    if answer is None:
        raise ValueError("reward 'accuracy' needs an 'answer' column")
    preds = [extract_tag(completion_text(c)) for c in completions]
    return _scores(preds, list(answer), gold_required_parse=False)


@register("math_verify", columns=("answer",), extract_answer=boxed_or_tag)
def math_verify_reward(
    prompts: list, completions: list, answer: list | None = None, **_: Any
) -> list[float | None]:
    """Math answer check: the last ``\\boxed{}`` of the completion (else its last
    ``<answer>`` tag) against the gold ``answer``. ``None`` when the gold parses neither as a
    number nor (with math-verify installed) as LaTeX/math."""
    if answer is None:
        raise ValueError("reward 'math_verify' needs an 'answer' column")
    preds = [boxed_or_tag(completion_text(c)) for c in completions]
    return _scores(preds, list(answer), gold_required_parse=True)

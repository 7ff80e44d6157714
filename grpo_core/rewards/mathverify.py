"""Optional bridge to Hugging Face ``math-verify`` (LaTeX-aware answer equivalence).

``math-verify`` guards parsing with ``signal.alarm``, which only works in the main thread;
elsewhere (a thread pool, an async executor) it is called without its timeout. When the
package is not installed, ``available()`` is False and ``verify`` returns ``None`` so callers
fall back to string/numeric comparison.
"""

from __future__ import annotations

import importlib.util
import re
import threading
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def _module() -> Any:
    """math_verify, imported on first use (it pulls in sympy: ~0.6 s), or None if absent."""
    try:  # optional dependency: pip install math-verify
        import math_verify
    except ImportError:  # pragma: no cover - exercised only where math-verify is absent
        return None
    return math_verify


TIMEOUT_S = 5
_MAX_CHARS = 2_000  # LaTeX longer than this is not an answer; don't feed it to sympy


def available() -> bool:
    return importlib.util.find_spec("math_verify") is not None


def _timeout() -> int | None:
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


# Two or more plain words ("the answer is 5"): prose, parse as text, not as one formula.
_PROSE = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}\s+[A-Za-z]{2,}")
# A bare word ("Paris", "ab"): not math; as LaTeX it would be a commutative product of symbols.
_WORD = re.compile(r"\s*[A-Za-z]{2,}\s*")


@lru_cache(maxsize=4096)
def _parse(s: str) -> tuple[Any, ...]:
    mv = _module()
    if mv is None or not s or len(s) > _MAX_CHARS or _WORD.fullmatch(s):
        return ()
    as_text = "$" in s or "\\boxed" in s or bool(_PROSE.search(s))
    attempts = [s, f"${s}$"] if as_text else [f"${s}$", s]
    for attempt in attempts:
        try:
            out = mv.parse(attempt, parsing_timeout=_timeout())
        except Exception:  # math-verify raises on pathological input; treat as unparseable
            out = []
        if out:
            return tuple(out)
    return ()


def parses(s: str) -> bool:
    """Whether math-verify extracts something from ``s`` (False when not installed)."""
    return bool(_parse(s))


def verify(pred: str, gold: str) -> bool | None:
    """``True``/``False`` by math-verify, ``None`` if it is absent or ``gold`` does not parse."""
    mv = _module()
    if mv is None:
        return None
    g = _parse(gold)
    if not g:
        return None
    p = _parse(pred)
    if not p:
        return False
    try:
        return bool(mv.verify(list(g), list(p), timeout_seconds=_timeout()))
    except Exception:
        return False

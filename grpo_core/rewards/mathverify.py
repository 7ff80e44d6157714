"""Optional bridge to Hugging Face ``math-verify`` (LaTeX-aware answer equivalence).

``math-verify`` guards parsing with a wall-clock ``signal.alarm``: on a busy machine it fired
and scored a right answer 0 (and once went off later, inside an unrelated ``__del__``), so a
reward depended on the load and a resumed run could differ. Here it is called without its
own timeout, under a budget of this process's CPU time instead (:func:`cpu_budget`,
``ITIMER_PROF``: what the parse itself computes, not how long the machine kept it waiting),
in the main thread; elsewhere (a thread pool, an async executor) a timer cannot be armed,
and the input's length bound (``_MAX_CHARS``) is the guard. When the package is not
installed, ``available()`` is False and ``verify`` returns ``None`` so callers fall back to
string/numeric comparison.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
import signal
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
    # it warns once that its own timeout is off and the caller must bound the work:
    # cpu_budget does (its flags, if this version has them, say the warning was shown)
    for part in ("parser", "grader"):
        module = getattr(math_verify, part, None)
        if module is not None and hasattr(module, "TIMEOUT_WARNING_SHOWN"):
            module.TIMEOUT_WARNING_SHOWN = True
    return math_verify


CPU_BUDGET_S = 5.0  # CPU seconds of one parse or comparison
_MAX_CHARS = 2_000  # LaTeX longer than this is not an answer; don't feed it to sympy


class OverBudget(Exception):
    """A parse or comparison used up its CPU budget."""


def available() -> bool:
    return importlib.util.find_spec("math_verify") is not None


@contextlib.contextmanager
def cpu_budget(seconds: float = CPU_BUDGET_S):
    """Raise :class:`OverBudget` inside the block once this process has spent ``seconds`` of
    CPU time in it (``ITIMER_PROF``; main thread only: elsewhere the block runs unguarded).
    Time the process spends waiting (a loaded machine, a sleep) does not count. The timer
    and the previous handler are restored on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def over(signum, frame):
        raise OverBudget(f"over {seconds} s of CPU time")

    previous = signal.signal(signal.SIGPROF, over)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


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
            with cpu_budget():
                out = mv.parse(attempt, parsing_timeout=None)
        except Exception:  # pathological input (or over budget): treat as unparseable
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
        with cpu_budget():
            return bool(mv.verify(list(g), list(p), timeout_seconds=None))
    except Exception:
        return False

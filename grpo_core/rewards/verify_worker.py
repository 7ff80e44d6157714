"""The child process that runs math-verify's parses and comparisons (grpo_core/rewards/mathverify.py).

sympy can spend unbounded time in C (``9^{9^{9^{9}}}`` compared with ``5`` is a big-integer
power no Python-level signal interrupts), so the work runs here, under hard limits of its own:

- a CPU budget per request in two layers: ``cpu_budget`` (``SIGPROF``) raises
  :class:`~grpo_core.rewards.mathverify.OverBudget` between bytecodes, and ``RLIMIT_CPU``,
  raised to the CPU time used so far plus the request's budget (and a second), has the kernel
  kill the process if it is stuck in C; the parent then reports the request as over budget
  and starts another child on the next request;
- an address-space cap (``RLIMIT_AS``), so a huge integer is a ``MemoryError``, not the host's
  memory; no core file.

Protocol: one JSON object per line on stdin, ``{"op": "parses", "s": ...}`` or
``{"op": "verify", "pred": ..., "gold": ...}`` with ``"budget"`` (CPU seconds of each parse or
comparison); one line back, ``{"ok": value}`` or ``{"error": "..."}``. Ends at EOF (the parent
is gone).
"""

from __future__ import annotations

import json
import math
import re
import resource
import sys
from functools import lru_cache
from typing import Any

from grpo_core.rewards.mathverify import OverBudget, cpu_budget, load_module

# Two or more plain words ("the answer is 5"): prose, parse as text, not as one formula.
_PROSE = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}\s+[A-Za-z]{2,}")
# A bare word ("Paris", "ab"): not math; as LaTeX it would be a commutative product of symbols.
_WORD = re.compile(r"\s*[A-Za-z]{2,}\s*")


def parse(mv, s: str, budget: float) -> tuple[Any, ...]:
    return _parse(mv, s, budget)


@lru_cache(maxsize=4096)
def _parse(mv, s: str, budget: float) -> tuple[Any, ...]:
    if not s or _WORD.fullmatch(s):
        return ()
    as_text = "$" in s or "\\boxed" in s or bool(_PROSE.search(s))
    attempts = [s, f"${s}$"] if as_text else [f"${s}$", s]
    for attempt in attempts:
        try:
            with cpu_budget(budget):
                out = mv.parse(attempt, parsing_timeout=None)
        except Exception:  # pathological input: unparseable (over budget propagates)
            out = []
        if out:
            return tuple(out)
    return ()


def verify(mv, pred: str, gold: str, budget: float) -> bool | None:
    """True/False, or None when ``gold`` does not parse."""
    g = parse(mv, gold, budget)
    if not g:
        return None
    p = parse(mv, pred, budget)
    if not p:
        return False
    try:
        with cpu_budget(budget):
            return bool(mv.verify(list(g), list(p), timeout_seconds=None))
    except Exception:
        return False


def answer(mv, req: dict) -> dict:
    budget = float(req["budget"])
    usage = resource.getrusage(resource.RUSAGE_SELF)
    used = usage.ru_utime + usage.ru_stime
    # three budgets at most (two parses and a comparison), then the kernel's SIGXCPU
    limit = math.ceil(used + 3 * budget) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (limit, resource.RLIM_INFINITY))
    try:
        if req["op"] == "parses":
            return {"ok": bool(parse(mv, req["s"], budget))}
        return {"ok": verify(mv, req["pred"], req["gold"], budget)}
    except OverBudget as e:
        return {"error": f"math-verify went {e}"}
    except MemoryError:
        return {"error": "math-verify ran out of its memory cap (a number too large to hold)"}
    except RecursionError:
        return {"error": "math-verify recursed too deep (an expression nested too deeply)"}


def main() -> None:
    memory = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if memory:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    # The replies own stdout: anything the library prints goes to stderr, so a print inside
    # sympy or math-verify cannot break a reply line.
    replies = sys.stdout
    sys.stdout = sys.stderr
    mv = load_module()
    for line in sys.stdin:
        out = answer(mv, json.loads(line))
        replies.write(json.dumps(out) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()

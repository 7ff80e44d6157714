"""Optional bridge to Hugging Face ``math-verify`` (LaTeX-aware answer equivalence), bounded.

A policy can write an answer that sympy cannot finish: ``9^{9^{9^{9}}}`` compared with ``5``
is a big-integer power computed in C, which no signal handler interrupts, and it hung the
scoring stage. So every parse and comparison runs in a child process
(grpo_core/rewards/verify_worker.py) under a hard CPU limit the kernel enforces, a memory cap
and a wall-clock backstop; a check that goes over is killed, its row scores 0 with the reason
as the reward's error (:class:`CheckFailed`), and the next check starts a new child. Numeric
towers and factorials whose value has more digits than an answer can (:func:`too_costly`)
are refused here before any child sees them.

The budget is CPU time (:func:`cpu_budget`, ``ITIMER_PROF``, and ``RLIMIT_CPU`` behind it),
not wall time: ``math-verify``'s own ``signal.alarm`` fired on a busy machine and scored a
right answer 0, so a reward depended on the load and a resumed run could differ. The parent
waits for its child from any thread (a thread pool, an async executor, Ray), one check at a
time per process. When the package is not installed, ``available()`` is False and
``verify`` returns ``None`` so callers fall back to string/numeric comparison.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import math
import os
import re
import select
import signal
import subprocess
import sys
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any


@lru_cache(maxsize=1)
def load_module() -> Any:
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
MEMORY_CAP = 2 << 30  # the checking child's address space, bytes
WALL_S = 120.0  # a check not answered in this long (a child stopped, not computing) is killed
MAX_DIGITS = 10_000  # a number in an answer with more digits than this is not checked


class OverBudget(BaseException):
    """A parse or comparison used up its CPU budget. A ``BaseException``, so that library
    code catching ``Exception`` cannot swallow it and go on computing."""


class CheckFailed(Exception):
    """An answer math-verify could not check within its bounds (time, memory, size): the
    row scores 0 and this is its error."""


@lru_cache(maxsize=1)
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


_NUMERIC_POWER = re.compile(r"(\d+)((?:\s*\^\s*\{?\s*\d+)+)")
_FACTORIAL = re.compile(r"(\d+)\s*\}?\s*!")
_E_NOTATION = re.compile(r"\d\.?\d*\s*[eE]\s*[+-]?\s*(\d+)")


def too_costly(s: str) -> str | None:
    """Why ``s`` is not worth handing to sympy, or None: a numeric power or tower
    (``9^{9^{9^{9}}}``, ``10^{10^{10}}``, ``2^{10000000}``) or a factorial whose value has
    more than :data:`MAX_DIGITS` digits."""
    for m in _NUMERIC_POWER.finditer(s):
        if _power_digits([m.group(1), *re.findall(r"\d+", m.group(2))]) > MAX_DIGITS:
            return f"{m.group(0).strip()!r} has more than {MAX_DIGITS:,} digits"
    for m in _E_NOTATION.finditer(s):
        if len(m.group(1)) > 6 or int(m.group(1)) > MAX_DIGITS:
            return f"{m.group(0).strip()!r} has more than {MAX_DIGITS:,} digits"
    for m in _FACTORIAL.finditer(s):
        n = m.group(1).lstrip("0")
        if len(n) > 4 or int(n or 0) > 3_000:  # 3000! has about 9,131 digits
            return f"{n}! has more than {MAX_DIGITS:,} digits"
    return None


def _power_digits(nums: list[str]) -> float:
    """Decimal digits of ``nums[0] ^ (nums[1] ^ (... nums[-1]))`` (decimal strings), or
    ``inf`` when the exponent alone is beyond any answer."""
    if any(len(n) > 12 for n in nums[1:]):
        return math.inf
    exponent = int(nums[-1])
    for n in map(int, reversed(nums[1:-1])):
        if n > 1 and exponent * math.log10(n) > 12:
            return math.inf
        exponent = n**exponent if n > 1 else n
    base = nums[0].lstrip("0") or "0"
    if int(base[:15]) <= 1 and len(base) == 1:
        return 1.0
    return exponent * (math.log10(int(base[:15])) + max(0, len(base) - 15))


class _Checker:
    """The child process that runs the checks (grpo_core/rewards/verify_worker.py), started
    on first use and again after one was killed; one request at a time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.pid = 0  # the process that started ``proc`` (a forked copy starts its own)

    def ask(self, request: dict) -> Any:
        with self.lock:
            proc = self._running()
            try:
                proc.stdin.write(json.dumps(request) + "\n")
                proc.stdin.flush()
                line = self._answer(proc)
            except (BrokenPipeError, OSError) as e:
                self._stop()
                raise CheckFailed(f"math-verify's process failed ({e})") from None
        out = json.loads(line)
        if "error" in out:
            raise CheckFailed(out["error"])
        return out["ok"]

    def _answer(self, proc: subprocess.Popen) -> str:
        ready, _, _ = select.select([proc.stdout], [], [], WALL_S)
        if not ready:
            self._stop()
            raise CheckFailed(f"math-verify gave no answer in {WALL_S:g} s (killed)")
        line = proc.stdout.readline()
        if not line:  # killed: by the kernel over its CPU limit, or by something else
            rc = proc.wait()
            self.proc = None
            why = _signal_name(rc)
            raise CheckFailed(
                f"math-verify went over its CPU budget ({why})"
                if why in ("SIGXCPU", "SIGKILL")
                else f"math-verify's process ended ({why})"
            )
        return line

    def _running(self) -> subprocess.Popen:
        if self.proc is not None and self.pid == os.getpid() and self.proc.poll() is None:
            return self.proc
        self.proc = None
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [root, *filter(None, [os.environ.get("PYTHONPATH")])])}  # fmt: skip
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "grpo_core.rewards.verify_worker", str(MEMORY_CAP)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        if self.pid != os.getpid():  # once per process: the child ends with it
            atexit.register(self._stop)
        self.pid = os.getpid()
        return self.proc

    def _stop(self) -> None:
        if self.proc is not None and self.pid == os.getpid():
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def _signal_name(rc: int) -> str:
    if rc < 0:
        try:
            return signal.Signals(-rc).name
        except ValueError:
            return f"signal {-rc}"
    return f"exit {rc}"


_CHECKER = _Checker()


@lru_cache(maxsize=8192)
def _checked(op: str, a: str, b: str = "") -> tuple[Any, str | None]:
    """(result, None) or (None, why it could not be checked); cached both ways, so an answer
    that ran over is not run over again."""
    for s in (a, b):
        why = too_costly(s)
        if why:
            return None, f"answer too costly to check: {why}"
    request = {"op": op, "budget": CPU_BUDGET_S}
    request.update({"s": a} if op == "parses" else {"pred": a, "gold": b})
    try:
        return _CHECKER.ask(request), None
    except CheckFailed as e:
        return None, str(e)


def parses(s: str) -> bool:
    """Whether math-verify extracts something from ``s`` (False when not installed, or when
    ``s`` cannot be parsed within the bounds)."""
    if not available() or not s or len(s) > _MAX_CHARS:
        return False
    ok, _ = _checked("parses", s)
    return bool(ok)


def verify(pred: str, gold: str) -> bool | None:
    """``True``/``False`` by math-verify, ``None`` if it is absent or ``gold`` does not parse.
    Raises :class:`CheckFailed` when the check ran over its bounds (the row scores 0)."""
    if not available():
        return None
    if not gold or len(gold) > _MAX_CHARS:
        return None
    if not pred or len(pred) > _MAX_CHARS:
        return False
    verdict, why = _checked("verify", pred, gold)
    if why is not None:
        raise CheckFailed(why)
    return verdict

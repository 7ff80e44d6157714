"""What one sandboxed run amounts to: :class:`RunResult`, read from the verdict pipe.

The harness (``_harness.py``) writes one JSON record per event, ``[nonce, kind, id, ok,
message]``, to a pipe the scorer holds open; :func:`read_verdict` keeps only the records that
carry this run's nonce, counts only the asserts that exercise the candidate (``credit.py``),
per statement (those never reached, or in a test source that did not run to its end, count
as failed), and turns the launcher's outcome (timeout, signal,
early exit, failed namespace setup) into a status and a one-line error. Exit codes and output
are never trusted for the score.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass, field

_SETUP_FAILED = 125  # _nsinit.py's exit code for a failed namespace setup step


@dataclass
class RunResult:
    """What happened to one program.

    status: "ok" (harness finished), "timeout" (wall clock), "killed" (by a signal: CPU limit,
        memory...), "exited" (ended before the harness finished: early exit, crash).
    passed / total: assert statements that exercise the candidate, passed / counted (one
        passes when it ran and held every time; one that never ran is failed). program_ok:
        the program body ran without raising.
    error: one line for the error column (None when every assert passed).
    """

    status: str
    passed: int = 0
    total: int = 0
    program_ok: bool = False
    error: str | None = None
    returncode: int | None = None
    wall_s: float = 0.0
    stderr_tail: str = ""
    records: list[tuple[str, str, bool, str]] = field(default_factory=list, repr=False)
    output: str = ""  # a tool call's (kind "tool"): what the program printed

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


def _source(ident: str) -> str:
    """The test source an assert id belongs to: ``a3.`` for ``a3.7`` (an ``asserts`` entry),
    ``t`` for ``t5`` (the one source of ``humaneval`` and ``script`` tests)."""
    return ident[: ident.index(".") + 1] if "." in ident else "t"


def ended(rc: int | None, limits) -> tuple[str, str]:
    """``(status, error)`` of a run that ended before its verdict was complete: killed by a
    signal (``rc`` < 0, or 128+N as the launchers relay one), else exited early."""
    if rc is not None and (rc < 0 or rc > 128):
        sig = -rc if rc < 0 else rc - 128
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        hint = {"SIGXCPU": f" (CPU limit {limits.cpu_seconds}s)", "SIGXFSZ": " (file size limit)"}
        return "killed", f"killed by {name}{hint.get(name, '')}"
    return "exited", f"exited with code {rc} before the tests finished"


def read_verdict(raw, nonce, counted, timed_out, rc, wall, tail, limits, payload) -> RunResult:
    records = []
    for line in raw.split(b"\n"):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, list) and len(rec) == 5 and rec[0] == nonce:
            records.append((str(rec[1]), str(rec[2]), rec[3] is True, str(rec[4])))
    kinds = {r[0] for r in records}
    finished = "done" in kinds
    program_ok = any(k == "program" and ok for k, _, ok, _ in records)
    runs: dict[str, list[tuple[bool, str]]] = {}
    for k, ident, ok, message in records:
        if k == "assert" and ident in counted:
            runs.setdefault(ident, []).append((ok, message))
    # credit per assert statement: passed when it ran, every one of its runs passed, and the
    # test source holding it ran to its end (a verdict cut short, by a timeout, a killed or
    # stopped harness, cannot vouch for the runs of a loop it never finished); one that never
    # ran (an empty loop, a crash, a timeout) is a failed statement
    complete = {ident for k, ident, ok, _ in records if k == "source" and ok}
    passed = sum(
        1
        for i in counted
        if runs.get(i) and all(ok for ok, _ in runs[i]) and _source(i) in complete
    )
    total = len(counted)
    never_ran = sum(1 for i in counted if i not in runs)
    tests_error = next((r[3] for r in records if r[0] == "tests" and not r[2]), None)
    gone = next((r[3] for r in records if r[0] == "candidate"), None)
    if gone is not None and finished:  # the candidate process died: say how, as for the run
        finished, rc = False, int(gone) if gone.lstrip("-").isdigit() else rc
    setup_failed = rc == _SETUP_FAILED and "sandbox setup failed" in tail
    if timed_out:
        status, error = "timeout", f"timeout: killed after {limits.wall_seconds:g}s wall clock"
    elif finished:
        status, error = "ok", None
    elif setup_failed:
        status, error = "error", tail.strip().splitlines()[-1][:300]
    else:
        status, error = ended(rc, limits)
    if error is None:
        prog_err = next((r[3] for r in records if r[0] == "program" and not r[2]), None)
        said = [x for x in tail.splitlines() if x.startswith("grpo-candidate: ")]
        if prog_err and said:  # code_runs: the exception the candidate process reported
            prog_err = said[-1].removeprefix("grpo-candidate: ")
        first_fail = next((m for i in counted for ok, m in runs.get(i, ()) if not ok and m), None)
        parts = [f"program raised {prog_err}"] if prog_err else []
        if tests_error:
            parts.append(f"tests raised {tests_error}")
        if passed < total:
            parts.append(
                f"{total - passed}/{total} asserts failed"
                + (f" ({never_ran} never ran)" if never_ran else "")
                + (f": {first_fail}" if first_fail else "")
            )
        if total == 0 and payload.get("kind") not in ("run", "tool"):
            parts.append("no assert of the tests exercises the candidate: nothing to score")
        error = "; ".join(parts) or None
    if error and "MemoryError" in tail and status != "ok":
        error += " (MemoryError)"
    output = next((r[3] for r in records if r[0] == "output"), "")
    return RunResult(status, passed, total, program_ok, error, rc, wall, tail, records, output)

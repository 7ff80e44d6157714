"""Code rewards: run the completion's program against the row's tests in the sandbox.

Program extraction: the last fenced ```python (or ```py / bare ```) block, else the raw
completion. Tests come from the row's columns, first match wins:
- ``test`` + ``entry_point`` (HumanEval): ``test`` defines ``check(candidate)``;
- ``test_list`` (MBPP) or ``tests`` as a list: one assert statement per entry
  (``test_setup_code`` runs first when present);
- ``test`` or ``tests`` as a string without ``entry_point``: a script of asserts.
``code_tests`` gives partial credit: the fraction of the executions of the asserts that
exercise the candidate (``credit.py``) that passed.

``code_tests`` and ``code_runs`` execute the program: they run in the sandbox's isolation
(``sandbox_isolation=`` keyword, else ``$GRPO_SANDBOX_ISOLATION``, else ``"auto"``) and raise
``SandboxUnavailable`` (naming the fix) when it cannot isolate, rather than run unisolated.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from grpo_core.rewards.base import REWARDS, Scores, completion_text, executing, register
from grpo_core.sandbox import Limits, RunResult, run_program
from grpo_core.sandbox.isolation import SandboxUnavailable, detect_isolation, requested_isolation

_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


def extract_program(completion: Any) -> str:
    """The last fenced python block of the completion (unterminated last fence included),
    else the last bare fenced block, else the raw text."""
    text = completion_text(completion)
    blocks = [(m.group(1), m.group(2)) for m in _FENCE.finditer(text)]
    python = [b for lang, b in blocks if lang]
    if python:
        return python[-1]
    if blocks:
        return blocks[-1][1]
    return text


def default_workers() -> int:
    """Concurrent sandboxes: one per CPU this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


def test_spec(row: dict[str, Any]) -> dict[str, Any] | None:
    """``run_program`` keyword arguments for one row's tests, or None if it has none."""
    entry = row.get("entry_point")
    test = row.get("test")
    listed = row.get("test_list")
    if listed is None and not isinstance(row.get("tests"), str):
        listed = row.get("tests")
    setup = row.get("test_setup_code") or ""
    if isinstance(test, str) and test.strip() and entry:
        return {"kind": "humaneval", "tests": test, "entry_point": str(entry), "setup": setup}
    if listed is not None and not isinstance(listed, str) and len(listed):
        return {"kind": "asserts", "tests": [str(t) for t in listed], "setup": setup}
    script = test if isinstance(test, str) else row.get("tests")
    if isinstance(script, str) and script.strip():
        return {"kind": "script", "tests": script, "setup": setup}
    return None


def run_many(
    jobs: Sequence[dict[str, Any]],
    *,
    limits: Limits | None = None,
    workers: int | None = None,
    progress: bool | None = None,
    isolation: str | None = None,
) -> list[RunResult]:
    """Run ``run_program(**job)`` for every job, ``workers`` sandboxes at a time (default:
    one per CPU; each sandbox is its own process, the pool only waits on them), with a tqdm
    progress bar (``progress=None``: only on a terminal). The isolation is resolved first:
    :class:`SandboxUnavailable` stops the batch before any program runs."""
    from tqdm.auto import tqdm

    workers = workers or default_workers()
    if jobs:
        detect_isolation(isolation)

    def one(job: dict[str, Any]) -> RunResult:
        try:
            return run_program(**job, limits=limits, isolation=isolation)
        except SandboxUnavailable:
            raise
        except Exception as exc:  # a harness failure is this program's error, not the batch's
            return RunResult("error", error=f"sandbox error: {type(exc).__name__}: {exc}")

    results: list[RunResult] = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        bar = tqdm(
            total=len(jobs),
            desc="sandbox",
            unit="prog",
            disable=None if progress is None else not progress,
        )
        for res in pool.map(one, jobs):
            results.append(res)
            bar.update(1)
        bar.close()
    return results


_OPTIONS = {
    "sandbox_limits": "limits",
    "sandbox_workers": "workers",
    "sandbox_isolation": "isolation",
    "sandbox_progress": "progress",
}


def _rows(n: int, columns: dict[str, Any]) -> list[dict[str, Any]]:
    """Per-row dicts of the list-like columns (TRL also passes scalars like trainer_state)."""
    cols = {
        k: v
        for k, v in columns.items()
        if k not in _OPTIONS
        and not isinstance(v, str | bytes | dict)
        and hasattr(v, "__len__")
        and len(v) == n
    }
    return [{k: v[i] for k, v in cols.items()} for i in range(n)]


def _sandbox_reward(
    completions: Sequence[Any],
    columns: dict[str, Any],
    score: Callable[[RunResult], float],
    *,
    need_tests: bool,
) -> list[float | None]:
    """Sandbox options come as keyword arguments, not columns: ``sandbox_limits=Limits(...)``,
    ``sandbox_workers=N``, ``sandbox_isolation="auto"|"bwrap"|"namespaces"|"none"``,
    ``sandbox_progress=bool``."""
    opts = {name: columns[key] for key, name in _OPTIONS.items() if columns.get(key) is not None}
    jobs, where = [], []
    out = Scores([None] * len(completions))
    for i, row in enumerate(_rows(len(completions), columns)):
        spec = test_spec(row) if need_tests else {"kind": "run"}
        if spec is None:
            continue  # no tests for this row: not applicable
        jobs.append({"program": extract_program(completions[i]), **spec})
        where.append(i)
    for i, res in zip(where, run_many(jobs, **opts), strict=True):
        out[i] = score(res)
        out.errors[i] = res.error
    return out


def sandboxed(names, isolation: str | None = None, **options: Any) -> dict[str, Callable]:
    """The executing rewards among ``names`` (registered with ``executes``: ``code_tests``,
    ``code_runs``), bound to ``isolation`` and the other ``sandbox_<option>`` keywords
    (``limits=``, ``workers=``, ``progress=``): pass them as
    ``score_completions(functions=...)``. The isolation is
    resolved here, so a machine that cannot isolate fails before scoring starts (raises
    :class:`SandboxUnavailable`); ``{}`` when no executing reward is named."""
    wanted = executing(names)
    if not wanted:
        return {}
    detect_isolation(isolation)
    kwargs = {f"sandbox_{k}": v for k, v in {"isolation": isolation, **options}.items()}
    out = {}
    for name in wanted:
        fn = REWARDS.get(name)
        out[name] = functools.partial(fn, **kwargs)
    return out


def isolation_label(names, isolation: str | None = None) -> str | None:
    """``"<mode> (...; requested <name>)"`` of the sandbox that executing rewards among
    ``names`` run in (for logs and metadata), None when none of them executes code."""
    if not executing(names):
        return None
    return detect_isolation(isolation).describe()


def sandbox_params(names, isolation: str | None = None) -> dict[str, str]:
    """The sandbox as a stage's parameters: ``isolation`` (as requested: argument, else
    ``$GRPO_SANDBOX_ISOLATION``, else ``auto``) and ``mode`` (what runs the programs, resolved
    now when an executing reward is among ``names``: raises :class:`SandboxUnavailable` at the
    stage's start on a machine that cannot isolate; ``"unused"`` otherwise)."""
    return {
        "isolation": requested_isolation(isolation),
        "mode": isolation_label(names, isolation) or "unused",
    }


@register("code_tests", executes=True, any_of=("test", "test_list", "tests"))
def code_tests(prompts: list, completions: list, **columns: Any) -> list[float | None]:
    """Fraction of the row's asserts the program passes (asserts not reached because of a
    timeout, crash or early exit count as failed), ``None`` for rows without tests."""
    return _sandbox_reward(completions, columns, _fraction, need_tests=True)


def _fraction(res: RunResult) -> float:
    return res.fraction  # unrun asserts already count as failed when the run did not finish


def _ran(res: RunResult) -> float:
    return float(res.status == "ok" and res.program_ok)


@register("code_runs", executes=True)
def code_runs(prompts: list, completions: list, **columns: Any) -> list[float | None]:
    """1.0 if the program runs to completion in the sandbox without raising, else 0.0."""
    return _sandbox_reward(completions, columns, _ran, need_tests=False)


def compiles(program: str) -> bool:
    try:
        compile(program, "<program>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return False
    return True


@register("code_compiles")
def code_compiles(prompts: list, completions: list, **_: Any) -> list[float]:
    """1.0 if the extracted program compiles (nothing is executed), else 0.0."""
    return [float(compiles(extract_program(c))) for c in completions]


@register("code_ruff_clean")
def code_ruff_clean(prompts: list, completions: list, **_: Any) -> list[float | None]:
    """1.0 if ``ruff check`` (default rules: pyflakes F + pycodestyle E4/E7/E9) reports no
    error in the program, else 0.0; ``None`` when ruff is not installed. Ruff parses, it
    never executes the code."""
    ruff = shutil.which("ruff")
    if ruff is None:
        return [None] * len(completions)
    with tempfile.TemporaryDirectory(prefix="grpo-ruff-") as tmp:
        paths = []
        for i, c in enumerate(completions):
            path = Path(tmp) / f"p{i}.py"
            path.write_text(extract_program(c), encoding="utf-8", errors="replace")
            paths.append(path)
        proc = subprocess.run(
            [ruff, "check", "--isolated", "--no-cache", "--output-format", "concise", "--quiet", tmp],
            capture_output=True, text=True, timeout=120, cwd=tmp,
        )  # fmt: skip
        flagged = {
            Path(line.split(":", 1)[0]).name for line in proc.stdout.splitlines() if ":" in line
        }
    return [0.0 if p.name in flagged else 1.0 for p in paths]


def has_real_assert(program: str) -> bool:
    """True if the code contains an ``assert`` (or a unittest ``self.assert*``/``pytest.raises``
    call) whose condition is not a constant (``assert True`` does not count)."""
    try:
        tree = ast.parse(program)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert) and not isinstance(node.test, ast.Constant):
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = node.func.attr
            is_check = (name.startswith("assert") and name != "assert_") or name == "raises"
            if is_check and node.args and not all(isinstance(a, ast.Constant) for a in node.args):
                return True
    return False


@register("test_has_assert")
def test_has_assert(prompts: list, completions: list, **_: Any) -> list[float]:
    """For test-writing tasks: 1.0 if the written test asserts something, else 0.0 (a test
    without assert passes against any implementation: the seed's reward hack)."""
    return [float(has_real_assert(extract_program(c))) for c in completions]

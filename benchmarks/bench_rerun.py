"""Cached reruns: wall time of `grpo run` the first time, then unchanged, then with only the
reward weights changed, each as a fresh `grpo` process (what a user types).

    python benchmarks/bench_rerun.py [--reruns 3] [--workdir DIR] [--set KEY=VALUE ...]

The goal (issue #6): an unchanged rerun takes under 10% of the first run's wall time, and a
reward-weight change reuses the cold-start SFT and the first RL iteration's rollouts. Each
run's own log says what it reused; this script counts those lines. Prints a Markdown table.
Run it on a quiet machine: everything here is wall-clock time.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench_common import timed_cli  # noqa: E402 (puts this checkout on the path too)

from flows.config import STAGE_NAMES  # noqa: E402

REWARDS = "rewards={accuracy: 1.0, format: 0.2}"  # demo default: {accuracy: 1.0, format: 0.1}


def grpo_run(workdir: Path, sets: list[str], log: Path) -> tuple[float, str]:
    return timed_cli(workdir, ["run"], sets, log)


def reused(log: str) -> str:
    """What the run's log says it reused ("<label>: inputs unchanged ...")."""
    labels = re.findall(r" - ([^|]+?): inputs unchanged", log)
    parts = [x for x in labels if x in STAGE_NAMES]  # whole stages (RL reuses per iteration)
    for stage, a, b in re.findall(r"(rl_\d): (\d+) of (\d+) iterations reused", log):
        parts.append(f"{stage} {a}/{b} iterations")
    steps = [x for x in labels if re.fullmatch(r"rl_\d iteration \d+ \w+", x)]
    if 0 < len(steps) <= 3:  # a partial reuse: name the steps
        parts += steps
    rl_evals = sum(bool(re.fullmatch(r"rl_\d it\d+ eval", x)) for x in labels)
    final_evals = sum(x.startswith("eval ") for x in labels)
    parts += [f"{rl_evals} RL evals"] if rl_evals else []
    parts += [f"{final_evals} final evals"] if final_evals else []
    return ", ".join(parts) or "nothing"


def flow_seconds(log: str) -> str:
    m = re.search(r"total time (\d+)s", log)
    return m.group(1) if m else "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reruns", type=int, default=3)
    ap.add_argument("--workdir", help="where runs/ and mlflow.db go (default: a temp dir)")
    ap.add_argument("--set", action="append", default=[], help="extra overrides for every run")
    args = ap.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-rerun-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    first, log = grpo_run(workdir, args.set, workdir / "first.log")
    rows.append(("first run", first, flow_seconds(log), reused(log)))
    print(f"first run: {first:.1f} s", file=sys.stderr)
    for i in range(args.reruns):
        wall, log = grpo_run(workdir, args.set, workdir / f"rerun{i}.log")
        rows.append((f"unchanged rerun {i + 1}", wall, flow_seconds(log), reused(log)))
        print(f"rerun {i + 1}: {wall:.1f} s", file=sys.stderr)
    wall, log = grpo_run(workdir, [*args.set, REWARDS], workdir / "rewards.log")
    rows.append(("reward weights changed", wall, flow_seconds(log), reused(log)))

    print(f"\n`grpo run` in {workdir} (logs there)\n")
    print("| run | wall s | flow s | % of first | reused |")
    print("|---|---|---|---|---|")
    for name, wall, flow_s, what in rows:
        print(f"| {name} | {wall:.1f} | {flow_s} | {100 * wall / first:.1f}% | {what} |")
    reruns = sorted(r[1] for r in rows[1 : 1 + args.reruns])
    if reruns:
        median = reruns[len(reruns) // 2]
        print(
            f"\nunchanged rerun median: {median:.1f} s = {100 * median / first:.1f}% of the first run"
        )


if __name__ == "__main__":
    main()

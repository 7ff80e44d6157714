"""Iteration time of the demo's RL stage (rl_1) in one process vs on Ray with 1 and 2 workers
per role, each a fresh `grpo run` process driven through the config (what a user types).

    python benchmarks/bench_cluster.py [--iterations 4] [--workdir DIR] [--set KEY=VALUE ...]

Every setting is `grpo run --force rl_1` in one working directory on a tiny budget (short
cold-start SFT, `--iterations` RL iterations of the demo's 32 prompts x 8 completions, one
rl_2 iteration, small evals), so the first run trains the SFT stages and the others reuse
them. The Ray settings are `cluster.backend=ray` with a local Ray started by the run and
`cluster.{rollout,trainer,scoring}.workers` = 1 or 2 at 0.5 CPU each: whichever roles the
code puts on Ray take those workers. Times come from each run's own log (the time stamps of
the rollout, score and update lines of every iteration). Prints a Markdown table; run it on a
quiet machine, everything is wall-clock time.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench_common import timed_cli  # noqa: E402

ROLES = ("rollout", "trainer", "scoring")
BUDGET = [
    "sft.max_steps=40",
    "sft.min_steps=0",
    "sft.target_accuracy=null",
    "rl.eval_every=1000",  # held-out eval at the stage's end only (not inside an iteration)
    "rl_2.iterations=1",
    "rejection_sampling.num_prompts=16",
    "rejection_sampling.require=[format]",  # the short SFT solves no problem yet
    "re_sft.max_steps=1",
    "eval.num_examples=16",
]
STAMP = r"(\d\d):(\d\d):(\d\d\.\d+) \| INFO\s*\| .*? - "


def settings(ray_cpus: int) -> dict[str, list[str]]:
    out = {"local (one process)": []}
    for n in (1, 2):
        ray = ["cluster.backend=ray", f"cluster.num_cpus={ray_cpus}"]
        for role in ROLES:
            ray += [f"cluster.{role}.workers={n}", f"cluster.{role}.num_cpus=0.5"]
        out[f"ray, {n} worker(s) per role"] = ray
    return out


def grpo_run(workdir: Path, sets: list[str], log: Path) -> tuple[float, str]:
    env = {"OMP_NUM_THREADS": "1"}
    return timed_cli(workdir, ["run", "--force", "rl_1"], sets, log, env)


def _seconds(h: str, m: str, s: str) -> float:
    return int(h) * 3600 + int(m) * 60 + float(s)


def iteration_times(log: str, stage: str = "rl_1") -> dict:
    """From the log's time stamps: the first iteration (from the stage's start line, so it
    includes starting workers), the later iterations (end of update to end of update), the
    update task (end of scoring to end of update) and the optimizer steps alone."""

    def stamps(pattern: str) -> list[tuple[float, tuple]]:
        found = re.findall(STAMP + pattern, log)
        return [(_seconds(*f[:3]), f[3:]) for f in found]

    start = stamps(rf"{stage}: (\d+) iterations of")
    scores = stamps(rf"{stage} iteration (\d+): reward")
    updates = stamps(rf"{stage} iteration (\d+): (\d+) steps, loss \S+, entropy \S+, ([\d.]+)s")
    if not start or not updates or len(scores) != len(updates):
        sys.exit(f"no {stage} iteration lines in the log (is the stage cached?)")
    ends = [t for t, _ in updates]
    wrap = lambda d: d + 86400 if d < 0 else d  # noqa: E731  (a run across midnight)
    later = [wrap(b - a) for a, b in zip(ends, ends[1:], strict=False)]
    update_task = [wrap(u - s) for (s, _), (u, _) in zip(scores, updates, strict=True)]
    return {
        "first": wrap(ends[0] - start[0][0]),
        "later": statistics.median(later) if later else float("nan"),
        "update_task": statistics.median(update_task[1:] or update_task),
        "steps_s": statistics.median(float(g[2]) for _, g in updates[1:] or updates),
        "iterations": len(updates),
    }


def uptime() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=4, help="rl_1 iterations per run")
    ap.add_argument("--workdir", help="where runs/ and mlflow.db go (default: a temp dir)")
    ap.add_argument("--ray-cpus", type=int, default=4, help="CPUs the local Ray advertises")
    ap.add_argument("--only", action="append", help="run only settings containing this text")
    ap.add_argument("--set", action="append", default=[], help="extra overrides for every run")
    args = ap.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-cluster-"))
    workdir.mkdir(parents=True, exist_ok=True)
    common = [*BUDGET, f"rl.iterations={args.iterations}", *args.set]
    rows = []
    for i, (name, sets) in enumerate(settings(args.ray_cpus).items()):
        if args.only and not any(o in name for o in args.only):
            continue
        load = uptime()
        wall, log = grpo_run(workdir, [*common, *sets], workdir / f"run{i}.log")
        t = iteration_times(log)
        rows.append((name, t, wall, load))
        print(f"{name}: {t} (grpo run {wall:.0f} s)", file=sys.stderr)
    print(f"\nrl_1, {args.iterations} iterations of 32 prompts x 8 completions (demo model)\n")
    print(
        "| setting | first iteration s | later iterations s (median) | update task s "
        "(median) | optimizer steps s (median) | grpo run s | load avg before |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, t, wall, load in rows:
        print(
            f"| {name} | {t['first']:.1f} | {t['later']:.1f} | {t['update_task']:.1f} | "
            f"{t['steps_s']:.1f} | {wall:.0f} | {load} |"
        )


if __name__ == "__main__":
    main()

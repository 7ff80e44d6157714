"""The embedded demo (configs/demo.yaml) on several seeds, one after another: held-out greedy
pass@1 after each stage, the cold start's SFT steps, wall time per stage and in all, CPU
seconds of the run, and the load average around it (the wall time only means something on a
quiet machine: a load above the core count stretches it).

    python benchmarks/demo_seeds.py --seeds 0 1 2 3 4 [--out benchmarks/out/demo_seeds]
        [--set KEY=VALUE ...]

Each seed runs `grpo run --set seed=S` into ``OUT/runs/seedS`` (MLflow at ``OUT/mlflow.db``);
its stdout goes to ``OUT/seedS.txt`` and its measurements to ``OUT/seedS.json``. A seed whose
JSON is already there is not run again (delete it to remeasure); ``--report`` only prints the
table from what is in OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

STAGES = ("cold_start_sft", "rl_1", "re_sft", "rl_2")
ROW = re.compile(r"│\s*(\w+)\s*│\s*([\d.]+)%\s*│.*│\s*(\d+)s\s*│")
TOTAL = re.compile(r"total time (\d+)s")


GRPO = [sys.executable, "-m", "flows.cli"]  # the grpo CLI of this interpreter


def run_seed(seed: int, out: Path, overrides: list[str]) -> dict:
    """Runs the demo for ``seed``; returns and writes ``OUT/seedS.json``."""
    cmd = [*GRPO, "run", "--set", f"seed={seed}", "--set", f"run_name=seed{seed}"]
    cmd += ["--set", f"output_dir={out / 'runs'}"]
    cmd += ["--set", f"tracking.uri=sqlite:///{(out / 'mlflow.db').resolve()}"]
    for o in overrides:
        cmd += ["--set", o]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    with open(out / f"seed{seed}.log", "w") as err:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    (out / f"seed{seed}.txt").write_text(proc.stdout)
    if proc.returncode != 0:
        sys.exit(f"seed {seed}: grpo run exited {proc.returncode}; see {out}/seed{seed}.log")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    m = {
        "seed": seed,
        "wall_s": wall,
        "cpu_s": cpu,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }
    tmp = out / f"seed{seed}.json.tmp"
    tmp.write_text(json.dumps(m, indent=1))
    tmp.rename(out / f"seed{seed}.json")
    return m


def parse_summary(text: str) -> tuple[dict[str, tuple[float, int]], int | None]:
    """{stage: (accuracy %, wall s)} and the total seconds from `grpo run`'s printed table."""
    rows = {m[1]: (float(m[2]), int(m[3])) for m in ROW.finditer(text) if m[1] in STAGES}
    total = TOTAL.search(text)
    missing = [s for s in STAGES if s not in rows]
    if missing or total is None:
        raise ValueError(f"grpo run's output has no table row for {missing or ['total time']}")
    return rows, int(total[1])


def sft_steps(run_dir: Path) -> int:
    info = run_dir / "checkpoints" / "cold_start_sft" / "checkpoint_info.json"
    return int(json.loads(info.read_text())["steps"])


def report(out: Path, seeds: list[int]) -> None:
    head = ["seed", "SFT steps"] + list(STAGES) + ["total", "CPU", "load 1-min"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for seed in seeds:
        m = json.loads((out / f"seed{seed}.json").read_text())
        rows, total = parse_summary((out / f"seed{seed}.txt").read_text())
        cells = [str(seed), str(sft_steps(out / "runs" / f"seed{seed}"))]
        cells += [f"{rows[s][0]:.1f}% ({rows[s][1]}s)" for s in STAGES]
        cells += [
            f"{total}s",
            f"{m['cpu_s']:.0f}s",
            f"{m['load_before']:.1f} -> {m['load_after']:.1f}",
        ]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/demo_seeds"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--report", action="store_true", help="only print the table from OUT")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        for seed in args.seeds:
            if not (args.out / f"seed{seed}.json").exists():
                m = run_seed(seed, args.out, args.set)
                print(f"seed {seed}: {m['wall_s']:.0f} s wall", file=sys.stderr, flush=True)
    report(args.out, args.seeds)


if __name__ == "__main__":
    main()

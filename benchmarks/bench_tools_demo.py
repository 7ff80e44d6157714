"""The tool demo (configs/demo-tools.yaml) with and without the python tool, on several seeds,
one run after another: held-out greedy pass@1 after each stage, RL's own lift (rl_2 minus the
cold start), wall time, and the tool calls' share of the RL stages' time; then each stage's
held-out products right by their number of digits (4 or 5: a policy that copies the tool's
result at a fixed distance gets one length only).

    python benchmarks/bench_tools_demo.py --seeds 0 1 2 [--out benchmarks/out/tools_demo]
        [--set KEY=VALUE ...]

"with" is the preset; "without" the same recipe with the SFT traces worked out by hand and no
tool at any stage (``data.multiply.tools=false``, ``rollout.tools=[]``; rejection sampling
then requires no reward: nothing is right to keep). Each run goes to
``OUT/runs/<arm>-seedS`` (MLflow at ``OUT/mlflow.db``), its printed summary to
``OUT/<arm>-seedS.txt``, its measurements to ``OUT/<arm>-seedS.json``; a run whose JSON is
there is not run again (``--report`` only prints the table). Run it on a quiet machine: the
tool calls are sandboxed processes that compete for the same cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_seeds import parse_summary  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo-tools.yaml"
# without the tool no completion is right after rl_1: rejection sampling keeps the
# best-formatted ones instead of stopping the run
ARMS = {
    "with": [],
    "without": ["data.multiply.tools=false", "rollout.tools=[]", "rejection_sampling.require=[]"],
}


GRPO = [sys.executable, "-m", "flows.cli"]  # the grpo CLI of this interpreter


def tool_seconds(run: Path, stage: str) -> tuple[float, int]:
    """The tool calls' wall seconds summed over the stage's rollout files, and their count."""
    secs, calls = 0.0, 0
    for f in sorted((run / stage).glob("iter_*/rollouts.parquet")):
        t = pq.read_table(f)
        if "tool_time_s" in t.column_names:
            secs += sum(t.column("tool_time_s").to_pylist())
            calls += sum(t.column("tool_calls").to_pylist())
    return secs, calls


def run_arm(arm: str, seed: int, out: Path, overrides: list[str]) -> dict:
    name = f"{arm}-seed{seed}"
    cmd = [*GRPO, "run", "--config", str(CONFIG), "--set", f"seed={seed}"]
    cmd += ["--set", f"run_name={name}", "--set", f"output_dir={out / 'runs'}"]
    cmd += ["--set", f"tracking.uri=sqlite:///{(out / 'mlflow.db').resolve()}"]
    for o in [*ARMS[arm], *overrides]:
        cmd += ["--set", o]
    t0 = time.perf_counter()
    with open(out / f"{name}.log", "w") as err:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    wall = time.perf_counter() - t0
    (out / f"{name}.txt").write_text(proc.stdout)
    if proc.returncode != 0:
        sys.exit(f"{name}: grpo run exited {proc.returncode}; see {out}/{name}.log")
    rows, total = parse_summary(proc.stdout)
    run = out / "runs" / name
    m = {"arm": arm, "seed": seed, "wall_s": wall, "total_s": total,
         "accuracy": {s: a for s, (a, _) in rows.items()},
         "stage_s": {s: w for s, (_, w) in rows.items()}}  # fmt: skip
    for stage in ("rl_1", "rl_2"):
        secs, calls = tool_seconds(run, stage)
        m[f"{stage}_tool_s"], m[f"{stage}_tool_calls"] = secs, calls
    tmp = out / f"{name}.json.tmp"
    tmp.write_text(json.dumps(m, indent=1))
    tmp.rename(out / f"{name}.json")
    return m


STAGES = ("cold_start_sft", "rl_1", "re_sft", "rl_2")


def by_digits(run: Path) -> dict[str, dict[int, tuple[int, int]]]:
    """Per stage, the held-out products right by their number of digits: {stage: {digits:
    (right, of)}}. A 3-digit x 2-digit product has 4 or 5 digits, and a policy that copies
    the tool's result at a fixed distance gets only one length right."""
    out = {}
    for stage in STAGES:
        f = run / "eval" / f"{stage}.parquet"
        if not f.exists():
            continue
        counts: dict[int, list[int]] = {}
        for r in pq.read_table(f, columns=["answer", "correct"]).to_pylist():
            c = counts.setdefault(len(r["answer"]), [0, 0])
            c[0] += bool(r["correct"])
            c[1] += 1
        out[stage] = {d: (c[0], c[1]) for d, c in sorted(counts.items())}
    return out


def report_digits(out: Path, seeds: list[int]) -> None:
    print("\nheld-out products right, by their number of digits (4-digit, 5-digit):")
    print("| arm | seed | " + " | ".join(STAGES) + " |")
    print("|" + "---|" * (2 + len(STAGES)))
    for arm in ARMS:
        for seed in seeds:
            run = out / "runs" / f"{arm}-seed{seed}"
            d = by_digits(run)
            if not d:
                continue
            cells = [", ".join(f"{r}/{n}" for r, n in d[s].values()) if s in d else "-"
                     for s in STAGES]  # fmt: skip
            print(f"| {arm} | {seed} | " + " | ".join(cells) + " |")


def report(out: Path, seeds: list[int]) -> None:
    head = ["arm", "seed", "cold start", "rl_1", "re_sft", "rl_2", "RL lift", "total",
            "tool calls", "tool s / RL s"]  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for arm in ARMS:
        for seed in seeds:
            f = out / f"{arm}-seed{seed}.json"
            if not f.exists():
                continue
            m = json.loads(f.read_text())
            a = m["accuracy"]
            rl_s = m["stage_s"]["rl_1"] + m["stage_s"]["rl_2"]
            tool_s = m["rl_1_tool_s"] + m["rl_2_tool_s"]
            calls = m["rl_1_tool_calls"] + m["rl_2_tool_calls"]
            cells = [arm, seed, *(f"{a[s]:.1f}%" for s in STAGES),
                     f"{a['rl_2'] - a['cold_start_sft']:+.1f}", f"{m['total_s']}s", calls,
                     f"{tool_s:.0f}s / {rl_s}s"]  # fmt: skip
            print("| " + " | ".join(map(str, cells)) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--out", default="benchmarks/out/tools_demo")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--report", action="store_true", help="only print the table")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if not a.report:
        for seed in a.seeds:
            for arm in a.arms:
                if not (out / f"{arm}-seed{seed}.json").exists():
                    print(f"running {arm} seed {seed}", file=sys.stderr, flush=True)
                    run_arm(arm, seed, out, a.overrides)
    report(out, a.seeds)
    report_digits(out, a.seeds)


if __name__ == "__main__":
    main()

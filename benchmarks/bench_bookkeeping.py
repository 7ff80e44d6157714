"""Where an RL stage's time goes besides rollout, scoring and the update: a profile.

    python benchmarks/bench_bookkeeping.py                      # the demo's rl_1, seed 0
    python benchmarks/bench_bookkeeping.py --iterations 5 --prompts 8    # a smoke test

Runs our side of benchmarks/bench_vs_trl.py (the rl_1 stage as `grpo run` runs it, from the
demo's cold-start checkpoint, in a fresh process) under cProfile, then prints one table: the
stage's wall time split into the work (rollout, scoring and update computations, the held-out
evals) and the bookkeeping around it (Prefect's task and flow engines, the stage cache's
lookups and records, MLflow, the checkpoint copies and hashes on the main thread), each with
its share of the wall time. The times are inclusive times of the named functions on the main
thread (the background checkpoint writer is not on it), so cProfile's own overhead inflates
the Python-heavy rows (Prefect, MLflow) a little more than the torch-heavy ones.
"""

from __future__ import annotations

import argparse
import pstats
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_vs_trl  # noqa: E402

# (row, [(file suffix, function name)]): inclusive seconds, summed
WORK = [
    ("rollout (generation, Parquet)", [("tasks/rollout.py", "_rollout")]),
    ("scoring", [("tasks/score.py", "score_file")]),
    ("update (optimizer steps)", [("tasks/update.py", "run_update")]),
    ("held-out evals", [("flows/rl_log.py", "__call__")]),
]
PARTS = {
    "stage": [("flows/rl.py", "rl_stage")],
    "task engine": [("prefect/task_engine.py", "run_task_sync")],
    "task bodies": [
        ("tasks/rollout.py", "rollout"),
        ("tasks/score.py", "score"),
        ("tasks/update.py", "update"),
    ],
    "cached": [("tasks/cache.py", "cached")],
    "stage log": [
        ("flows/rl_log.py", "iteration"),
        ("flows/rl_log.py", "block_end"),
        ("flows/rl_log.py", "finish"),
        ("flows/rl_report.py", "start"),
        ("tasks/tracking/stages.py", "flush_every"),
    ],
    "copies": [("grpo_core/training/checkpoint_writer.py", "submit")],
    "hashes": [("grpo_core/training/weights_id.py", "state_dict_id")],
    "writer drain": [("grpo_core/training/checkpoint_writer.py", "drain")],
    "pipeline": [("_our_side.py", "pipeline")],
}


def inclusive(stats: pstats.Stats, names: list[tuple[str, str]]) -> float:
    total = 0.0
    for (file, _, func), (_, _, _, cum, _) in stats.stats.items():
        if any(file.endswith(suffix) and func == name for suffix, name in names):
            total += cum
    return total


def called_from(stats: pstats.Stats, callee: tuple[str, str], callers: list[tuple[str, str]]):
    """Inclusive seconds of ``callee`` in the calls made by ``callers``."""
    total = 0.0
    for (file, _, func), (_, _, _, _, by) in stats.stats.items():
        if file.endswith(callee[0]) and func == callee[1]:
            for (cfile, _, cfunc), (_, _, _, cum) in by.items():
                if any(cfile.endswith(a) and cfunc == b for a, b in callers):
                    total += cum
    return total


def table(stats: pstats.Stats) -> str:
    s = {k: inclusive(stats, v) for k, v in PARTS.items()}
    work = {row: inclusive(stats, names) for row, names in WORK}
    wall = s["pipeline"]  # the subflow call, timed from inside the calling flow
    computed = work["rollout (generation, Parquet)"] + work["scoring"]
    computed += work["update (optimizer steps)"]
    evals = work["held-out evals"]
    cached_in_tasks = called_from(stats, ("tasks/cache.py", "cached"), PARTS["task bodies"])
    rows = list(work.items())
    bookkeeping = [
        ("Prefect flow engine (the rl_stage subflow)", wall - s["stage"]),
        ("Prefect task engine (task runs)", s["task engine"] - s["task bodies"]),
        ("stage cache lookups and records", cached_in_tasks - computed),
        ("stage cache keys (task bodies before the lookup)", s["task bodies"] - cached_in_tasks),
        ("MLflow curves, tags, reports", s["stage log"] - evals),
        ("checkpoint CPU copies (main thread)", s["copies"]),
        ("policy hashes in memory", s["hashes"]),
        ("waiting for the checkpoint writer", s["writer drain"]),
    ]
    counted = sum(sec for _, sec in rows) + sum(sec for _, sec in bookkeeping)
    lines = ["| part | s | share of the stage |", "|---|---|---|"]
    for row, sec in rows + bookkeeping + [("the rest of the stage loop", wall - counted)]:
        lines.append(f"| {row} | {sec:.2f} | {100 * sec / wall:.1f}% |")
    lines.append(f"| **stage wall** | {wall:.2f} | 100% |")
    other = wall - computed
    lines.append(
        f"\norchestration (wall - rollout - score - update): {other:.2f} s = "
        f"{100 * other / wall:.1f}%; without the held-out evals: {other - evals:.2f} s = "
        f"{100 * (other - evals) / wall:.1f}%"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workspace", help="keeps the start and the run (default: a temp dir)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", help="print the table of an existing profile file and exit")
    known, rest = ap.parse_known_args()
    if known.show:
        print(table(pstats.Stats(known.show)))
        return
    args = bench_vs_trl.parse_args([*rest, "--sides", "ours", "--seeds", str(known.seed)])
    ws = Path(known.workspace or tempfile.mkdtemp(prefix="bench-bookkeeping-")).resolve()
    seed_dir = ws / f"seed{known.seed}"
    start = seed_dir / "start.json"
    bench_vs_trl.child("_our_side.py", "start", args, known.seed, seed_dir, start,
                       seed_dir / "start-out.json")  # fmt: skip
    run_dir = seed_dir / "ours-profiled"
    profile = run_dir / "stage.pstats"
    bench_vs_trl.child("_our_side.py", "run", args, known.seed, run_dir, start,
                       run_dir / "result.json", extra=["--profile", str(profile)])  # fmt: skip
    print(f"rl_1 of {args.config}, seed {known.seed}, {args.threads} torch threads; {profile}\n")
    print(table(pstats.Stats(str(profile))))


if __name__ == "__main__":
    main()

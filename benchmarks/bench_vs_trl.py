"""Our rl_1 stage against TRL's GRPOTrainer: same start checkpoint, prompts and settings.

    pip install -e ".[bench]"      # trl==1.16.0, never in the default install
    python benchmarks/bench_vs_trl.py [--seeds 0 1 2] [--repeats 1] [--threads 2]
        [--iterations K] [--prompts P] [--eval-rows N] [--model DIR] [--config YAML]
        [--set KEY=VALUE ...] [--workspace DIR] [--out rows.json]

For each seed, the shared start is made first (or reused from ``--workspace``): the
pipeline's `prepare` and cold-start SFT, giving the `cold_start_sft` checkpoint, `rl.jsonl`
and `eval.jsonl`. Then the two sides run, interleaved (ours, TRL, ours, TRL, ...), each in
a fresh child process with the same torch thread count and ``OMP_NUM_THREADS``:

- ours: the rl_1 stage (flows/rl.py) as `grpo run` runs it, with Prefect and MLflow, its
  held-out evals every ``rl.eval_every`` iterations and a checkpoint per iteration; the
  start checkpoint is loaded before the clock starts, as `grpo run` has it in memory after
  the cold start and as TRL gets its model before ``train()``;
- TRL: ``trl.GRPOTrainer`` with the config's `rl` knobs (benchmarks/_trl_side.py), no
  logging, saving or evaluation inside ``train()``.

Afterwards each side's final weights get the same greedy held-out eval
(``grpo_core.algorithm.evaluation.evaluate``). Prints a Markdown table and writes the rows to
``--out``. Wall-clock numbers: run it on a quiet machine.

``--model DIR`` runs the same comparison from a pretrained model (a ``save_pretrained``
folder, e.g. SmolLM2-135M-Instruct) with ``--config configs/smollm2-cpu.yaml`` or another
preset that fits it; size the budget with ``--iterations``, ``--prompts`` and ``--set``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEMO = ROOT / "configs" / "demo.yaml"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(DEMO), help="pipeline preset (default: the demo)")
    ap.add_argument("--set", action="append", default=[], help="config override, repeatable")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--repeats", type=int, default=1, help="runs of each side per seed")
    ap.add_argument("--iterations", type=int, help="rl.iterations (generation batches)")
    ap.add_argument("--prompts", type=int, help="rl.prompts_per_iteration")
    ap.add_argument("--eval-rows", type=int, help="held-out rows (eval.num_examples)")
    ap.add_argument("--model", help="a pretrained save_pretrained folder instead of the demo")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    ap.add_argument("--sides", nargs="+", default=["ours", "trl"], choices=["ours", "trl"])
    ap.add_argument("--workspace", help="keeps the starts and runs (default: a temp dir)")
    ap.add_argument("--out", help="JSON file for the rows (default: <workspace>/rows.json)")
    args = ap.parse_args(argv)
    args.config = str(Path(args.config).resolve())  # the children run in their own folders
    if not Path(args.config).is_file():
        ap.error(f"--config {args.config}: no such file")
    for name in ("iterations", "prompts", "eval_rows", "repeats", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    return args


def overrides(args: argparse.Namespace, seed: int) -> list[str]:
    """The config overrides both sides get (the start only needs the seed and model)."""
    sets = [f"seed={seed}"]
    if args.model:
        sets += ["model.source=path", f"model.path={Path(args.model).resolve()}"]
    if args.iterations:
        sets.append(f"rl.iterations={args.iterations}")
    if args.prompts:
        sets.append(f"rl.prompts_per_iteration={args.prompts}")
    if args.eval_rows:
        sets.append(f"eval.num_examples={args.eval_rows}")
    return sets + args.set


def child(
    script: str,
    cmd: str | None,
    args,
    seed: int,
    run_dir: Path,
    start: Path,
    out: Path,
    extra: list[str] = (),
):
    argv = [sys.executable, str(HERE / script), *([cmd] if cmd else []), *extra]
    argv += ["--config", args.config, "--start", str(start), "--run-dir", str(run_dir)]
    argv += ["--out", str(out), "--threads", str(args.threads)]
    for s in overrides(args, seed):
        argv += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "log.txt"
    with log.open("w") as f:
        proc = subprocess.run(argv, cwd=run_dir, stdout=f, stderr=subprocess.STDOUT, env=env)
    if proc.returncode:
        tail = log.read_text()[-3000:]
        sys.exit(f"{script} {cmd or ''} failed (rc {proc.returncode}); log {log}:\n{tail}")


def fmt_row(r: dict, ours_wall: float | None) -> str:
    gen_tps = r["completion_tokens"] / max(r["generation_s"], 1e-9)
    upd_tps = r["trained_tokens"] / max(r["update_s"], 1e-9)
    ratio = f"{r['wall_s'] / ours_wall:.2f}" if ours_wall and r["side"] == "trl" else ""
    overhead = f"{100 * r['other_s'] / r['wall_s']:.1f}%; evals {r.get('eval_s', 0.0):.1f}"
    return (
        f"| {r['side']} | {r['seed']} | {r['wall_s']:.1f} | {r['generation_s']:.1f} "
        f"| {r['update_s']:.1f} + {r['score_s']:.1f} | {r['other_s']:.1f} ({overhead}) "
        f"| {gen_tps:.0f} | {upd_tps:.0f} | {r['peak_rss_mib']:.0f} "
        f"| {100 * r['accuracy']:.1f}% ({r['eval_rows']}) | {ratio} |"
    )


def table(rows: list[dict]) -> str:
    """Markdown: one line per run, then the means per side and the TRL / ours ratio."""
    lines = [
        "| side | seed | wall s | generation s | update + score s | other s (share; in-loop evals s) "
        "| gen tok/s | update tok/s | peak RSS MiB | held-out pass@1 (rows) | TRL wall / ours |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ours_by_seed: dict[int, list[float]] = {}
    for r in rows:
        if r["side"] == "ours":
            ours_by_seed.setdefault(r["seed"], []).append(r["wall_s"])
    for r in rows:
        walls = ours_by_seed.get(r["seed"])
        lines.append(fmt_row(r, sum(walls) / len(walls) if walls else None))
    means = {}
    for side in ("ours", "trl"):
        mine = [r for r in rows if r["side"] == side]
        if mine:
            means[side] = {k: sum(r[k] for r in mine) / len(mine) for k in ("wall_s", "other_s")}
            means[side]["accuracy"] = sum(r["accuracy"] for r in mine) / len(mine)
    if "ours" in means:
        m = means["ours"]
        lines.append(
            f"\nours: mean wall {m['wall_s']:.1f} s, orchestration share "
            f"{100 * m['other_s'] / m['wall_s']:.1f}% (stage wall - rollout - score - update), "
            f"held-out {100 * m['accuracy']:.1f}%"
        )
    if "trl" in means:
        m = means["trl"]
        lines.append(f"TRL: mean wall {m['wall_s']:.1f} s, held-out {100 * m['accuracy']:.1f}%")
    if len(means) == 2:
        lines.append(
            f"TRL wall / our wall: {means['trl']['wall_s'] / means['ours']['wall_s']:.2f}x"
        )
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if "trl" in args.sides:
        try:
            import trl  # noqa: F401
        except ImportError:
            sys.exit('bench_vs_trl: TRL is not installed; pip install -e ".[bench]"')
    ws = Path(args.workspace or tempfile.mkdtemp(prefix="bench-vs-trl-")).resolve()
    out = Path(args.out) if args.out else ws / "rows.json"
    rows: list[dict] = []
    for seed in args.seeds:
        seed_dir = ws / f"seed{seed}"
        start = seed_dir / "start.json"
        t0 = time.perf_counter()
        child("_our_side.py", "start", args, seed, seed_dir, start, seed_dir / "start-out.json")
        print(f"seed {seed}: start ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        for rep in range(args.repeats):
            for side in args.sides:
                run_dir = seed_dir / f"{side}-{rep}"
                shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: nothing cached
                result = run_dir / "result.json"
                script, cmd = ("_our_side.py", "run") if side == "ours" else ("_trl_side.py", None)
                child(script, cmd, args, seed, run_dir, start, result)
                row = json.loads(result.read_text())
                rows.append({**row, "repeat": rep})
                if row.get("same_prompts") is False:
                    print(f"warning: TRL's prompts differ from rl_1's ({run_dir})", file=sys.stderr)
                print(
                    f"seed {seed} {side} #{rep}: {row['wall_s']:.1f} s, "
                    f"held-out {100 * row['accuracy']:.1f}%",
                    file=sys.stderr,
                )
                tmp = out.with_name(f".{out.name}.tmp")
                tmp.write_text(json.dumps(rows, indent=1))
                tmp.replace(out)
    print(
        f"\n{' '.join(overrides(args, args.seeds[0])[1:]) or 'config as is'} ({args.config}); "
        f"{args.threads} torch threads; rows in {out}\n"
    )
    print(table(rows))


if __name__ == "__main__":
    main()

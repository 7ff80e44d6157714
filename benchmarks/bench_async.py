"""The demo on-policy (``rl.async_level: 0``) and with the async schedule (``1``, ...), seed
by seed, interleaved: each RL stage's wall time and held-out accuracy, the async run's idle
shares of trainer and engine, and the on-policy wall time over the async one.

    python benchmarks/bench_async.py --seeds 0 1 2 [--levels 0 1] [--out benchmarks/out/async]
        [--set KEY=VALUE ...] [--report] [--base OTHER_OUT/async0]

Each (seed, level) is `grpo run --set seed=S --set rl.async_level=K` into ``OUT/asyncK``
(benchmarks/demo_seeds.py runs it: ``OUT/asyncK/seedS.{txt,json}``, MLflow at
``OUT/asyncK/mlflow.db``); one already measured is not run again. Run it on a quiet machine:
the two settings share its cores differently (on-policy: every phase with all threads;
async: the engine process with ``cluster.rollout.num_cpus`` threads beside the trainer).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_seeds import parse_summary, run_seed  # noqa: E402

STAGES = ("rl_1", "rl_2")
SHARES = ("train/async/trainer_idle_share", "train/async/engine_idle_share")
# how much of a stale batch the weights let train: the behaviour weight's (token level), or
# the engine correction's when that weighted the stale rows instead (sequence level)
WEIGHTS = ("train/sampling/behaviour_weight", "train/sampling/importance_sampling_ratio")


def stage_numbers(db: Path, run_name: str) -> dict[str, dict[str, float]]:
    """{stage: {"wall_s", idle shares}} of the RL stage runs of pipeline ``run_name``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{db.resolve()}")
    exps = [e.experiment_id for e in client.search_experiments()]
    out = {}
    for run in client.search_runs(exps, f"tags.mlflow.runName LIKE '% ({run_name})'"):
        stage = run.data.tags.get("stage")
        metrics = run.data.metrics
        if stage in STAGES and "wall_time_s" in metrics:
            out[stage] = {"wall_s": metrics["wall_time_s"]}
            out[stage].update({k: metrics[k] for k in SHARES if k in metrics})
            out[stage].update(_weight_means(client, run.info.run_id))
    return out


def _weight_means(client, run_id: str) -> dict[str, float]:
    """Means over the stage's optimizer steps of the stale rows' ESS / N and near-zero share
    (``ess``, ``near_zero``), from whichever weighting ran."""
    for prefix in WEIGHTS:
        ess = [m.value for m in client.get_metric_history(run_id, f"{prefix}/ess")]
        if ess:
            near = [m.value for m in client.get_metric_history(run_id, f"{prefix}/near_zero_share")]
            return {"ess": sum(ess) / len(ess), "near_zero": sum(near) / max(len(near), 1)}
    return {}


def report(out: Path, seeds: list[int], levels: list[int], base: Path | None = None) -> None:
    """The table; ``base``: the folder of on-policy runs the ratios compare with (default
    ``OUT/async0``, e.g. another OUT's when this one holds a variant's async runs)."""
    base_dir = base or out / "async0"
    head = ["seed", "async_level"]
    for s in STAGES:
        head += [f"{s} wall s", f"{s} pass@1", f"{s} on-policy / this"]
    head += ["rl_1 trainer idle", "rl_1 engine idle", "rl_1 ESS / N", "rl_1 near-zero"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for seed in seeds:
        ref = base_dir / "mlflow.db"
        on_policy = stage_numbers(ref, f"seed{seed}") if ref.exists() else None
        for k in levels:
            folder = out / f"async{k}"
            if not (folder / f"seed{seed}.txt").exists():
                continue
            acc, _ = parse_summary((folder / f"seed{seed}.txt").read_text())
            nums = stage_numbers(folder / "mlflow.db", f"seed{seed}")
            cells = [str(seed), str(k)]
            for s in STAGES:
                wall = nums[s]["wall_s"]
                ratio = f"{on_policy[s]['wall_s'] / wall:.2f}x" if on_policy else "-"
                cells += [f"{wall:.1f}", f"{acc[s][0]:.1f}%", ratio]
            shares = nums["rl_1"]
            cells += [f"{shares[k_] * 100:.0f}%" if k_ in shares else "-" for k_ in SHARES]
            cells += [f"{shares[k_] * 100:.1f}%" if k_ in shares else "-"
                      for k_ in ("ess", "near_zero")]  # fmt: skip
            print("| " + " | ".join(cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--levels", type=int, nargs="+", default=[0, 1])
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/async"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--report", action="store_true", help="only print the table from OUT")
    p.add_argument("--base", type=Path, help="on-policy runs to compare with (OUT/async0)")
    args = p.parse_args()
    if not args.report:
        for seed in args.seeds:
            for k in args.levels:
                folder = args.out / f"async{k}"
                folder.mkdir(parents=True, exist_ok=True)
                if (folder / f"seed{seed}.json").exists():
                    continue
                m = run_seed(seed, folder, [f"rl.async_level={k}", *args.set])
                print(f"seed {seed}, async_level {k}: {m['wall_s']:.0f} s", file=sys.stderr)
    report(args.out, args.seeds, args.levels, args.base)


if __name__ == "__main__":
    main()

"""The demo's cold-start SFT trained three ways that differ only in float rounding, seed by
seed: in one process, in one process summing the batch in row chunks
(``max_tokens_per_microbatch``), and on a local Ray trainer group of 2 DDP ranks (each rank
a share of every batch, gradients summed). Prints the held-out greedy pass@1 of each
checkpoint, so that a gap between one process and Ray can be set against the spread that
rounding alone makes.

    python benchmarks/bench_sft_ranks.py --seeds 0 1 2 3 [--steps 400] [--out DIR]

The model, data and SFT settings are configs/demo.yaml's (batch 32, learning rate 3e-3, 20
warmup steps, clipping at norm 1; no dev-accuracy stop, as under ``sft.max_steps=400``, which
ends before the dev checks start at step 600). Results go to ``OUT/results.jsonl`` and a seed
and arm already there is not run again (``--report`` prints the table only).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

ARMS = ("one process", "one process, row chunks", "ray, 2 ranks")


def train(arm: str, seed: int, steps: int, out: Path) -> dict:
    from cluster import runtime, trainer_group
    from cluster.config import ClusterConfig, TrainerSettings
    from flows.config import load_config
    from grpo_core.algorithm.evaluation import evaluate
    from grpo_core.config.stages import SFTConfig
    from grpo_core.demo.model import save_base_model
    from grpo_core.demo.task import make_splits
    from tasks.policies.trainer import open_trainer
    from tasks.sft import SFTRequest, run_sft

    demo = load_config(None)  # the packaged demo preset
    d = demo.data.demo
    base = save_base_model(out / f"base{seed}", seed=seed, **demo.model.demo.model_dump())
    splits = make_splits(seed, d.digits, d.n_sft, d.n_rl, d.n_dev, d.n_eval)  # as the flow does
    data = out / f"sft{seed}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in splits.sft))
    chunks = {"max_tokens_per_microbatch": 640} if "chunks" in arm else {}
    sft = demo.sft.model_dump(exclude={"target_accuracy", "max_steps", "checkpoint_every"})
    cfg = SFTConfig(**{**sft, "max_steps": steps, "target_accuracy": None, **chunks})
    ckpt = out / f"{arm.replace(' ', '_').replace(',', '')}_seed{seed}"
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.rmtree(f"{ckpt}.resume", ignore_errors=True)
    ray = arm.startswith("ray")
    cluster = (
        ClusterConfig(backend="ray", num_cpus=2, trainer=TrainerSettings(workers=2, num_cpus=1))
        if ray
        else ClusterConfig()
    )
    runtime.configure(cluster)
    if ray:
        runtime.ensure_ray(cluster)
    open_trainer().forget()
    start = time.perf_counter()
    try:
        res = run_sft(SFTRequest("cold_start_sft", str(base), str(data), str(ckpt), cfg,
                                 seed=seed))  # fmt: skip
    finally:
        if ray:
            trainer_group.release()
            runtime.shutdown()
        runtime.configure(ClusterConfig())
    wall = time.perf_counter() - start
    open_trainer().forget()
    w = open_trainer().handle(str(ckpt))
    acc = evaluate(
        w.model, w.tokenizer, splits.eval, max_new_tokens=demo.eval.max_completion_length
    )
    open_trainer().forget()
    return {"seed": seed, "arm": arm, "steps": res.steps, "final_loss": res.final_loss,
            "held_out": acc.accuracy, "wall_s": wall}  # fmt: skip


def report(results: list[dict], seeds: list[int]) -> None:
    by = {(r["seed"], r["arm"]): r for r in results}
    print("| seed | " + " | ".join(ARMS) + " |")
    print("|---|" + "---|" * len(ARMS))
    for seed in seeds:
        cells = [by.get((seed, a)) for a in ARMS]
        print(
            f"| {seed} | " + " | ".join(f"{c['held_out']:.1%}" if c else "-" for c in cells) + " |"
        )
    means = []
    for a in ARMS:
        vals = [by[(s, a)]["held_out"] for s in seeds if (s, a) in by]
        means.append(f"{statistics.mean(vals):.1%}" if vals else "-")
    print("| mean | " + " | ".join(means) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out/sft_ranks"))
    ap.add_argument("--report", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.jsonl"
    results = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    done = {(r["seed"], r["arm"]) for r in results}
    for seed in [] if args.report else args.seeds:
        for arm in ARMS:
            if (seed, arm) in done:
                continue
            print(f"seed {seed}: {arm} ...", flush=True)
            r = train(arm, seed, args.steps, args.out)
            results.append(r)
            with path.open("a") as f:
                f.write(json.dumps(r) + "\n")
    report(results, args.seeds)


if __name__ == "__main__":
    main()

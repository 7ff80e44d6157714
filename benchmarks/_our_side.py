"""Our side of benchmarks/bench_vs_trl.py, one child process per call.

python benchmarks/_our_side.py start --config C --set ... --start START.json ...
    the shared start: `prepare` and the cold-start SFT of the pipeline (stage cache:
    a second call with the same settings reuses them); writes START.json with the
    paths of the `cold_start_sft` checkpoint, `rl.jsonl` and `eval.jsonl`
python benchmarks/_our_side.py run --config C --set ... --start START.json ...
    the rl_1 stage (flows/rl.py) on that checkpoint, as `grpo run` runs it (Prefect
    server, MLflow parent run), timed as a whole; rollout / score / update seconds come
    from the stage's own MLflow metrics; then the held-out eval of the final weights
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench_common import (  # noqa: E402
    heldout_accuracy,
    load,
    peak_rss_mib,
    set_threads,
    side_args,
    write_result,
)

TIMING_KEYS = {
    "rollout": "train/timing/rollout_s",
    "score": "train/timing/score_s",
    "update": "train/timing/update_s",
}


def _tracking(cfg, ws_root: Path, run_name: str):
    from tasks.tracking.stages import Tracking

    uri = f"sqlite:///{ws_root.resolve() / 'mlflow.db'}"
    tracking = Tracking.open(uri, cfg.tracking.experiment)
    return tracking.start_parent(run_name, {"pipeline": "bench_vs_trl"}, params=cfg.model_dump())


def make_start(args) -> None:
    cfg = load(args.config, args.set)
    from flows.env import apply_defaults

    apply_defaults(args.run_dir, flow_logs=False)
    set_threads(args.threads)
    from flows.recipe import STAGES, RecipeRun, sft_inputs
    from tasks.prepare import prepare
    from tasks.sft import sft_stage
    from tasks.workspace import Workspace

    ws = Workspace.create(args.run_dir, "start")
    tracking = _tracking(cfg, Path(args.run_dir), "start")
    data = prepare.fn(cfg.data, cfg.model, cfg.seed, ws)
    run = RecipeRun(cfg, ws, tracking, data)
    sft_args, sft_kwargs = sft_inputs(run, STAGES["cold_start_sft"])  # as `grpo run` has it
    sft = sft_stage.fn(*sft_args, **sft_kwargs)
    tracking.end(tracking.parent_run_id)
    write_result(
        args.start,
        {
            "checkpoint": sft.checkpoint,
            "rl": data["rl"],
            "eval": data["eval"],
            "sft_cached": sft.cached,
            "seed": cfg.seed,
        },
    )


def run_rl(args) -> None:
    import json

    cfg = load(args.config, args.set)
    start = json.loads(Path(args.start).read_text())
    from flows import local_server
    from flows.env import apply_defaults

    apply_defaults(args.run_dir, flow_logs=False)
    server = local_server.start()  # as `grpo run`: started before the heavy imports
    set_threads(args.threads)
    from cluster import process
    from flows.recipe import STAGES, RecipeRun, rl_inputs
    from flows.rl import rl_stage
    from tasks.policies.trainer import open_trainer
    from tasks.workspace import Workspace

    # in `grpo run` the cold-start policy is in memory when rl_1 starts (the learner: tasks/policies/trainer.py)
    process.load_policies_with(cfg.model)
    open_trainer().learner_at(start["checkpoint"])

    run_dir = Path(args.run_dir)
    ws = Workspace.create(run_dir, "ours")  # a fresh run folder: nothing cached
    tracking = _tracking(cfg, run_dir, "ours")
    # the shared start's files, its checkpoint standing for the stage that trained it
    files = {"rl": start["rl"], "eval": start["eval"], "cold_start_sft": start["checkpoint"]}
    rl_args, rl_kwargs = rl_inputs(RecipeRun(cfg, ws, tracking, files), STAGES["rl_1"])
    from prefect import flow

    @flow(name="bench-pipeline")
    def pipeline() -> tuple[dict, float]:
        """rl_1 as a subflow of a running flow, as in `grpo run` (whose flow has talked to
        the Prefect server long before rl_1 starts): the subflow's start is timed, the
        server's first answer is not."""
        t0 = time.perf_counter()
        out = rl_stage(*rl_args, **rl_kwargs)  # as `grpo run` has it
        return out, time.perf_counter() - t0

    with local_server.attach(server):
        if args.profile:  # benchmarks/bench_bookkeeping.py: where the stage's time goes
            import cProfile

            profiler = cProfile.Profile()
            out, wall = profiler.runcall(pipeline)
            profiler.dump_stats(args.profile)
        else:
            out, wall = pipeline()
    rss = peak_rss_mib()
    client = tracking.client
    parts = {
        name: sum(m.value for m in client.get_metric_history(out.run_id, key))
        for name, key in TIMING_KEYS.items()
    }
    evals = sum(m.value for m in client.get_metric_history(out.run_id, "train/timing/eval_s"))
    lengths = client.get_metric_history(out.run_id, "train/completions/mean_length")
    per_iter = cfg.rl.prompts_per_iteration * cfg.rl.num_generations
    tokens = sum(m.value for m in lengths) * per_iter
    tracking.end(tracking.parent_run_id)
    acc = heldout_accuracy(out.checkpoint, None, cfg, start["eval"])
    write_result(
        args.out,
        {
            "side": "ours",
            "seed": cfg.seed,
            "wall_s": wall,
            "generation_s": parts["rollout"],
            "score_s": parts["score"],
            "update_s": parts["update"],
            "other_s": wall - sum(parts.values()),
            "eval_s": evals,  # the stage's held-out evals (rl.eval_every), part of other_s
            "completion_tokens": tokens,
            "trained_tokens": tokens,
            "optimizer_steps": out.global_step,
            "peak_rss_mib": rss,
            **acc,
        },
    )


if __name__ == "__main__":
    command = sys.argv.pop(1) if len(sys.argv) > 1 else ""
    if command not in ("start", "run"):
        sys.exit("usage: _our_side.py start|run --config C --start S --run-dir D --out F ...")
    a = side_args(__doc__.split("\n\n")[0])
    (make_start if command == "start" else run_rl)(a)

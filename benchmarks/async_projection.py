"""A projection, not a measurement: what overlapping generation and training
(``rl.async_level``, flows/rl_schedule.py) would save on a cluster, from a run whose RL
stages ran on-policy.

Reads each RL stage's per-iteration timings from the run's MLflow store (the stage run's
``train/timing/rollout_s``, ``score_s``, ``update_s`` and ``eval_s`` histories) and replays
them under the schedule ``async_level: k``: the rollouts of iteration ``i`` are sampled by the
policy after update ``i - k - 1`` (``k = 0``: the policy the previous update made, today's
loop), one engine generates and scores the iterations in order, one trainer updates them in
order. So

    gen_end[i] = max(gen_end[i-1], upd_end[i-k-1]) + rollout_i + score_i
    upd_end[i] = max(upd_end[i-1], gen_end[i]) + update_i + sync

where ``sync`` (``--sync-s``) is a weight transfer per iteration. Evals stay on the critical
path, added in full (they sample the policy being evaluated). What it assumes: the engine and
the trainer on devices of their own, neither slowed by the other (on one 2-core machine they
share the cores: benchmarks/bench_async.py measures there instead), and the same
per-iteration times as the on-policy run. Under the async schedule the update also runs the
old log-prob forward that on-policy ``old_logprobs: auto`` skips with the hf engine (rows of
an older policy: docs/algorithm.md, "Async rollouts"); this replay does not add it.

    python benchmarks/async_projection.py --tracking-uri sqlite:///mlflow.db
    python benchmarks/async_projection.py --tracking-uri sqlite:///mlflow.db --levels 0 1 2 --sync-s 0.5
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

TIMINGS = ("rollout_s", "score_s", "update_s", "eval_s")
RL_STAGES = ("rl_1", "rl_2")


@dataclass(frozen=True)
class Projection:
    seconds: float  # the stage's generation, training and evals under the schedule
    engine_idle: float  # share of ``seconds`` the engine waits
    trainer_idle: float  # share of ``seconds`` the trainer waits


def project(gen: list[float], train: list[float], *, level: int, evals: float = 0.0,
            sync: float = 0.0) -> Projection:  # fmt: skip
    """Replay per-iteration generation (rollout + score) and training times under
    ``async_level: level`` (the formula in the module docstring)."""
    if len(gen) != len(train):
        raise ValueError(f"{len(gen)} generation times but {len(train)} update times")
    gen_end: list[float] = []
    upd_end: list[float] = []
    for i, (g, t) in enumerate(zip(gen, train, strict=True)):
        ready = upd_end[i - level - 1] if i - level - 1 >= 0 else 0.0  # its policy exists
        gen_end.append(max(gen_end[-1] if gen_end else 0.0, ready) + g)
        upd_end.append(max(upd_end[-1] if upd_end else 0.0, gen_end[-1]) + t + sync)
    busy = upd_end[-1] if upd_end else 0.0
    total = busy + evals
    if total == 0:
        return Projection(0.0, 0.0, 0.0)
    engine_idle = (busy - sum(gen)) / total
    trainer_idle = (busy - sum(train) - sync * len(train)) / total
    return Projection(total, engine_idle, trainer_idle)


def stage_timings(tracking_uri: str, run_name: str | None = None) -> dict[str, dict]:
    """Per RL stage run (tag ``stage``), each timing's per-iteration values (by step). With
    several runs of a stage, the newest; ``run_name``: only stage runs under that pipeline
    run (``rl_1 (<run_name>)``)."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    out: dict[str, dict] = {}
    runs = client.search_runs(exps, max_results=1000, order_by=["attributes.start_time DESC"])
    for run in runs:
        stage = run.data.tags.get("stage")
        name = run.info.run_name or ""
        if stage not in RL_STAGES or stage in out or name.split(" (")[0] != stage:
            continue  # eval blocks ("rl_1 it 0-4") carry the tag too
        if run_name is not None and name != f"{stage} ({run_name})":
            continue
        out[stage] = {
            key: {m.step: m.value for m in client.get_metric_history(run.info.run_id,
                                                                     f"train/timing/{key}")}
            for key in TIMINGS
        }  # fmt: skip
    return out


def stage_rows(timings: dict[str, dict], levels: list[int], sync: float) -> list[dict]:
    rows = []
    for stage, t in sorted(timings.items()):
        steps = sorted(t["update_s"])
        if not steps:
            continue
        gen = [t["rollout_s"].get(s, 0.0) + t["score_s"].get(s, 0.0) for s in steps]
        train = [t["update_s"][s] for s in steps]
        evals = sum(t["eval_s"].values())
        base = project(gen, train, level=0, evals=evals, sync=sync)
        for level in levels:
            p = project(gen, train, level=level, evals=evals, sync=sync)
            rows.append({"stage": stage, "iterations": len(steps), "level": level,
                         "gen_s": sum(gen), "update_s": sum(train), "evals_s": evals,
                         "seconds": p.seconds, "speedup": base.seconds / p.seconds,
                         "engine_idle": p.engine_idle, "trainer_idle": p.trainer_idle})  # fmt: skip
    return rows


def table(rows: list[dict]) -> str:
    head = ("| stage | iterations | async_level | rollout+score s | update s | evals s | "
            "projected s | speed-up | engine idle | trainer idle |")  # fmt: skip
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['stage']} | {r['iterations']} | {r['level']} | {r['gen_s']:.1f} | "
            f"{r['update_s']:.1f} | {r['evals_s']:.1f} | {r['seconds']:.1f} | "
            f"{r['speedup']:.2f}x | {r['engine_idle']:.0%} | {r['trainer_idle']:.0%} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tracking-uri", default="sqlite:///mlflow.db")
    ap.add_argument("--run-name", help="the pipeline run's name (default: the newest)")
    ap.add_argument("--levels", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--sync-s", type=float, default=0.0, help="weight transfer per iteration")
    args = ap.parse_args(argv)
    timings = stage_timings(args.tracking_uri, args.run_name)
    if not timings:
        print(f"no RL stage runs with timings in {args.tracking_uri}")
        return 1
    print("PROJECTION from the on-policy run's measured stage times (engine and trainer on "
          "separate devices, no contention; evals on the critical path):")  # fmt: skip
    print(table(stage_rows(timings, args.levels, args.sync_s)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

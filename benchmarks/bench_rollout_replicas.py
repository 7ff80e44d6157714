"""One RL iteration's rollout in one process vs on Ray rollout replicas.

The demo model (hidden 128, 4 layers, random weights: completions run to the length limit)
and the demo preset's iteration: ``--prompts`` addition prompts x ``--n`` samples, up to
``--max-new-tokens`` tokens, temperature 1. Rows: the local ``hf`` engine (``--threads``
torch threads), and ``cluster.rollout.workers`` = 1, 2, ... replicas of one thread each on
a local Ray of ``--ray-cpus`` CPUs. Reported: replica start (first call: actors, imports,
checkpoint load), rollout time (median of ``--repeats`` after that), generated tokens/s,
and the weight sync to a new policy (one ``ray.put`` of the state dict, loaded by every
replica, with the probe check).

    python benchmarks/bench_rollout_replicas.py                  # ~2 min on 2 cores
    python benchmarks/bench_rollout_replicas.py --workers 1,2,4 --ray-cpus 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--workers", default="1,2")
    p.add_argument("--ray-cpus", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the local row")
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args()


def _tokens(samples) -> int:
    return sum(len(s.completion_ids) for s in samples)


def _timed(run, repeats: int):
    """``(median seconds, the last run's samples)`` of ``repeats`` calls of ``run()``."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        samples = run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), samples


def _moved_policy(model, tok, tmp: Path) -> Path:
    """A second policy (every weight + 0.01) saved under ``tmp``, to sync the replicas to.
    Changes ``model`` in place."""
    import torch

    from grpo_core.training.checkpoint import save_checkpoint

    with torch.no_grad():
        for q in model.parameters():
            q.add_(0.01)
    moved = tmp / "moved"
    save_checkpoint(model, tok, moved)
    return moved


def _replica_row(w: int, args, ckpt: Path, moved: Path, model, model2, tok, prompt_ids, params):
    """Start ``w`` replicas, time their rollouts and one weight sync to ``moved``."""
    from cluster import rollout_workers
    from cluster.config import ClusterConfig
    from grpo_core.engines.turns import SampleRequest
    from grpo_core.training.checkpoint import policy_id

    cfg = ClusterConfig(backend="ray", rollout={"workers": w, "num_cpus": 1})
    request = SampleRequest(params, load_options={"dtype": "float32"})
    kw = dict(tokenizer=tok, checkpoint=str(ckpt), policy_id=policy_id(ckpt), model=model)
    t0 = time.perf_counter()
    rollout_workers.sample(cfg, prompt_ids[:w], request, **kw)
    start = time.perf_counter() - t0
    med, samples = _timed(
        lambda: rollout_workers.sample(cfg, prompt_ids, request, **kw), args.repeats
    )
    (group,) = rollout_workers.groups()
    t0 = time.perf_counter()
    group.sync(str(moved), policy_id(moved), model2, tok, check=True)
    sync = time.perf_counter() - t0
    rollout_workers.close_all()
    name = f"{w} Ray replica(s), 1 thread each"
    return (name, f"{start:.1f}", med, _tokens(samples) / med, f"{sync:.2f}")


def _print_table(args, rows) -> None:
    print(
        f"\n{args.prompts} prompts x {args.n} samples, up to {args.max_new_tokens} tokens, "
        f"demo model; Ray with {args.ray_cpus} CPUs; median of {args.repeats}\n"
    )
    print("| setting | replica start s | rollout s | tokens/s | weight sync s |")
    print("|---|---|---|---|---|")
    for name, start, secs, tps, sync in rows:
        print(f"| {name} | {start} | {secs:.2f} | {tps:.0f} | {sync} |")


def main() -> None:
    args = _args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import ray
    import torch

    from cluster import runtime
    from grpo_core.contracts.text import encode_prompt
    from grpo_core.demo.model import save_base_model
    from grpo_core.engines import get_engine
    from grpo_core.engines.generation import SamplingParams
    from grpo_core.training.checkpoint import load_checkpoint

    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="bench-replicas-"))
    ckpt = save_base_model(
        tmp / "base", seed=0, hidden_size=128, num_hidden_layers=4, num_attention_heads=4
    )
    model, tok = load_checkpoint(ckpt)
    prompt_ids = [encode_prompt(tok, f"{100 + i}+{200 + 3 * i}=") for i in range(args.prompts)]
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0)

    engine = get_engine("hf", model=model, tokenizer=tok)
    med, samples = _timed(lambda: engine.generate(prompt_ids, params, progress=False), args.repeats)
    rows = [(f"one process ({args.threads} thread)", "-", med, _tokens(samples) / med, "-")]

    moved = _moved_policy(model, tok, tmp)
    model2, _ = load_checkpoint(moved)
    model, _ = load_checkpoint(ckpt)

    ray.init(num_cpus=args.ray_cpus, include_dashboard=False, log_to_driver=False)
    try:
        for w in [int(x) for x in args.workers.split(",")]:
            rows.append(_replica_row(w, args, ckpt, moved, model, model2, tok, prompt_ids, params))
    finally:
        runtime.shutdown()
    _print_table(args, rows)


if __name__ == "__main__":
    main()

"""A new policy reaching the Ray rollout replicas: trainer rank 0's broadcast on the weight bus
against each replica reading the checkpoint the trainer group wrote.

A random Qwen2 model (the demo's) of ``--hidden`` x ``--layers`` (default about 120 M parameters, 480
MB in float32, SmolLM2-135M's shape without its vocabulary) is saved once; the trainer group
(``--trainers`` ranks, ddp or ``--strategy fsdp``) loads it as its warm policy and
``--replicas`` hf replicas start from it. Each row then makes the replicas take that policy
again ``--repeats`` times (their record of what they hold is cleared in between) and reports
the median seconds, the MiB moved and MiB/s; every replica's weights are then hashed and must
equal the trainer's policy_id. On CPU both roads are gloo or file reads in one machine's
memory: the figures say what the broadcast costs next to a local file read, not what NCCL
between GPUs gives.

    python benchmarks/bench_weight_sync.py                  # ~2 min on 2 cores
    python benchmarks/bench_weight_sync.py --layers 4 --hidden 256 --repeats 2
    python benchmarks/bench_weight_sync.py --gpus --replicas 1   # 2 GPUs: NCCL
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--trainers", type=int, default=1)
    p.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp")
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--ray-cpus", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--gpus",
        action="store_true",
        help="one GPU per trainer rank and per replica (the bus is then NCCL)",
    )
    return p.parse_args()


def _save_model(folder: Path, a) -> Path:
    from grpo_core.demo.model import save_base_model

    return save_base_model(folder / "policy", seed=0, hidden_size=a.hidden,
                           num_hidden_layers=a.layers, intermediate_size=a.intermediate,
                           num_attention_heads=max(1, a.hidden // 64))  # fmt: skip


def _warm_on_rank(data_parallel, *, checkpoint: str) -> str:
    """A trainer rank holds ``checkpoint`` as its warm policy (as after an update)."""
    from tasks.policies.trainer import open_trainer

    return open_trainer().handle(checkpoint).policy_id


def _row(cfg, checkpoint: Path, how: str, a) -> dict:
    from cluster import rollout_workers, runtime
    from cluster.trainer_group import trainer_group
    from tasks.policies.files import files

    rollout = cfg.rollout.model_copy(update={"weight_sync": how})
    cfg = cfg.model_copy(update={"rollout": rollout})
    runtime.configure(cfg)
    pid = trainer_group(cfg).run(_warm_on_rank, {"checkpoint": str(checkpoint)}, what="load")
    p = files(checkpoint)
    from grpo_core.engines.generation import SamplingParams
    from grpo_core.engines.turns import SampleRequest

    params = SamplingParams(n=1, max_new_tokens=1, temperature=0.0)
    request = SampleRequest(params)
    rollout_workers.sample(cfg, [[1, 2]], request, checkpoint=str(checkpoint), policy_id=pid,
                           model=None, tokenizer=p.tokenizer, config=p.config)  # fmt: skip
    (group,) = rollout_workers.groups()
    seconds = []
    for _ in range(a.repeats):
        group.synced = ["stale"] * len(group.actors)
        start = time.perf_counter()
        group.sync(str(checkpoint), pid, None, p.tokenizer)
        seconds.append(time.perf_counter() - start)
    ids = set(group.ray.get([x.weights_id.remote() for x in group.actors]))
    assert ids == {pid}, f"{how}: replicas hold {ids}, the trainer {pid}"
    assert group.weight_syncs[-1]["how"] == how, group.weight_syncs[-1]
    nbytes = group.weight_syncs[-1].get("bytes") or sum(
        f.stat().st_size for f in checkpoint.glob("*.safetensors")
    )
    return {"how": how, "mib": nbytes / 2**20, "s": statistics.median(seconds)}


def main() -> None:
    a = _args()
    from cluster import rollout_workers, runtime
    from cluster.config import ClusterConfig
    from cluster.trainer_group import release

    cfg = ClusterConfig(
        backend="ray",
        num_cpus=a.ray_cpus,
        rollout={"workers": a.replicas, "num_cpus": a.ray_cpus / (2 * a.replicas),
                 "num_gpus": int(a.gpus), "weight_sync_bucket_mb": a.bucket_mb},
        trainer={"workers": a.trainers, "num_cpus": a.ray_cpus / (2 * a.trainers),
                 "num_gpus": int(a.gpus), "strategy": a.strategy,
                 "dist_backend": "nccl" if a.gpus else "gloo"},
        scoring={"workers": 1, "num_cpus": 0},
    )  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = _save_model(Path(tmp), a)
        runtime.ensure_ray(cfg)
        try:
            for how in ("checkpoint", "broadcast"):
                rows.append(_row(cfg, checkpoint, how, a))
        finally:
            rollout_workers.close_all()
            release()
            runtime.shutdown()
    where = "GPUs, nccl" if a.gpus else "CPU, gloo"
    print(f"\nweight sync to {a.replicas} hf replica(s) from {a.trainers} {a.strategy} rank(s) "
          f"({where}), median of {a.repeats}, bucket {a.bucket_mb} MiB")  # fmt: skip
    print(f"| {'road':<10} | {'MiB':>7} | {'seconds':>7} | {'MiB/s':>7} |")
    print(f"|{'-' * 12}|{'-' * 9}|{'-' * 9}|{'-' * 9}|")
    for r in rows:
        print(f"| {r['how']:<10} | {r['mib']:7.1f} | {r['s']:7.2f} | {r['mib'] / r['s']:7.0f} |")
    print(f"broadcast / checkpoint time: {rows[1]['s'] / rows[0]['s']:.2f}")


if __name__ == "__main__":
    main()

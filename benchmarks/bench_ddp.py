"""Data-parallel GRPO update: wall time of one update (one generation batch of the demo
preset: 32 prompts x 8 completions, 4 optimizer steps) on the demo model, in one process
without ``torch.distributed``, on 1 and 2 gloo ranks with replicas (ddp), and on 2 ranks with
the decoder layers sharded (fsdp, grpo_core/training/fsdp.py), each process with one thread.

    python benchmarks/bench_ddp.py [--repeats 3] [--set rl.KEY=VALUE ...]

Prints a Markdown table: median seconds per update over the repeats (after one warm-up),
the speed-up against the one-process update, and what rank 0 holds between updates:
parameters and AdamW moments (MiB, fp32; gradients, freed after each step, add one more
copy of the parameters during the update). On a machine with fewer free cores than
ranks expect no speed-up: the ranks share the cores and add the collectives' cost.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

import torch  # noqa: E402

from grpo_core.training.distributed import spawn  # noqa: E402


def _batch(rl, pad_id: int, vocab: int, seed: int = 0):
    from grpo_core.algorithm.update import build_batch

    g = torch.Generator().manual_seed(seed)
    n = rl.prompts_per_iteration * rl.num_generations
    prompts, completions, adv, gids = [], [], [], []
    for i in range(n):
        group = i // rl.num_generations
        p = torch.randint(4, vocab, (10 + group % 5,), generator=g).tolist()
        c_len = int(torch.randint(8, rl.max_completion_length + 1, (1,), generator=g))
        prompts.append(p)
        completions.append(torch.randint(4, vocab, (c_len,), generator=g).tolist())
        adv.append(float(torch.randn(1, generator=g)))
        gids.append(group)
    return build_batch(prompts, completions, adv, pad_id, group_ids=gids)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _state_mib(model, opt) -> float:
    """This rank's parameters, gradients (if any) and optimizer state tensors, in MiB."""
    tensors = [_local(p) for p in model.parameters()]
    tensors += [_local(p.grad) for p in model.parameters() if p.grad is not None]
    tensors += [_local(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def _time(
    dp,
    checkpoint: str,
    overrides: list[str],
    repeats: int,
    out: str | None,
    strategy: str = "ddp",
) -> tuple[list[float], float]:
    from flows.config import load_config
    from grpo_core.algorithm.update import grpo_update
    from grpo_core.training.checkpoint import load_checkpoint

    torch.set_num_threads(1)
    rl = load_config(None, overrides).rl
    model, tok = load_checkpoint(checkpoint)
    if strategy == "fsdp":
        from grpo_core.training.fsdp import ShardedDataParallel

        dp = ShardedDataParallel(dp.group)
        dp.wrap(model)
    batch = _batch(rl, tok.pad_token_id, model.config.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=rl.learning_rate)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        grpo_update(model, opt, None, batch, rl.update_config(), data_parallel=dp)
        times.append(time.perf_counter() - t0)
        mib = _state_mib(model, opt)
    if out is not None and (dp is None or dp.rank == 0):
        Path(out).write_text(" ".join(map(str, [mib, *times[1:]])))
    return times[1:], mib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    from flows.config import load_config
    from grpo_core.demo.model import save_base_model

    cfg = load_config(None, args.set)
    with tempfile.TemporaryDirectory() as d:
        ckpt = str(save_base_model(Path(d) / "demo", seed=0, **cfg.model.demo.model_dump()))
        rows = [("1 process, no process group", None, "ddp")]
        rows += [(f"{w} gloo rank{'s' * (w > 1)}, ddp", w, "ddp") for w in (1, 2)]
        rows += [("2 gloo ranks, fsdp", 2, "fsdp")]
        results = {}
        for label, world, strategy in rows:
            if world is None:
                results[label] = _time(None, ckpt, args.set, args.repeats, None)
            else:
                out = f"{d}/times-{world}-{strategy}.txt"
                spawn(_time, world, ckpt, args.set, args.repeats, out, strategy)
                mib, *times = (float(x) for x in Path(out).read_text().split())
                results[label] = (times, mib)
    base = statistics.median(results[rows[0][0]][0])
    rl = cfg.rl
    print(
        f"one update: {rl.prompts_per_iteration} x {rl.num_generations} completions, "
        f"{rl.steps_per_generation} optimizer steps, {os.cpu_count()} CPUs, 1 thread per process"
    )
    print("| setting | median s/update | min | speed-up | rank 0 params + AdamW MiB |")
    print("|---|---|---|---|---|")
    for label, (times, mib) in results.items():
        med = statistics.median(times)
        print(f"| {label} | {med:.2f} | {min(times):.2f} | {base / med:.2f}x | {mib:.2f} |")


if __name__ == "__main__":
    main()

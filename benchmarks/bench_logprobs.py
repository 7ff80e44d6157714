"""Peak memory and time of per-token log-probs: full log-softmax vs chunked gather - logsumexp.

Each (vocab, method, pass) runs in a fresh subprocess, so its peak resident memory
(``resource.getrusage().ru_maxrss``) is its own. "extra peak" is the peak minus the resident
memory right after the bf16 logits were created, i.e. what the log-prob computation itself adds
on top of the logits that a model forward produces anyway. One CPU thread, to be comparable
and to leave the other core free.

    python benchmarks/bench_logprobs.py                   # vocab 32k and 150k, B=2, T=256
    python benchmarks/bench_logprobs.py --batch 4 --seq 512 --vocab 32000
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path


def rss_mib() -> float:
    """Current resident memory (MiB), from /proc (Linux)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def child(vocab: int, batch: int, seq: int, method: str, backward: bool, repeats: int) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
    import torch

    from grpo_core.logprobs.tokens import naive_token_logprobs, token_logprobs

    torch.set_num_threads(1)
    torch.manual_seed(0)
    logits = torch.randn(batch, seq, vocab, dtype=torch.bfloat16)  # [B, T, V] as a model emits
    labels = torch.randint(0, vocab, (batch, seq))  # [B, T]
    fn = naive_token_logprobs if method == "naive" else token_logprobs
    warm = torch.randn(2, 3, 5).requires_grad_(backward)  # load kernels before the baseline
    fn(warm, torch.zeros(2, 3, dtype=torch.long))[0].sum().backward() if backward else None
    base = rss_mib()
    times = []
    for _ in range(repeats):
        x = logits.detach().requires_grad_(backward)
        t0 = time.perf_counter()
        if backward:
            lp, _ = fn(x, labels)
            lp.sum().backward()
        else:
            with torch.no_grad():
                lp, _ = fn(x, labels)
        times.append(time.perf_counter() - t0)
        del x, lp
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux
    return {"extra_peak_mib": max(peak - base, 0.0), "time_s": min(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[32_000, 150_000])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(**json.loads(args.child))))
        return

    rows = []
    for vocab in args.vocab:
        logits_mib = args.batch * args.seq * vocab * 2 / 2**20
        for backward in (False, True):
            for method in ("naive", "chunked"):
                spec = dict(
                    vocab=vocab,
                    batch=args.batch,
                    seq=args.seq,
                    method=method,
                    backward=backward,
                    repeats=args.repeats,
                )
                out = subprocess.run(
                    [sys.executable, __file__, "--child", json.dumps(spec)],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                res = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append(
                    (
                        vocab,
                        logits_mib,
                        "fwd+bwd" if backward else "fwd (no grad)",
                        method,
                        res["extra_peak_mib"],
                        res["time_s"],
                    )
                )

    print(f"B={args.batch} T={args.seq}, bf16 logits, 1 CPU thread, torch CPU\n")
    print("| vocab | bf16 logits MiB | pass | method | extra peak MiB | time s |")
    print("|---:|---:|---|---|---:|---:|")
    for vocab, lmib, mode, method, mib, sec in rows:
        print(f"| {vocab:,} | {lmib:.0f} | {mode} | {method} | {mib:.0f} | {sec:.3f} |")


if __name__ == "__main__":
    main()

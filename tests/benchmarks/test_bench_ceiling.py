"""benchmarks/bench_ceiling.py: the shape arithmetic is the model's (every matmul weight of
a real Llama counted), the roofline takes the slower of compute and memory, and the decode
it times runs every row to its budget (no EOS ends one early)."""

from __future__ import annotations

import torch

from benchmarks.bench_ceiling import Shape, _model, _prompts, decode_ceiling
from grpo_core.engines.generation import SamplingParams, generate

TINY = Shape("tiny", hidden=16, layers=2, heads=2, kv_heads=1, intermediate=32, vocab=64)


def test_the_step_matmuls_are_the_models_linear_weights():
    model = _model(TINY)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert TINY.linear_params() == linear
    # one row's KV at 10 positions: K and V, 2 layers, 1 head of 8, float32
    assert TINY.kv_bytes(10, 4) == 2 * 2 * 8 * 10 * 4


def test_the_ceiling_is_the_slower_of_compute_and_memory():
    weights = TINY.linear_params() * 4
    # memory-bound: compute is free, the step reads the weights and each row's KV
    assert decode_ceiling(TINY, 4, 10, 1e12, 1.0) == 4 / (
        (weights + 4 * TINY.kv_bytes(10, 4)) / 1e9
    )
    # compute-bound: memory is free
    flops = 2 * 4 * TINY.linear_params() + 4 * TINY.attention_flops(10)
    assert decode_ceiling(TINY, 4, 10, 1.0, 1e12) == 4 / (flops / 1e9)


def test_the_timed_decode_runs_every_row_to_its_budget():
    model = _model(TINY)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=0)
    samples = generate(model, _prompts(TINY, 3, 5), params, pad_token_id=0, eos_token_ids=[],
                       progress=False, batch_size=3, max_batch_tokens=None)  # fmt: skip
    assert [len(s.completion_ids) for s in samples] == [12, 12, 12]

"""The hf engine's static decode loop (grpo_core/engines/static_decode.py), the GPU default: the same
completions and sampling log-probs as the dynamic loop, fixed shapes, few host reads.

On a CPU the ``static`` loop runs without CUDA graphs; the ``cuda_graphs`` cases run on a CUDA
machine (``pytest tests/engines/test_static_decode.py`` there, and in the GPU check)."""

from __future__ import annotations

import pytest
import torch
from engines_support import prompts, reference_logprobs
from test_hf_engine import SAMPLING

from grpo_core.engines import static_decode
from grpo_core.engines.generation import SamplingParams, generate
from grpo_core.engines.hf import HFEngine

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("params", SAMPLING, ids=lambda p: repr(p)[15:80])
def test_static_logprobs_equal_a_slow_reference(tiny_model, params):
    model, tok = tiny_model
    ids = prompts(tok, [(1, 2), (123, 4567), (99, 1)])
    engine = HFEngine(model, tok, batch_size=4, decode="static")
    samples = engine.generate(ids, params, progress=False)
    assert engine.last_decode == "static"
    assert len(samples) == 3 * params.n
    for s in samples:
        expected = reference_logprobs(model, ids[s.prompt_index], s, params)
        assert s.logprobs == pytest.approx(expected, abs=1e-4)


def _both(model, tok, ids, params, eos, decode="static"):
    kw = dict(pad_token_id=tok.pad_token_id, eos_token_ids=eos, tokenizer=tok, progress=False)
    a = generate(model, ids, params, decode="dynamic", **kw)
    stats: dict = {}
    b = generate(model, ids, params, decode=decode, stats=stats, **kw)
    return a, b, stats


def _assert_same(a, b):
    assert [s.completion_ids for s in a] == [s.completion_ids for s in b]
    assert [s.finish_reason for s in a] == [s.finish_reason for s in b]
    for x, y in zip(a, b, strict=True):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)


@pytest.mark.parametrize("stop", [(), ("1",), ("0", "<")])
def test_greedy_static_equals_dynamic_with_eos_and_stop_strings(tiny_model, stop):
    model, tok = tiny_model
    ids = prompts(tok, [(1, 2), (123, 4567), (99, 1), (5, 5)])
    params = SamplingParams(n=2, temperature=0, max_new_tokens=40, stop=stop)
    first, _, _ = _both(model, tok, ids, params, tok.eos_token_id)
    # an EOS that some rows meet mid-way and others never: a token of one row's completion
    eos = [first[2].completion_ids[len(first[2].completion_ids) // 2], tok.eos_token_id]
    a, b, stats = _both(model, tok, ids, params, eos)
    assert stats["decode"] == "static"
    assert any(s.finish_reason == "stop" for s in a)
    _assert_same(a, b)


def test_static_reads_the_host_every_few_steps_and_ends_early(tiny_model):
    model, tok = tiny_model
    ids = prompts(tok, [(1, 2), (3, 4)])
    params = SamplingParams(n=2, temperature=0, max_new_tokens=200)
    first, _, _ = _both(model, tok, ids, params, tok.eos_token_id)
    eos = sorted({s.completion_ids[0] for s in first})  # every row ends at its first token
    a, b, stats = _both(model, tok, ids, params, eos)
    _assert_same(a, b)
    assert all(len(s.completion_ids) == 1 for s in b)
    assert stats["steps"] == static_decode.CHECK_EVERY  # not 200: all done at the first read


def test_auto_is_dynamic_on_a_cpu_and_graphs_need_cuda(tiny_model):
    model, tok = tiny_model
    ids = prompts(tok, [(1, 2)])
    stats: dict = {}
    generate(model, ids, SamplingParams(max_new_tokens=4, seed=0), pad_token_id=tok.pad_token_id,
             eos_token_ids=tok.eos_token_id, progress=False, stats=stats)  # fmt: skip
    assert stats["decode"] == ("cuda_graphs" if model.device.type == "cuda" else "dynamic")
    if model.device.type != "cuda":
        with pytest.raises(ValueError, match="CUDA device"):
            generate(model, ids, SamplingParams(max_new_tokens=4), pad_token_id=0,
                     eos_token_ids=1, decode="cuda_graphs", progress=False)  # fmt: skip
    with pytest.raises(ValueError, match="decode must be one of"):
        generate(model, ids, SamplingParams(max_new_tokens=4), pad_token_id=0, eos_token_ids=1,
                 decode="fast", progress=False)  # fmt: skip


def test_flash_attention_models_stay_dynamic(tiny_model):
    model, _ = tiny_model
    impl = model.config._attn_implementation
    try:
        model.config._attn_implementation = "flash_attention_2"
        assert "flash_attention_2" in static_decode.static_unsupported(model)
    finally:
        model.config._attn_implementation = impl


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_equal_dynamic_on_the_gpu(tiny_model, dtype):
    import copy

    model, tok = tiny_model
    model = copy.deepcopy(model).to("cuda", dtype)
    ids = prompts(tok, [(1, 2), (123, 4567), (99, 1), (5, 5)])
    params = SamplingParams(n=2, temperature=0, max_new_tokens=40, stop=("1",))
    first, _, _ = _both(model, tok, ids, params, tok.eos_token_id)
    eos = [first[2].completion_ids[len(first[2].completion_ids) // 2], tok.eos_token_id]
    a, b, stats = _both(model, tok, ids, params, eos, decode="cuda_graphs")
    assert stats["decode"] == "cuda_graphs", "the graph capture failed (see the log)"
    if dtype == torch.float32:
        _assert_same(a, b)
    else:  # bf16 kernels of other shapes may round differently: most tokens agree
        agree = sum(x.completion_ids == y.completion_ids for x, y in zip(a, b, strict=True))
        assert agree >= len(a) // 2

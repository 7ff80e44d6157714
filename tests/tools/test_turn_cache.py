"""The hf engine's KV cache kept across an episode's turns (grpo_core/engines/turn_cache.py):
a turn feeds only its new tokens, the samples are the full recompute's (greedy: token for
token; sampled: log-probs the trainer's recomputation gets), the static loop reuses its
cache and decode step across turns, and an episode's KV goes when it ends.

The model is benchmarks/bench_turn_prefill.py's: a random Qwen2 whose logits are clocked
so that every turn ends with a call, and an environment that answers every call."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_turn_prefill as BENCH
from grpo_core.config.stages import RolloutConfig
from grpo_core.engines import static_decode
from grpo_core.engines.generation import SamplingParams, generate
from grpo_core.engines.hf import HFEngine
from grpo_core.engines.turn_cache import TurnCache
from grpo_core.engines.turns import run_turns

TURNS = 8


@pytest.fixture(scope="module")
def clocked():
    return BENCH.clock_model(hidden_size=32, layers=2)


def _run(model, tok, *, kept: bool, params, decode="dynamic", turns=TURNS, batch_size=512):
    engine = HFEngine(model, tok, decode=decode, turn_cache=kept, batch_size=batch_size)
    out = run_turns(engine, BENCH.prompts(tok, 3), params, desc="t", progress=False,
                    tools=BENCH.spec(turns))  # fmt: skip
    return engine, out


def _budget(turns=TURNS) -> int:
    return (BENCH.TURN + 16) * turns


def _kept_cache_count(tok, samples) -> int:
    """The tokens a loop that keeps each episode's KV feeds: its prompt, then at each later
    turn the last token of the turn before (sampled, never fed) and the observation."""
    total = 0
    for s in samples:
        total += len(BENCH.prompts(tok, 3)[s.prompt_index])
        for tool, nxt in zip(s.turns, s.turns[1:], strict=False):
            if tool["role"] == "tool" and nxt["role"] == "assistant":
                total += tool["end"] - tool["start"] + 1
    return total


class _FedTokens:
    """Counts the real tokens of the model's prefill forwards (more than one token fed), as
    the model sees them: its attention mask over the fed columns (2-D: the dynamic loop)."""

    def __init__(self, model):
        self.n = 0
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
        if ids.shape[1] > 1:
            self.n += int(mask[:, -ids.shape[1] :].sum())


def test_eight_turns_feed_what_a_kept_cache_feeds(clocked):
    model, tok = clocked
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=_budget(), seed=0)
    fed = _FedTokens(model)
    try:
        kept, samples = _run(model, tok, kept=True, params=params)
        seen_kept, fed.n = fed.n, 0
        old, old_samples = _run(model, tok, kept=False, params=params)
    finally:
        fed.handle.remove()
    assert {sum(t["role"] == "assistant" for t in s.turns) for s in samples} == {TURNS}
    ideal = _kept_cache_count(tok, samples)
    assert kept.fed["prefill_tokens"] == seen_kept  # the engine counts what the model got
    assert kept.fed["prefill_tokens"] <= 1.2 * ideal
    # feeding each turn the whole context, as before: over 3x at 8 turns
    assert old.fed["prefill_tokens"] == fed.n
    assert old.fed["prefill_tokens"] > 3 * _kept_cache_count(tok, old_samples)


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_greedy_episodes_equal_the_full_recompute_token_for_token(clocked, decode):
    model, tok = clocked
    params = SamplingParams(n=2, temperature=0, max_new_tokens=_budget())
    # micro-batches of 4: rows of one batch continue from different turns' lengths
    _, a = _run(model, tok, kept=False, params=params, decode=decode, batch_size=4)
    _, b = _run(model, tok, kept=True, params=params, decode=decode, batch_size=4)
    assert [s.completion_ids for s in a] == [s.completion_ids for s in b]
    assert [(s.finish_reason, s.loss_mask) for s in a] == [
        (s.finish_reason, s.loss_mask) for s in b
    ]
    for x, y in zip(a, b, strict=True):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)


@pytest.mark.parametrize("top_k", [0, 5])
def test_sampled_logprobs_are_the_trainers_recomputation(clocked, top_k):
    """Each model token's recorded log-prob (the policy's own, ``policy_logprobs``, where
    top-k processed the distribution) equals one forward over the whole episode."""
    model, tok = clocked
    params = SamplingParams(n=2, temperature=0.8, top_k=top_k, max_new_tokens=_budget(), seed=1)
    _, samples = _run(model, tok, kept=True, params=params)
    prompts = BENCH.prompts(tok, 3)
    for s in samples:
        prompt = prompts[s.prompt_index]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + s.completion_ids])).logits[0].float()
        logp = (logits[len(prompt) - 1 : -1] / params.temperature).log_softmax(-1)
        want = logp.gather(-1, torch.tensor(s.completion_ids)[:, None]).squeeze(-1).tolist()
        got = s.policy_logprobs if top_k else s.logprobs
        model_tokens = [j for j, m in enumerate(s.loss_mask) if m]
        assert [got[j] for j in model_tokens] == pytest.approx(
            [want[j] for j in model_tokens], abs=1e-4
        )


def _count_steps(monkeypatch) -> list:
    """A list that gains an item each time the static loop builds its decode step."""
    made = []

    class Counted(static_decode._Step):
        def __init__(self, *a, **kw):
            made.append(1)
            super().__init__(*a, **kw)

    monkeypatch.setattr(static_decode, "_Step", Counted)
    return made


def test_the_static_loop_builds_its_step_once_not_per_turn(clocked, monkeypatch):
    model, tok = clocked
    made = _count_steps(monkeypatch)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=_budget(), seed=0)
    _run(model, tok, kept=False, params=params, decode="static")
    per_turn = len(made)
    made.clear()
    _run(model, tok, kept=True, params=params, decode="static")
    assert per_turn == TURNS  # one micro-batch a turn, a cache and step (a capture) each
    assert len(made) <= 2  # the rounded shapes recur: the pooled step is replayed


def test_a_batch_mixes_kept_and_fresh_rows_and_kv_goes_when_episodes_end(clocked):
    """A continuing episode next to one with nothing kept (and one whose context no longer
    starts with its kept tokens): the same greedy completions as feeding every context."""
    model, tok = clocked
    kw = dict(pad_token_id=tok.pad_token_id, eos_token_ids=tok.eos_token_id, progress=False,
              tokenizer=tok, decode="dynamic")  # fmt: skip
    greedy = SamplingParams(temperature=0, max_new_tokens=12, stop=("</tool_call>",))
    first = BENCH.prompts(tok, 3)
    turns = TurnCache()
    out = generate(model, first, greedy, turns=turns, episodes=[0, 1, 2], **kw)
    assert set(turns.kept) == {0, 1, 2} and all(s.finish_reason == "stop" for s in out)
    obs = tok.encode("<tool_response>42</tool_response>", add_special_tokens=False)
    contexts = [
        first[0] + out[0].completion_ids + obs,  # continues episode 0
        first[1] + obs,  # episode 1, its history rewritten: fed whole
        first[2][:-1] + obs,  # a new episode
    ]
    again = generate(model, contexts, greedy, turns=turns, episodes=[0, 1, 7], **kw)
    whole = generate(model, contexts, greedy, **kw)
    assert [s.completion_ids for s in again] == [s.completion_ids for s in whole]
    assert set(turns.kept) == {0, 1, 7, 2}  # each episode's newest turn
    turns.drop(2)
    turns.close()
    assert turns.kept == {} and turns.pool == {}


def test_the_option_is_on_for_tools_and_absent_without():
    assert RolloutConfig(tools=["python"]).engine_options("hf")["turn_cache"] is True
    off = RolloutConfig(tools=["python"], hf_turn_cache=False).engine_options("hf")
    assert off["turn_cache"] is False
    assert "turn_cache" not in RolloutConfig().engine_options("hf")  # one turn: as before
    assert HFEngine(None, None, turn_cache=False).turn_cache() is None


def test_the_same_inputs_give_the_same_episodes_bit_for_bit(clocked):
    """A run and its resume replay a rollout from the same inputs: with the kept cache the
    episodes are the same, log-probs to the bit, from a fresh engine each time."""
    model, tok = clocked
    params = SamplingParams(n=2, temperature=1.0, top_p=0.9, max_new_tokens=_budget(4), seed=5)
    a = _run(model, tok, kept=True, params=params, turns=4, batch_size=4)[1]
    b = _run(model, tok, kept=True, params=params, turns=4, batch_size=4)[1]

    def untimed(turns):  # a call's wall time and the loop's stall are the clock's
        return [{k: v for k, v in t.items() if k not in ("seconds", "stalled")} for t in turns]

    assert [(s.completion_ids, s.logprobs, s.policy_logprobs, untimed(s.turns)) for s in a] == [
        (s.completion_ids, s.logprobs, s.policy_logprobs, untimed(s.turns)) for s in b
    ]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_replay_across_turns_and_equal_the_full_recompute(monkeypatch):
    model, tok = BENCH.clock_model(hidden_size=32, layers=2)
    model = model.to("cuda")
    made = _count_steps(monkeypatch)
    params = SamplingParams(n=2, temperature=0, max_new_tokens=_budget())
    _, a = _run(model, tok, kept=False, params=params, decode="dynamic")
    engine, b = _run(model, tok, kept=True, params=params, decode="cuda_graphs")
    assert engine.last_decode == "cuda_graphs", "the graph capture failed (see the log)"
    assert len(made) <= 2
    assert [s.completion_ids for s in a] == [s.completion_ids for s in b]

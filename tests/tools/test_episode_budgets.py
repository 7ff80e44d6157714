"""No episode samples past its own budget: after the first turn the turn loop gives the engine
each episode's budget left (grpo_core/engines/turns.py), and the hf engine ends a sample at its
own (grpo_core/engines/generation.py, static_decode.py: ``budgets``) instead of sampling up to
the batch's largest and cutting.

The model is benchmarks/bench_turn_prefill.py's: a random Qwen2 whose logits are clocked so
that every turn ends with a call, and an environment that answers every call."""

from __future__ import annotations

import pytest

from benchmarks import bench_turn_prefill as BENCH
from grpo_core.engines.generation import SamplingParams, generate
from grpo_core.engines.hf import HFEngine
from grpo_core.engines.turns import run_turns

TURNS = 4


@pytest.fixture(scope="module")
def clocked():
    return BENCH.clock_model(hidden_size=32, layers=2)


class Counting:
    """An engine's ``generate``, counting the completion tokens it returns; ``budgets=False``:
    an engine that does not take them (a user's engine written before them)."""

    def __init__(self, engine, budgets: bool = True):
        self.engine, self.sampled, self.tokenizer = engine, 0, engine.tokenizer
        self.turn_cache = engine.turn_cache
        if budgets:
            self.generate = self._generate_budgets

    def generate(self, prompt_ids, params, *, desc="", progress=True, turns=None, episodes=None):
        return self._count(self.engine.generate(prompt_ids, params, desc=desc, progress=progress,
                                                turns=turns, episodes=episodes))  # fmt: skip

    def _generate_budgets(self, prompt_ids, params, *, desc="", progress=True, turns=None,
                          episodes=None, budgets=None):  # fmt: skip
        return self._count(self.engine.generate(prompt_ids, params, desc=desc, progress=progress,
                                                turns=turns, episodes=episodes, budgets=budgets))  # fmt: skip

    def _count(self, out):
        self.sampled += sum(len(s.completion_ids) for s in out)
        return out


def _episodes(model, tok, decode: str, *, budgets: bool):
    engine = Counting(HFEngine(model, tok, decode=decode), budgets=budgets)
    # a budget the turns cannot all fill: later turns start with different budgets left
    budget = BENCH.TURN * TURNS + 8 * (TURNS - 1)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=budget, seed=0)
    out = run_turns(engine, BENCH.prompts(tok, 8), params, desc="t", progress=False,
                    tools=BENCH.spec(TURNS))  # fmt: skip
    return engine.sampled, out, budget


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_no_episode_samples_past_its_own_budget(clocked, decode):
    model, tok = clocked
    sampled, out, budget = _episodes(model, tok, decode, budgets=True)
    kept = sum(sum(m for m in s.loss_mask) for s in out)  # the model's tokens the episodes hold
    assert sampled == kept
    assert all(len(s.completion_ids) <= budget for s in out)
    assert any(s.finish_reason == "length" for s in out)  # some budgets did run out


def test_without_budgets_a_turn_samples_past_them():
    """What the budgets save: an engine that does not take them samples each turn up to the
    largest budget left, and the episodes cut what is over their own."""
    model, tok = BENCH.clock_model(hidden_size=32, layers=2)
    old_sampled, old, _ = _episodes(model, tok, "dynamic", budgets=False)
    assert old_sampled > sum(sum(m for m in s.loss_mask) for s in old)


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_a_budget_ends_the_sample_where_the_cut_did(clocked, decode):
    """Greedy: each sample is the unbudgeted one cut at its budget, token for token, with
    finish reason ``length`` where the cut fell before its stop."""
    model, tok = clocked
    prompts = BENCH.prompts(tok, 6)
    params = SamplingParams(n=1, temperature=0, max_new_tokens=BENCH.TURN + 4)
    budgets = [1, 3, BENCH.TURN - 1, BENCH.TURN, BENCH.TURN + 4, 2]
    full = generate(model, prompts, params, pad_token_id=tok.pad_token_id,
                    eos_token_ids=tok.eos_token_id, decode=decode, progress=False)  # fmt: skip
    cut = generate(model, prompts, params, pad_token_id=tok.pad_token_id,
                   eos_token_ids=tok.eos_token_id, decode=decode, progress=False,
                   budgets=budgets)  # fmt: skip
    for f, c, b in zip(full, cut, budgets, strict=True):
        assert c.completion_ids == f.completion_ids[:b]
        assert c.logprobs == pytest.approx(f.logprobs[:b], abs=1e-5)
        assert c.finish_reason == ("length" if len(f.completion_ids) > b else f.finish_reason)


def test_an_engine_without_budgets_still_runs_the_turns(clocked):
    model, tok = clocked
    _, a, _ = _episodes(model, tok, "dynamic", budgets=False)
    assert {sum(t["role"] == "assistant" for t in s.turns) for s in a} <= set(range(1, TURNS + 1))

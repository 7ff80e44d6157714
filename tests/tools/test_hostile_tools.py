"""Function tools and environments written as the docs invite, or carelessly, cannot stop the
batch (grpo_core/engines/bounded.py, functions.py, turns.py): a call that blocks is answered
at ``tool_timeout_s``; a huge answer is cut by characters before it is tokenised; calls past
``max_calls_per_turn`` are not run; ``SystemExit``/``KeyboardInterrupt``, a ``step`` that
returns a ``str``, an ``int`` or ``Observation(None)``, and return values JSON cannot hold are
each one error observation; a failed ``reset`` is the reward's error; a factory that raises is
refused by preflight; environment rewards are numbers as reward functions' are."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import grpo_core.engines.functions as functions
from grpo_core.engines.environments import Observation, ToolSpec
from grpo_core.engines.generation import SamplingParams
from grpo_core.engines.turns import run_turns
from grpo_core.errors import UserError
from grpo_core.rewards.scoring import score_completions
from tests.tools import test_json_tools as jt
from tests.tools.test_turn_loop import PROMPTS, ScriptedEngine

RELEASE = threading.Event()  # lets the blocked function's thread end with the test


def blocks(x: str) -> str:
    """Wait for a long time.

    Args:
        x: ignored
    """
    RELEASE.wait(60)
    return "late"


def huge(x: str) -> str:
    """Answer with 5 MB.

    Args:
        x: ignored
    """
    return "7" * 5_000_000


def exits(x: str) -> str:
    """Exit the process.

    Args:
        x: ignored
    """
    raise SystemExit(3)


def interrupts(x: str) -> str:
    """Raise KeyboardInterrupt.

    Args:
        x: ignored
    """
    raise KeyboardInterrupt


class Unprintable:
    def __str__(self):
        raise RuntimeError("no str")

    __repr__ = __str__


def circular(x: str) -> list:
    """Return a list holding itself.

    Args:
        x: ignored
    """
    a: list = []
    a.append(a)
    return a


def tuple_keys(x: str) -> dict:
    """Return a dict with tuple keys.

    Args:
        x: ignored
    """
    return {(1, 2): 3}


def unprintable(x: str) -> object:
    """Return an object whose str raises.

    Args:
        x: ignored
    """
    return Unprintable()


def ok(x: str) -> str:
    """Echo.

    Args:
        x: what to echo
    """
    return f"ok {x}"


HOSTILE = [blocks, huge, exits, interrupts, circular, tuple_keys, unprintable, ok]


class Recording:
    """The test tokenizer, recording the longest text it was asked to encode."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def __call__(self, text, *a, **kw):
        self.longest = max(self.longest, len(text) if isinstance(text, str) else 0)
        return self.tok(text, *a, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def run_calls(calls: list[str], *, timeout_s=5.0, max_calls=16, limit=40):
    for fn in HOSTILE:
        functions.FUNCTION_TOOLS.add(fn.__name__, fn, replace=True)
    names = tuple(fn.__name__ for fn in HOSTILE)
    try:
        row = {**jt.ROW, "tools": json.dumps(functions.function_schemas(names))}
        model = jt.ChatModel([["".join(calls)], ["<answer>51</answer>"]])
        model.tokenizer = Recording(jt.TOK)
        spec = ToolSpec(tools=("functions",), functions=names, max_tool_output_tokens=limit,
                        tool_timeout_s=timeout_s, max_calls_per_turn=max_calls)  # fmt: skip
        (ep,) = run_turns(model, [jt.row_prompt_ids(jt.TOK, row)],
                          SamplingParams(max_new_tokens=4000), desc="t", progress=False,
                          tools=spec, rows=[row])  # fmt: skip
    finally:
        for fn in HOSTILE:
            functions.FUNCTION_TOOLS.remove(fn.__name__)
    return ep, model.tokenizer


def tool_text(ep) -> str:
    tool = ep.turns[1]
    return jt.TOK.decode(ep.completion_ids[tool["start"] : tool["end"]])


def test_a_blocking_function_is_answered_at_its_deadline_and_the_turn_goes_on():
    RELEASE.clear()
    start = time.monotonic()
    try:
        ep, _ = run_calls([jt.call("blocks", x="a"), jt.call("ok", x="b")], timeout_s=0.5,
                          limit=400)  # fmt: skip
    finally:
        RELEASE.set()
    assert time.monotonic() - start < 20  # it waited 60 s before
    assert "TimeoutError: function 'blocks' did not return within 0.5 s" in ep.turns[1]["error"]
    assert "ok b" in tool_text(ep) and ep.turns[-1]["role"] == "assistant"


def test_a_huge_answer_is_cut_by_characters_before_it_is_tokenised():
    ep, tok = run_calls([jt.call("huge", x="a")], limit=40)
    assert tok.longest < 40 * 64  # not the 5,000,000 characters
    assert "...(truncated)" in tool_text(ep)
    assert ep.turns[1]["error"] is None


def test_calls_past_the_cap_are_answered_with_an_error_not_run():
    ep, _ = run_calls([jt.call("ok", x=str(i)) for i in range(4)], max_calls=2, limit=400)
    text = tool_text(ep)
    assert "ok 0" in text and "ok 1" in text and "ok 2" not in text
    assert text.count("over 2 calls per turn, not run") == 2


@pytest.mark.parametrize("name", ["exits", "interrupts", "circular", "tuple_keys", "unprintable"])
def test_what_a_function_raises_or_returns_is_its_own_error(name):
    ep, _ = run_calls([jt.call(name, x="a"), jt.call("ok", x="b")], limit=400)
    text = tool_text(ep)
    assert text.count("<tool_response>\nError: ") == 1 and "ok b" in text, text  # others kept
    assert "<tool_response>\nError: " in text  # in the template's layout
    assert ep.turns[1]["error"] is not None
    assert ep.turns[-1]["role"] == "assistant"


class Returns:
    """A user environment whose ``step`` returns what the row says (or raises, or blocks)."""

    def __init__(self, spec):
        self.spec = spec

    def start(self, row):
        return ReturnsEpisode(row["give"])


class ReturnsEpisode:
    def __init__(self, give):
        self.give = give

    def step(self, turn):
        if self.give == "str":
            return "<tool_response>42</tool_response>"
        if self.give == "int":
            return 7
        if self.give == "none_text":
            return Observation(None)
        if self.give == "exit":
            raise SystemExit(1)
        if self.give == "interrupt":
            raise KeyboardInterrupt
        if self.give == "block":
            RELEASE.wait(60)
        if self.give == "huge":
            return Observation("<tool_response>" + "7" * 5_000_000 + "</tool_response>")
        return None


@pytest.mark.parametrize("give", ["str", "int", "none_text", "exit", "interrupt", "block", "huge"])
def test_what_a_step_returns_or_raises_is_one_observation(give):
    spec = ToolSpec(tools=("tests.tools.test_hostile_tools:Returns",), max_tool_output_tokens=20,
                    tool_timeout_s=0.5)  # fmt: skip
    engine = ScriptedEngine([["<tool_call>1</tool_call>"], ["<answer>1</answer><|eos|>"]])
    RELEASE.clear()
    try:
        (got,) = run_turns(engine, PROMPTS[:1], SamplingParams(max_new_tokens=200), desc="t",
                           progress=False, tools=spec, rows=[{"give": give}])  # fmt: skip
    finally:
        RELEASE.set()
    tool = got.turns[1]
    assert tool["role"] == "tool" and got.turns[-1]["role"] == "assistant"
    if give == "str":
        assert tool["text"] == "<tool_response>42</tool_response>" and tool["error"] is None
    elif give == "huge":  # cut to its budget (the demo vocabulary cannot spell the mark)
        assert tool["end"] - tool["start"] == 20 and tool["text"].endswith("7</tool_response>")
    else:
        expected = {"int": "returned int", "none_text": "text is NoneType",
                    "exit": "SystemExit", "interrupt": "KeyboardInterrupt",
                    "block": "TimeoutError"}[give]  # fmt: skip
        assert expected in tool["error"], tool["error"]
        assert tool["text"].startswith("<tool_response>")


class FailedReset:
    def __init__(self, spec):
        pass

    def start(self, row):
        return FailedResetEpisode()


class FailedResetEpisode:
    def reset(self):
        raise ValueError("no board")

    def step(self, turn):
        return None

    def reward(self):
        return 1.0


def test_a_failed_reset_is_the_rewards_error():
    spec = ToolSpec(tools=("tests.tools.test_hostile_tools:FailedReset",))
    engine = ScriptedEngine([["<answer>1</answer><|eos|>"]])
    (got,) = run_turns(engine, PROMPTS[:1], SamplingParams(max_new_tokens=40), desc="t",
                       progress=False, tools=spec, rows=[{"prompt": "x"}])  # fmt: skip
    assert got.env["reward"] is None
    assert "reset() failed: ValueError: no board" in got.env["error"]


def raising_factory(spec):
    raise RuntimeError("cannot reach the game server")


def test_a_factory_that_raises_is_refused_by_preflight():
    from flows.config import load_config
    from flows.preflight.tools import check_tools

    tools = Path(__file__).resolve().parents[2] / "configs" / "demo-tools.yaml"
    cfg = load_config(tools, ["rollout.tools=[tests.tools.test_hostile_tools:raising_factory]"])
    with pytest.raises(UserError, match="raised when built .*cannot reach the game server"):
        check_tools(cfg)


def test_environment_rewards_are_numbers_as_reward_functions_are():
    from grpo_core.engines.trajectory import env_reward

    class R:
        def __init__(self, v):
            self.v = v

        def reward(self):
            return self.v

    assert env_reward(R(np.float32(0.5))) == {"reward": 0.5, "error": None}
    assert env_reward(R(np.int64(1)))["reward"] == 1.0
    res = score_completions(["p"] * 3, ["c"] * 3, {"env_reward": [1e308, -1e308, 1.0],
                            "env_reward_error": [None] * 3}, {"environment": 1.0})  # fmt: skip
    assert res.per_function["environment"] == [None, None, 1.0]
    assert "beyond" in res.errors["environment"][0]
    assert res.total[2] == 1.0


def test_a_mark_as_long_as_the_budget_still_keeps_one_token_of_the_output():
    from grpo_core.contracts.observations import encode_mark, encode_tool_messages

    mark = encode_mark(jt.TOK, "...(truncated)")
    messages = [{"role": "tool", "name": "ok", "content": "123456789" * 10}]
    ids = encode_tool_messages(jt.TOK, messages, len(mark), mark)
    text = jt.TOK.decode(ids)
    assert "\n1...(truncated"[: len(mark)] in text  # one token of output, then the mark


def test_trls_get_reward_is_the_episodes_reward():
    from grpo_core.engines.trajectory import env_reward

    class TrlStyle:
        def get_reward(self):
            return 0.25

    assert env_reward(TrlStyle()) == {"reward": 0.25, "error": None}


def test_trls_uncapped_tool_calling_iterations_are_accepted():
    from grpo_core.config.stages import UNCAPPED_TURNS, RolloutConfig

    cfg = RolloutConfig(tools=["python"], max_tool_calling_iterations=None)
    assert cfg.max_turns == UNCAPPED_TURNS
    assert RolloutConfig(tools=["python"], max_tool_calling_iterations=2).max_turns == 3

"""The turn loop (grpo_core/engines/turns.py) with a scripted engine (it answers each turn from a
script, as a model would) and the real python tool in the code sandbox: token in, token out,
masks, budgets, turn limits, and an observation clipped to its budget."""

from __future__ import annotations

import pytest
import torch

from grpo_core.algorithm.losses import policy_loss
from grpo_core.demo.model import build_tokenizer
from grpo_core.engines.environments import Observation, ToolSpec
from grpo_core.engines.generation import Sample, SamplingParams
from grpo_core.engines.turns import run_turns

TOK = build_tokenizer("tools")


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


class ScriptedEngine:
    """Answers the k-th generate call's i-th context with ``script[k][i]`` (text; EOS
    appended when it ends with ``<|eos|>``), recording every context it was given.
    ``tokenizer``: how it spells its text (default the tool demo's)."""

    name = "scripted"

    def __init__(self, script: list[list[str]], tokenizer=TOK) -> None:
        self.script, self.calls, self.tokenizer = script, [], tokenizer

    def generate(self, prompt_ids, params, *, desc="", progress=True):
        k = len(self.calls)
        self.calls.append((list(map(list, prompt_ids)), params))
        out = []
        for p in range(len(prompt_ids)):
            for s in range(params.n):
                text = self.script[k][p * params.n + s]
                done_eos = text.endswith("<|eos|>")
                tok = self.tokenizer
                got = tok.encode(text.removesuffix("<|eos|>"), add_special_tokens=False)
                got += [tok.eos_token_id] if done_eos else []
                cut = got[: params.max_new_tokens]
                stop_hit = text.endswith("</tool_call>") and "</tool_call>" in params.stop
                reason = "stop" if (done_eos or stop_hit) and len(cut) == len(got) else "length"
                out.append(Sample(p, s, cut, [-0.25] * len(cut), reason))
        return out


SPEC = ToolSpec(max_turns=3, max_tool_output_tokens=12)
PROMPTS = [ids("<|user|>357*46<|assistant|>"), ids("<|user|>12*3<|assistant|>")]


def test_each_turn_continues_from_the_exact_ids_and_tool_tokens_are_masked():
    engine = ScriptedEngine(
        [
            ["<think><tool_call>357*46</tool_call>", "<answer>36</answer><|eos|>"],
            ["</think><answer>16422</answer><|eos|>"],
        ]
    )
    params = SamplingParams(n=1, max_new_tokens=48, seed=3)
    got = run_turns(engine, PROMPTS, params, desc="t", progress=False, tools=SPEC)
    first, second = got
    turn1 = ids("<think><tool_call>357*46</tool_call>")
    obs = ids("<tool_response>16422</tool_response>")
    # turn 2 got prompt + turn 1 + the observation, as ids: nothing re-rendered
    (contexts, p2) = engine.calls[1]
    assert contexts == [PROMPTS[0] + turn1 + obs]
    assert p2.n == 1 and p2.seed != params.seed and "</tool_call>" in p2.stop
    turn2 = ids("</think><answer>16422</answer>") + [TOK.eos_token_id]
    assert first.completion_ids == turn1 + obs + turn2
    assert first.loss_mask == [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
    assert first.logprobs[len(turn1) : len(turn1) + len(obs)] == [0.0] * len(obs)
    roles = [(t["role"], t["start"], t["end"]) for t in first.turns]
    n1, n2 = len(turn1), len(turn1) + len(obs)
    assert roles == [("assistant", 0, n1), ("tool", n1, n2), ("assistant", n2, n2 + len(turn2))]
    assert first.turns[1]["text"] == "<tool_response>16422</tool_response>"
    assert first.turns[1]["error"] is None and first.turns[1]["seconds"] > 0
    assert first.finish_reason == "stop"
    # no call: one turn, all the model's
    assert second.loss_mask == [1] * len(second.completion_ids)
    assert [t["role"] for t in second.turns] == ["assistant"]


def test_the_budget_bounds_the_whole_trajectory():
    engine = ScriptedEngine(
        [["<tool_call>2*3</tool_call>"], ["<tool_call>4*5</tool_call>"], ["never asked"]]
    )
    budget = len(ids("<tool_call>2*3</tool_call><tool_response>6</tool_response>")) + 3
    params = SamplingParams(n=1, max_new_tokens=budget)
    (got,) = run_turns(engine, PROMPTS[:1], params, desc="t", progress=False, tools=SPEC)
    assert len(got.completion_ids) == budget  # turn 2 cut to what was left
    assert engine.calls[1][1].max_new_tokens == 3
    assert got.finish_reason == "length"
    assert len(engine.calls) == 2


def test_max_turns_ends_the_episode_and_a_failing_call_is_an_observation():
    engine = ScriptedEngine(
        [["<tool_call>0**-1</tool_call>"], ["<tool_call>2*2</tool_call>"], ["x"]]
    )
    spec = ToolSpec(max_turns=2, max_tool_output_tokens=8)
    (got,) = run_turns(engine, PROMPTS[:1], SamplingParams(max_new_tokens=64), desc="t",
                       progress=False, tools=spec)  # fmt: skip
    assert len(engine.calls) == 2  # the second turn's call is not run: no third turn
    tool = [t for t in got.turns if t["role"] == "tool"]
    assert len(tool) == 1 and "ZeroDivisionError" in tool[0]["error"]
    obs = got.completion_ids[tool[0]["start"] : tool[0]["end"]]
    assert len(obs) == 8 and obs[-1] == TOK.convert_tokens_to_ids("</tool_response>")


class RowEnv:
    """A user environment: the observation is the row's answer; a row marked ``stop`` ends
    the episode at its first call."""

    def __init__(self, spec):
        self.spec = spec

    def start(self, row):
        return RowEpisode(row)


class RowEpisode:
    def __init__(self, row):
        self.row = row

    def step(self, turn):
        if self.row.get("stop"):
            return None
        return Observation(f"<tool_response>{self.row['answer']}</tool_response>")


def test_a_user_environment_gets_the_row_and_may_end_the_episode():
    spec = ToolSpec(tools=("tests.tools.test_turn_loop:RowEnv",))
    engine = ScriptedEngine([["<tool_call>1</tool_call>"] * 4, ["<answer>7</answer><|eos|>"] * 2])
    rows = [{"answer": "7"}, {"answer": "9", "stop": True}]
    got = run_turns(engine, PROMPTS, SamplingParams(n=2, max_new_tokens=40), desc="t",
                    progress=False, tools=spec, rows=rows)  # fmt: skip
    assert [len(s.turns) for s in got] == [3, 3, 1, 1]
    assert got[0].turns[1]["text"] == "<tool_response>7</tool_response>"
    assert engine.calls[1][0][0][-len(ids("7</tool_response>")) :] == ids("7</tool_response>")


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_masked_tool_tokens_are_as_if_removed(loss_type):
    """The loss of a batch with tool tokens masked equals, in float64, the loss of the same
    batch with those tokens removed (per-token log-probs given): no normaliser counts them."""
    gen = torch.Generator().manual_seed(0)
    B, T = 3, 10
    logp = -torch.rand(B, T, generator=gen, dtype=torch.float64)
    old = logp + 0.05 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 0.25], dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[0, 3:6] = 0  # a tool call's output in row 0
    mask[2, 7:] = 0  # row 2 is shorter (padding)
    tool = torch.zeros(B, T, dtype=torch.bool)
    tool[0, 3:6] = True
    kept = [[j for j in range(T) if not tool[i, j]] for i in range(B)]
    L = max(map(len, kept))

    def squeeze(x):
        out = torch.zeros(B, L, dtype=torch.float64)
        for i, cols in enumerate(kept):
            out[i, : len(cols)] = x[i, cols]
        return out

    cfg = {"loss_type": loss_type, "max_completion_length": T}
    a, _ = policy_loss(logp, old, adv, mask, **cfg)
    b, _ = policy_loss(squeeze(logp), squeeze(old), adv, squeeze(mask), **cfg)
    assert a.dtype == torch.float64
    assert torch.allclose(a, b, rtol=0, atol=1e-15)


class BrokenEnv:
    def __init__(self, spec):
        pass

    def start(self, row):
        return self

    def step(self, turn):
        raise RuntimeError("the environment broke")


def test_an_environment_that_raises_is_recorded_not_fatal():
    spec = ToolSpec(tools=("tests.tools.test_turn_loop:BrokenEnv",), max_tool_output_tokens=40)
    engine = ScriptedEngine([["<tool_call>1</tool_call>"], ["<answer>1</answer><|eos|>"]])
    (got,) = run_turns(engine, PROMPTS[:1], SamplingParams(max_new_tokens=60), desc="t",
                       progress=False, tools=spec)  # fmt: skip
    tool = got.turns[1]
    assert tool["role"] == "tool" and tool["error"] == "RuntimeError: the environment broke"
    assert got.turns[-1]["role"] == "assistant" and got.finish_reason == "stop"


def test_a_template_that_rewrites_history_cannot_change_earlier_ids():
    """A chat template that drops earlier reasoning (as R1-style templates do) would render
    the conversation so far differently from what the model produced; the turn loop never
    re-renders: turn 2 continues from the exact ids of the prompt and turn 1."""
    tok = build_tokenizer("tools")
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
        "{% else %}<|assistant|>{{ m['content'].split('</think>')[-1] }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    turn1 = "<think><tool_call>12*3</tool_call>"
    engine = ScriptedEngine([[turn1], ["</think><answer>36</answer><|eos|>"]])
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "12*3"}], add_generation_prompt=True, tokenize=False
    )
    prompt_ids = ids(prompt)
    (got,) = run_turns(engine, [prompt_ids], SamplingParams(max_new_tokens=40), desc="t",
                       progress=False, tools=SPEC)  # fmt: skip
    (context,), _ = engine.calls[1]
    obs = "<tool_response>36</tool_response>"
    assert context == prompt_ids + ids(turn1) + ids(obs)
    # the conversation re-rendered by that template would have lost the reasoning
    episode = tok.decode(got.completion_ids, skip_special_tokens=True)
    rerendered = tok.apply_chat_template(
        [{"role": "user", "content": "12*3"}, {"role": "assistant", "content": episode}],
        tokenize=False,
    )
    assert ids(rerendered)[: len(context)] != context
    assert got.completion_ids[: len(context) - len(prompt_ids)] == context[len(prompt_ids) :]

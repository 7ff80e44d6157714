"""An environment's reset hook adds to the prompt (TRL's environment ``reset``, verifiers'
``setup_state``): the episode's ``reset()`` returns text or messages, the model samples
from the prompt with them (its prompt token ids), the rollout file records that prompt
(``prompt_ids``, ``prompt_text``, ``episode_prompt``), the added tokens are the prompt's
(never in the completion mask), reward functions and the held-out evals see it too, and a
``reset()`` that fails is an error on its episode, not a crash."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

from grpo_core.algorithm import iteration
from grpo_core.algorithm.evaluation import evaluate
from grpo_core.algorithm.scored_batch import ScoredRows
from grpo_core.config.tools import ToolSpec
from grpo_core.contracts.io import write_parquet
from grpo_core.contracts.text import extend_prompt
from grpo_core.engines.environments import Observation
from grpo_core.engines.generation import SamplingParams, generate
from grpo_core.engines.hf import HFEngine
from grpo_core.engines.turns import run_turns
from tasks.score import score_file
from tests.tools.test_turn_loop import PROMPTS, ScriptedEngine

HINT = ", 2+2=4, "  # the line the environment adds (the demo's characters)
ROWS = [
    {"prompt": "12+34=", "answer": "46", "hint": True},
    {"prompt": "5+6=", "answer": "11", "hint": False},  # its reset adds nothing
]


class HintEpisode:
    def __init__(self, row):
        self.row = row

    def reset(self):
        return HINT if self.row.get("hint") else None

    def step(self, model_turn: str) -> Observation | None:
        return None  # one turn


class Hint:
    def __init__(self, spec):
        self.spec = spec

    def start(self, row):
        return HintEpisode(row)


def make_hint(spec):
    return Hint(spec)


def saw_hint(prompts, completions, **_):
    """A reward that pays the prompts carrying the added line."""
    return [float(HINT in p) for p in prompts]


SPEC = ToolSpec(tools=("tests.tools.test_env_reset:make_hint",), max_turns=2)


@pytest.fixture(scope="module")
def hf(tiny_checkpoint):
    from grpo_core.training.checkpoint import load_checkpoint

    model, tok = load_checkpoint(tiny_checkpoint)
    return HFEngine(model=model, tokenizer=tok, decode="dynamic"), model, tok


def test_the_added_line_is_in_the_prompt_ids_and_out_of_the_completion_mask(hf, tmp_path):
    engine, model, tok = hf
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=10, seed=7)
    table = iteration.sample(engine, tok, ROWS, params, policy_id="p", progress=False,
                             tools=SPEC)  # fmt: skip
    rows = table.to_pylist()
    with_hint = tok("12+34=" + HINT, add_special_tokens=False)["input_ids"]
    plain = tok("5+6=", add_special_tokens=False)["input_ids"]
    assert [r["prompt_ids"] for r in rows] == [with_hint] * 3 + [plain] * 3
    assert [r["episode_prompt"] for r in rows] == ["12+34=" + HINT] * 3 + ["5+6="] * 3
    assert [r["prompt"] for r in rows] == ["12+34="] * 3 + ["5+6="] * 3  # the data's
    assert rows[0]["prompt_text"] == "12+34=" + HINT and rows[3]["prompt_text"] == "5+6="
    # the model sampled from the extended prompt: the same draws as a plain generate of it
    want = generate(model, [with_hint] * 3 + [plain] * 3, SamplingParams(
        n=1, temperature=1.0, max_new_tokens=10, seed=7, stop=(SPEC.tool_call_end,)), progress=False,
        pad_token_id=tok.pad_token_id, eos_token_ids=tok.eos_token_id, tokenizer=tok,
        decode="dynamic")  # fmt: skip
    assert [r["completion_ids"] for r in rows] == [s.completion_ids for s in want]
    # the added tokens are the prompt's: the completion mask covers the completion only
    assert all(r["loss_mask"] == [1] * len(r["completion_ids"]) for r in rows)
    write_parquet(table, tmp_path / "rollouts.parquet")
    out = score_file(str(tmp_path / "rollouts.parquet"), str(tmp_path / "scored.parquet"),
                     {f"{__file__}:saw_hint": 1.0})  # fmt: skip
    scored = pq.read_table(out.path)
    assert scored.column("reward").to_pylist() == [1.0] * 3 + [0.0] * 3  # rewards saw it
    batch = ScoredRows.read(out.path).batch(tok.pad_token_id, mask_truncated=False,
                                            sampling_logprobs=False)  # fmt: skip
    P = batch.prompt_width
    for i, r in enumerate(rows):
        n = len(r["completion_ids"])
        assert batch.input_ids[i, P - len(r["prompt_ids"]) : P].tolist() == r["prompt_ids"]
        assert batch.completion_mask[i, :n].tolist() == [1.0] * n
        assert batch.completion_mask[i, n:].sum() == 0
        assert batch.input_ids[i, P : P + n].tolist() == r["completion_ids"]


def test_a_held_out_eval_samples_from_the_extended_prompt(hf):
    engine, _, tok = hf
    result = evaluate(None, tok, ROWS, max_new_tokens=6, engine=engine, tools=SPEC)
    assert [r["prompt"] for r in result.table] == ["12+34=" + HINT, "5+6="]


def test_text_goes_to_the_last_user_message_and_messages_after_the_prompt(hf):
    engine, _, tok = hf
    chat = [{"role": "user", "content": "12+34="}]
    assert extend_prompt(chat, HINT) == [{"role": "user", "content": "12+34=" + HINT}]
    assert chat == [{"role": "user", "content": "12+34="}]  # the data row is not changed
    more = [{"role": "user", "content": "7"}]
    assert extend_prompt(chat, more) == chat + more
    with pytest.raises(ValueError, match="plain text"):
        extend_prompt("12+34=", more)
    with pytest.raises(TypeError, match="reset"):
        extend_prompt("12+34=", 3)
    rows = [{"prompt": chat, "answer": "46", "hint": True}]
    table = iteration.sample(engine, tok, rows, SamplingParams(n=1, max_new_tokens=4, seed=1),
                             policy_id="p", progress=False, tools=SPEC)  # fmt: skip
    (row,) = table.to_pylist()
    text = "<|user|>12+34=" + HINT + "<|assistant|>"  # the added line before the generation prompt
    assert row["prompt_text"] == text
    assert row["prompt_ids"] == tok(text, add_special_tokens=False)["input_ids"]


class FailingReset(HintEpisode):
    def reset(self):
        raise KeyError("hint")

    def step(self, model_turn):
        return Observation("<tool_response>ok</tool_response>")


def make_failing(spec):
    env = Hint(spec)
    env.start = FailingReset
    return env


def test_a_failing_reset_is_an_error_on_its_episode_and_the_prompt_stays():
    engine = ScriptedEngine([["<tool_call>1</tool_call>"] * 2, ["<|eos|>"] * 2])
    spec = ToolSpec(tools=("tests.tools.test_env_reset:make_failing",), max_turns=2)
    got = run_turns(engine, PROMPTS, SamplingParams(n=1, max_new_tokens=40), desc="t",
                    progress=False, tools=spec, rows=ROWS)  # fmt: skip
    assert engine.calls[0][0] == PROMPTS  # nothing added
    assert all(s.prompt_ids is None and s.prompt is None for s in got)
    errors = [t["error"] for s in got for t in s.turns if t["role"] == "tool"]
    assert errors == ["RuntimeError: the environment's reset() failed: KeyError: 'hint'"] * 2


def test_each_episode_samples_its_own_prompt_once_with_the_same_seed():
    """Through any engine (the turn loop is above them): one context per episode, n=1,
    the request's seed (vLLM then seeds episode i as child i of its prompt would be)."""
    engine = ScriptedEngine([["<answer>1</answer><|eos|>"] * 4])
    params = SamplingParams(n=2, max_new_tokens=20, seed=5)
    got = run_turns(engine, PROMPTS, params, desc="t", progress=False, tools=SPEC, rows=ROWS)
    contexts, sent = engine.calls[0]
    added = ScriptedEngine([]).tokenizer(HINT, add_special_tokens=False)["input_ids"]
    assert len(contexts) == 4 and (sent.n, sent.seed) == (1, 5)
    assert contexts[2:] == [PROMPTS[1]] * 2  # the second row's reset added nothing
    assert [(s.prompt_index, s.sample_index) for s in got] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert got[0].prompt == "12+34=" + HINT and got[2].prompt is None
    assert got[0].prompt_ids == contexts[0] and contexts[0][-len(added) :] == added
    assert torch.tensor(got[0].loss_mask).all()  # none of the prompt's tokens in the episode


def test_the_rollout_stage_records_what_the_model_saw(tiny_checkpoint, tmp_path):
    """The pipeline's rollout task (tasks/rollout.py) with the hf engine."""
    from grpo_core.training.checkpoint import load_tokenizer
    from tasks.policies.trainer import open_trainer
    from tasks.rollout import sample_rollouts

    open_trainer().forget()
    out = tmp_path / "rollouts.parquet"
    sample_rollouts(str(tiny_checkpoint), ROWS, str(out), num_generations=2, temperature=1.0,
                    max_completion_length=8, iteration=0, seed=3,
                    tools={"tools": ["tests.tools.test_env_reset:make_hint"], "max_turns": 2})  # fmt: skip
    rows = pq.read_table(out).to_pylist()
    assert [r["prompt_text"] for r in rows] == ["12+34=" + HINT] * 2 + ["5+6="] * 2
    tok = load_tokenizer(tiny_checkpoint)
    for r in rows:
        assert r["prompt_ids"] == tok(r["prompt_text"], add_special_tokens=False)["input_ids"]
    assert [len(r["loss_mask"]) for r in rows] == [len(r["completion_ids"]) for r in rows]


LONG = ", " + "1+1=2, " * 30  # 212 characters: the demo's char tokenizer, a token each


class LongEpisode(HintEpisode):
    def reset(self):
        return LONG if self.row.get("hint") else None

    def step(self, model_turn):
        return Observation("<tool_response>ok</tool_response>")


def make_long(spec):
    env = Hint(spec)
    env.start = LongEpisode
    return env


def test_a_reset_that_leaves_no_room_for_the_completion_is_an_error_on_its_episode():
    """The prompt as extended has no position left for a completion token: that episode
    samples from its prompt as given (not cut to fit) and its tool calls answer with the
    error, as a failing reset's; the other row's episode runs as usual."""
    engine = ScriptedEngine([["<tool_call>1</tool_call>"] * 2, ["<|eos|>"] * 2])
    spec = ToolSpec(tools=("tests.tools.test_env_reset:make_long",), max_turns=2)
    context = len(PROMPTS[0]) + 40  # the data's prompts fit, with max_new_tokens=40
    got = run_turns(engine, PROMPTS, SamplingParams(n=1, max_new_tokens=40), desc="t",
                    progress=False, tools=spec, rows=ROWS, context=context)  # fmt: skip
    assert engine.calls[0][0] == PROMPTS  # nothing added, nothing cut
    assert all(s.prompt_ids is None and s.prompt is None for s in got)
    errors = [t["error"] for s in got for t in s.turns if t["role"] == "tool"]
    assert errors[1] is None
    assert errors[0].startswith("RuntimeError: the environment's reset() made the prompt too")
    assert f"and the model has {context:,} positions" in errors[0]


def test_rollouts_keep_within_the_model_positions_when_a_reset_extends_the_prompt(hf):
    """Through the rollout path with the hf engine and the model's real positions (256): a
    reset that pushes the prompt past them leaves the row's prompt as given; one that still
    fits samples from the extended prompt with the positions left as its budget (3 here, so
    its completions end at 3 tokens, ``length``); every row's prompt + completion fits."""
    engine, model, tok = hf
    context = model.config.max_position_embeddings
    near = "1" * (context - len(LONG) - 3)  # + LONG: 3 positions left of the 40 asked for
    far = "2" * 100  # fits with 40 more; + LONG's 212 tokens, over the positions
    rows = [{"prompt": p, "answer": "1", "hint": True} for p in (near, far)]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=40, seed=3)
    spec = ToolSpec(tools=("tests.tools.test_env_reset:make_long",), max_turns=1)
    table = iteration.sample(engine, tok, rows, params, policy_id="p", progress=False,
                             tools=spec, context=context)  # fmt: skip
    out = table.to_pylist()
    assert [r["episode_prompt"] for r in out] == [near + LONG] * 2 + [far] * 2
    extended = tok(near + LONG, add_special_tokens=False)["input_ids"]
    given = tok(far, add_special_tokens=False)["input_ids"]
    assert [r["prompt_ids"] for r in out] == [extended] * 2 + [given] * 2  # far's not cut
    assert len(extended) == context - 3
    assert [(len(r["completion_ids"]), r["finish_reason"]) for r in out[:2]] == [(3, "length")] * 2
    for r in out:
        assert len(r["prompt_ids"]) + len(r["completion_ids"]) <= context

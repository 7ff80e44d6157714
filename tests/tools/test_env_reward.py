"""An environment that owns its reward (TRL's ``environments=``, verl's ``calc_reward``): an
episode's ``reward()``, asked once the episode ends, lands in the rollout file's ``env_reward``
column and the ``environment`` reward function pays it, from the file alone; a ``reward()``
that raises or returns something else is an error on that row, not a crash."""

from __future__ import annotations

import re

import pyarrow.parquet as pq
import pytest

from grpo_core.config.tools import ToolSpec
from grpo_core.contracts.io import write_parquet
from grpo_core.contracts.rollouts import rollout_table
from grpo_core.engines.generation import SamplingParams
from grpo_core.engines.turns import run_turns
from grpo_core.errors import UserError
from tasks.score import score_file
from tests.tools.test_tool_answers import PROMPTS, ROWS, TOK, GuessEpisode, Scripted


class Scored(GuessEpisode):
    """The guessing game, paying 1 / (number of guesses) once the number is found."""

    def __init__(self, target, spec):
        super().__init__(target, spec)
        self.guesses, self.found = 0, False

    def step(self, model_turn):
        obs = super().step(model_turn)
        if obs is not None:
            self.guesses += 1
            self.found = self.found or "correct" in obs.text
        return obs

    def reward(self):
        if not self.guesses:
            raise RuntimeError("no guess was made")
        return 1.0 / self.guesses if self.found else 0.0


class ScoredGuess:
    def __init__(self, spec):
        self.spec = spec

    def start(self, row):
        return Scored(int(row["answer"]), self.spec)


def make_scored_guess(spec):
    return ScoredGuess(spec)


class Broken(Scored):
    def reward(self):
        return "high"


def make_broken(spec):
    env = ScoredGuess(spec)
    env.start = lambda row: Broken(int(row["answer"]), spec)
    return env


def _episodes(env: str, script):
    spec = ToolSpec(tools=(f"tests.tools.test_env_reward:{env}",), max_turns=4)
    return run_turns(Scripted(script), PROMPTS * 1, SamplingParams(n=3, max_new_tokens=60),
                     desc="t", progress=False, tools=spec, rows=ROWS)  # fmt: skip


def _score(tmp_path, samples, weights) -> list[dict]:
    write_parquet(rollout_table(ROWS, PROMPTS, samples, TOK, policy_id="p", iteration=0),
                  tmp_path / "rollouts.parquet")  # fmt: skip
    out = score_file(str(tmp_path / "rollouts.parquet"), str(tmp_path / "s.parquet"), weights)
    return pq.read_table(out.path).to_pylist()


def test_the_episodes_reward_is_recorded_and_paid_from_the_file(tmp_path):
    script = [
        ["<tool_call>16422</tool_call>", "<tool_call>16000</tool_call>", "<answer>1</answer>"],
        ["<|eos|>", "<tool_call>16422</tool_call>"],
        ["<|eos|>"],
    ]
    samples = _episodes("make_scored_guess", script)
    assert [s.env for s in samples] == [
        {"reward": 1.0, "error": None},
        {"reward": 0.5, "error": None},
        {"reward": None, "error": "RuntimeError: no guess was made"},
    ]
    rows = _score(tmp_path, samples, {"environment": 1.0})
    assert [r["env_reward"] for r in rows] == [1.0, 0.5, None]
    assert [r["reward_environment"] for r in rows] == [1.0, 0.5, None]
    assert rows[2]["error_environment"] == "RuntimeError: no guess was made"


def test_a_reward_that_is_not_a_number_is_an_error_and_stops_when_it_fails_everywhere(tmp_path):
    samples = _episodes("make_broken", [["<tool_call>16422</tool_call>"] * 3, ["<|eos|>"] * 3])
    why = "TypeError: reward() returned str, expected a number or None"
    assert all(s.env == {"reward": None, "error": why} for s in samples)
    with pytest.raises(
        UserError, match=rf"reward .environment. failed on all 3 rows.*{re.escape(why)}"
    ):
        _score(tmp_path, samples, {"environment": 1.0, "format": 0.1})


def test_without_an_environment_reward_the_rows_say_why(tmp_path):
    spec = ToolSpec(max_turns=2)
    samples = run_turns(Scripted([["<answer>16422</answer><|eos|>"]]), PROMPTS,
                        SamplingParams(max_new_tokens=40), desc="t", progress=False, tools=spec)  # fmt: skip
    assert samples[0].env is None  # the python tool keeps no reward
    with pytest.raises(UserError, match="no env_reward column: the environment's episodes"):
        _score(tmp_path, samples, {"environment": 1.0, "accuracy": 1.0})


def test_held_out_evals_score_by_the_environments_reward():
    """``eval.accuracy_reward: environment``: the eval pays what the episode's ``reward()``
    gave, as the rollouts do (it scored every held-out episode 0 before)."""
    from grpo_core.algorithm.evaluation import evaluate

    script = [["<tool_call>16422</tool_call>"], ["<answer>1</answer><|eos|>"]]
    spec = ToolSpec(tools=("tests.tools.test_env_reward:make_scored_guess",), max_turns=4)
    rows = [{"prompt": "357*46", "answer": "16422"}]
    res = evaluate(None, TOK, rows, max_new_tokens=60, engine=Scripted(script), tools=spec,
                   accuracy_reward="environment", desc="t")  # fmt: skip
    assert res.accuracy == 1.0

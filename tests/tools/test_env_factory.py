"""Environments in TRL's ``environment_factory`` shape (grpo_core/engines/factory_env.py): one
object per episode, its public methods the JSON tools (schemas from their hints and
docstrings), state kept across the episode's calls, ``reset(**row)`` adding to the prompt,
``get_reward()`` recorded; several environments mixed by the rows' ``environment`` column,
each row declaring its own environment's tools only. The model is the JSON-tools test
suite's scripted chat model; the whole-run test trains a tiny Qwen2 with that template."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from grpo_core.algorithm.evaluation import evaluate
from grpo_core.contracts.text import row_prompt_ids
from grpo_core.engines.environments import ToolSpec
from grpo_core.engines.factory_env import factory_declarations
from grpo_core.engines.generation import SamplingParams
from grpo_core.engines.turns import run_turns
from tests.tools.test_json_tools import TOK, ChatModel, call

COUNTER = "tests.tools.test_env_factory:Counter"
SHOP = "tests.tools.test_env_factory:Shop"


class Counter:
    """Counts up to the row's target; pays 1 when the total hits it."""

    def reset(self, **row) -> str:
        self.total, self.target = 0, int(row["answer"])
        return f" Reach {self.target}."

    def add(self, n: int) -> str:
        """Add n to the running total.

        Args:
            n: how much to add
        """
        self.total += n
        return str(self.total)

    def get_reward(self) -> float:
        return float(self.total == self.target)


class Shop:
    """Buys things; no reward of its own."""

    def reset(self, **row) -> None:
        self.basket: list[str] = []

    def buy(self, item: str) -> str:
        """Put an item in the basket.

        Args:
            item: what to buy
        """
        self.basket.append(item)
        return ", ".join(self.basket)


def spec(**factories) -> ToolSpec:
    pairs = tuple(sorted(factories.items())) or (("", COUNTER),)
    return ToolSpec(tools=("factory",), environment_factory=pairs, max_tool_output_tokens=40)


def row(answer="7", env=None, factories=None):
    decl = factory_declarations(factories or {"": COUNTER})
    r = {"prompt": [{"role": "user", "content": "Count."}], "answer": answer}
    if env is not None:
        r["environment"] = env
    r["tools"] = decl[env if env is not None else ""]
    return r


def test_an_environment_keeps_state_across_its_calls_and_owns_the_reward():
    r = row()
    turn = call("add", n=3) + call("add", n=4)
    model = ChatModel([[turn], ["<answer>7</answer>"]])
    (ep,) = run_turns(model, [row_prompt_ids(TOK, r)], SamplingParams(max_new_tokens=600),
                      desc="t", progress=False, tools=spec(), rows=[r])  # fmt: skip
    tool = ep.turns[1]
    text = TOK.decode(ep.completion_ids[tool["start"] : tool["end"]])
    assert "\n3\n" in text and "\n7\n" in text  # the second call saw the first's state
    assert (tool["calls"], tool["failed"]) == (2, 0)
    assert ep.env == {"reward": 1.0, "error": None}
    assert ep.prompt[-1]["content"].endswith(" Reach 7.")  # reset()'s text, in the prompt


def test_each_episode_gets_its_own_object():
    r = row()
    model = ChatModel([[call("add", n=7)] * 2, ["<answer>7</answer>"] * 2])
    eps = run_turns(model, [row_prompt_ids(TOK, r)], SamplingParams(n=2, max_new_tokens=600),
                    desc="t", progress=False, tools=spec(), rows=[r])  # fmt: skip
    assert [e.env["reward"] for e in eps] == [1.0, 1.0]  # not 14: no shared total


def test_the_tool_schemas_come_from_the_methods():
    (schema,) = json.loads(factory_declarations({"": COUNTER})[""])
    assert schema["function"]["name"] == "add"
    assert schema["function"]["parameters"]["properties"]["n"]["type"] == "integer"


def test_rows_pick_their_environment_and_declare_only_its_tools():
    factories = {"counter": COUNTER, "shop": SHOP}
    rows = [row("7", "counter", factories), row("0", "shop", factories)]
    assert "add" in rows[0]["tools"] and "buy" not in rows[0]["tools"]
    assert "buy" in rows[1]["tools"] and "add" not in rows[1]["tools"]
    model = ChatModel([[call("add", n=7), call("add", n=1)], ["<answer>7</answer>"] * 2])
    prompts = [row_prompt_ids(TOK, r) for r in rows]
    eps = run_turns(model, prompts, SamplingParams(max_new_tokens=600), desc="t",
                    progress=False, tools=spec(**factories), rows=rows)  # fmt: skip
    assert eps[0].env == {"reward": 1.0, "error": None}
    assert eps[1].env is None  # the shop owns no reward
    shop_tool = eps[1].turns[1]
    assert "no function 'add'" in shop_tool["error"]  # the counter's tool is not the shop's


def test_evals_score_by_the_environments_reward():
    r = row()
    model = ChatModel([[call("add", n=7)], ["<answer>7</answer>"]])
    res = evaluate(None, TOK, [r], max_new_tokens=600, engine=model, tools=spec(),
                   accuracy_reward="environment", desc="t")  # fmt: skip
    assert res.accuracy == 1.0


def test_config_refuses_an_environment_factory_beside_other_tools():
    from grpo_core.config.stages import RolloutConfig

    with pytest.raises(ValueError, match="environment_factory"):
        RolloutConfig(environment_factory=COUNTER, functions=["calculator"])
    cfg = RolloutConfig(environment_factory={"a": COUNTER, "b": SHOP})
    assert cfg.environment == ["factory"]
    assert cfg.tool_spec().environment_factory == (("a", COUNTER), ("b", SHOP))


@pytest.mark.slow
def test_a_run_mixing_two_environments_by_row(prefect_harness, tmp_path, tracking_uri):
    """A whole ``grpo run`` (the R1 flow) on a tiny Qwen2 whose template declares tools, the
    rows mixing the counter and the shop: every stage samples JSON calls against the row's
    own environment, the held-out evals score by the environment's reward, and a rollout file
    is re-scored (``grpo score``) from the file alone, no environment running."""
    from flows import preflight
    from flows.config import load_config
    from flows.r1 import r1_pipeline
    from tasks.score import score_file
    from tests.tools.test_json_tools import TINY_RUN, run_on_files

    def convo(env, a):
        first = call("add", n=a) if env == "counter" else call("buy", item="tea")
        return [{"role": "assistant", "content": first},
                {"role": "tool", "name": "add" if env == "counter" else "buy",
                 "content": str(a) if env == "counter" else "tea"},
                {"role": "assistant", "content": f"<answer>{a}</answer>"}]  # fmt: skip

    rows = [
        {
            "prompt": [{"role": "user", "content": f"Task {a}."}],
            "answer": str(a),
            "environment": env,
            "completion": convo(env, a),
        }  # fmt: skip
        for a in range(3, 33)
        for env in ("counter", "shop")
    ]
    data = run_on_files(tmp_path, {"sft": rows[:24], "rl": rows[24:48], "eval": rows[48:56]})
    overrides = [
        *data,
        f"rollout.environment_factory={{counter: '{COUNTER}', shop: '{SHOP}'}}",
        "rewards={environment: 1.0, format: 0.1}", "eval.accuracy_reward=environment",
        *TINY_RUN,
        f"output_dir={tmp_path / 'runs'}", f"tracking.uri={tracking_uri}",
    ]  # fmt: skip
    cfg = load_config(None, overrides)
    preflight.check_run(cfg)
    summary = r1_pipeline(cfg)
    assert len(summary["stages"]) == 4
    run = tmp_path / "runs" / cfg.run_name
    path = run / "rl_1" / "iter_0000" / "rollouts.parquet"
    rollouts = pq.read_table(path).to_pylist()
    for r in rollouts:  # each row declares its own environment's tools only
        names = {t["function"]["name"] for t in json.loads(r["tools"])}
        assert names == ({"add"} if r["environment"] == "counter" else {"buy"})
        assert "turns" in r
    assert any(r["environment"] == "counter" for r in rollouts)
    out = score_file(str(path), str(tmp_path / "rescored.parquet"), {"environment": 1.0})
    rescored = pq.read_table(out.path).to_pylist()
    assert [r["reward_environment"] for r in rescored] == [r["env_reward"] for r in rollouts]

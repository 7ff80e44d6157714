"""The hostile environment suite through a whole ``grpo run`` (the R1 flow: cold start, rl_1,
rejection sampling, re-SFT, rl_2) on the tool demo's model and data: every call the policy
makes reaches an environment that, chosen by the call's text, answers, raises (a lone
surrogate in its message), blocks past ``tool_timeout_s``, answers 5 MB, raises
``SystemExit`` or ``KeyboardInterrupt``, or returns a ``str``, an ``int`` or
``Observation(None)``. The run ends; every rollout row is there with each failure recorded as
its call's error; and a second run with the same settings ends with the same weights, bit for
bit (the default schedule: the tool calls of a batch at its barrier)."""

from __future__ import annotations

import time
import zlib

import pyarrow.parquet as pq
import pytest

from grpo_core.engines.environments import Observation

HOSTILE_ENV = "tests.tools.test_hostile_runs:Hostile"
KINDS = ["ok", "surrogate", "block", "huge", "exit", "interrupt", "str", "int", "none_text"]
# the error each kind leaves on its call (None: the call ran)
EXPECTED = {"ok": None, "str": None, "huge": None, "surrogate": "ValueError",
            "block": "TimeoutError", "exit": "SystemExit", "interrupt": "KeyboardInterrupt",
            "int": "returned int", "none_text": "text is NoneType"}  # fmt: skip


def kind_of(turn: str) -> str:
    """The kind for a model turn, from its digits (the call's numbers: the same in the text
    ``step`` gets and in the rollout's ``turns`` record)."""
    digits = "".join(c for c in turn if c.isdigit())
    return KINDS[zlib.crc32(digits.encode()) % len(KINDS)]


class Hostile:
    """A user environment (``module:function`` in the markers' layout) whose every call is
    one of :data:`KINDS`, picked by the call's text (so a rerun picks the same)."""

    def __init__(self, spec):
        self.spec = spec

    def start(self, row):
        return HostileEpisode()


class HostileEpisode:
    def step(self, turn: str):
        kind = kind_of(turn)
        if kind == "ok":
            return Observation("<tool_response>12</tool_response>")
        if kind == "surrogate":
            raise ValueError("bad \ud800 value")
        if kind == "block":
            time.sleep(2.0)  # past the run's 0.5 s tool_timeout_s
            return Observation("<tool_response>late</tool_response>")
        if kind == "huge":
            return Observation("<tool_response>" + "7" * 5_000_000 + "</tool_response>")
        if kind == "exit":
            raise SystemExit(3)
        if kind == "interrupt":
            raise KeyboardInterrupt
        if kind == "str":
            return "<tool_response>42</tool_response>"
        if kind == "int":
            return 7
        return Observation(None)


def tool_turns(run, *, rows: int, iterations: int = 2):
    """``(row, model turn, tool turn)`` of every call in rl_1's rollout files, each file
    checked to hold all ``rows`` (nothing lost)."""
    for it in range(iterations):
        got = pq.read_table(run / "rl_1" / f"iter_{it:04d}" / "rollouts.parquet").to_pylist()
        assert len(got) == rows
        for r in got:
            turns = r["turns"]
            for model_turn, tool in zip(turns, turns[1:], strict=False):
                if tool["role"] == "tool":
                    yield r, model_turn, tool


def assert_same_checkpoints(run, again) -> None:
    """The two runs' stage checkpoints hold the same weights, bit for bit."""
    from grpo_core.training.checkpoint import policy_id

    for stage in ("cold_start_sft", "rl_1", "re_sft", "rl_2"):
        assert policy_id(run / "checkpoints" / stage) == policy_id(again / "checkpoints" / stage)


def _run(out, tracking_uri):
    from flows import preflight
    from flows.config import load_config
    from flows.r1 import r1_pipeline

    overrides = [
        f"rollout.tools=[{HOSTILE_ENV}]", "rollout.tool_timeout_s=0.5",
        "data.multiply.n_sft=128", "data.multiply.n_rl=256", "data.multiply.n_dev=16",
        "data.multiply.n_eval=16", "sft.max_steps=40", "sft.target_accuracy=null",
        "rl.iterations=2", "rl.prompts_per_iteration=4", "rl.num_generations=4",
        "rl.steps_per_generation=1", "rl.eval_every=2", "rejection_sampling.num_prompts=8",
        "rejection_sampling.num_generations=2", "rejection_sampling.require=[]",
        "re_sft.max_steps=2", "rl_2={iterations: 1, learning_rate: 5.0e-5}",
        f"output_dir={out}", f"tracking.uri={tracking_uri}",
    ]  # fmt: skip
    cfg = load_config("configs/demo-tools.yaml", overrides)
    preflight.check_run(cfg)
    summary = r1_pipeline(cfg)
    return out / cfg.run_name, summary


@pytest.mark.slow
def test_a_whole_run_against_a_hostile_environment_ends_and_reruns_bit_identical(
    prefect_harness, tmp_path, tracking_uri
):

    run, summary = _run(tmp_path / "a", tracking_uri)
    assert len(summary["stages"]) == 4
    seen: dict[str, int] = {}
    for _, model_turn, tool in tool_turns(run, rows=16):  # 4 prompts x 4 generations
        kind = kind_of(model_turn["text"])
        seen[kind] = seen.get(kind, 0) + 1
        want = EXPECTED[kind]
        if want is None:
            assert tool["error"] is None, (kind, tool["error"])
        else:
            assert tool["error"] is not None and want in tool["error"], (kind, tool)
        if kind == "huge":  # cut to the demo's 16-token budget
            assert tool["end"] - tool["start"] <= 16
    failing = {k for k in seen if EXPECTED[k] is not None}
    assert len(failing) >= 4, seen  # the policy's calls met most of the hostile kinds

    again, _ = _run(tmp_path / "b", tracking_uri)
    assert_same_checkpoints(run, again)


ACTOR = "tests.tools.test_hostile_runs:Actor"
# the JSON tool's kinds, by the row's number n (n % 9); None: the call runs
ACTS = {0: None, 1: "ValueError", 2: "TimeoutError", 3: None, 4: "SystemExit",
        5: "KeyboardInterrupt", 6: "circular", 7: "tuple", 8: "str"}  # fmt: skip


class _Unprintable:
    def __str__(self):
        raise RuntimeError("no str")

    __repr__ = __str__


class Actor:
    """An environment in TRL's ``environment_factory`` shape with one JSON tool whose
    answer, by the row's number, is fine, raises, blocks, is 5 MB, exits, interrupts, or is a
    value JSON cannot hold (a circular list, tuple keys, an object whose ``str`` raises)."""

    def reset(self, **row) -> None:
        self.calls, self.n = 0, int(row["answer"])

    def act(self):
        """Act on the task."""
        self.calls += 1
        n = self.n
        kind = n % 9
        if kind == 1:
            raise ValueError("bad \udc80 value")
        if kind == 2:
            time.sleep(2.0)
        if kind == 3:
            return "7" * 5_000_000
        if kind == 4:
            raise SystemExit(3)
        if kind == 5:
            raise KeyboardInterrupt
        if kind == 6:
            a: list = []
            a.append(a)
            return a
        if kind == 7:
            return {(1, 2): 3}
        if kind == 8:
            return _Unprintable()
        return str(n)

    def get_reward(self) -> float:
        return float(self.calls == 1)


@pytest.mark.slow
def test_a_whole_json_tools_run_against_hostile_calls_ends_and_reruns_bit_identical(
    prefect_harness, tmp_path, tracking_uri
):
    """The same through JSON calls on a tiny Qwen2-style chat model whose template declares
    tools: each row's number picks what ``act`` does, the cold start teaches the call."""

    from flows import preflight
    from flows.config import load_config
    from flows.r1 import r1_pipeline
    from tests.tools.test_json_tools import call, run_on_files

    rows = [
        {
            "prompt": [{"role": "user", "content": f"Act on {a}."}],
            "answer": str(a),
            "completion": [
                {"role": "assistant", "content": call("act")},
                {"role": "tool", "name": "act", "content": str(a)},
                {"role": "assistant", "content": f"<answer>{a}</answer>"},
            ],
        }
        for a in range(10, 100)
    ]
    data = run_on_files(
        tmp_path,
        {"sft": rows[:60], "rl": rows[60:84], "eval": rows[84:]},
        hidden_size=64,
        intermediate_size=128,
    )

    def run(out):
        overrides = [
            *data, f"rollout.environment_factory='{ACTOR}'",
            "rollout.tool_timeout_s=0.5", "rewards={environment: 1.0, format: 0.1}",
            "eval.accuracy_reward=environment", "sft.max_steps=100", "sft.batch_size=8",
            "sft.learning_rate=3.0e-3", "sft.target_accuracy=null", "rl.iterations=2",
            "rl.prompts_per_iteration=4", "rl.num_generations=2", "rl.steps_per_generation=1",
            "rl.max_completion_length=96", "rl.eval_every=2",
            "rejection_sampling.num_prompts=4", "rejection_sampling.require=[]",
            "rejection_sampling.max_completion_length=96", "re_sft.max_steps=2",
            "rl_2={iterations: 1}", "eval.max_completion_length=96",
            f"output_dir={out}", f"tracking.uri={tracking_uri}",
        ]  # fmt: skip
        cfg = load_config(None, overrides)
        preflight.check_run(cfg)
        assert len(r1_pipeline(cfg)["stages"]) == 4
        return out / cfg.run_name

    first = run(tmp_path / "a")
    seen: dict[str, int] = {}
    for r, model_turn, tool in tool_turns(first, rows=8):  # 4 prompts x 2 generations
        if call("act") not in model_turn["text"]:
            continue  # not a well-formed call of act: its own error
        want = ACTS[int(r["answer"]) % 9]
        seen[str(want)] = seen.get(str(want), 0) + 1
        if want is None:
            assert tool["error"] is None, (r["answer"], tool)
        else:
            assert tool["error"], (r["answer"], tool)
        assert tool["end"] - tool["start"] <= 200  # 40 tokens of output + the markup
    assert sum(seen.values()) >= 8, seen  # the policy calls act
    assert len(set(seen) - {"None"}) >= 3, seen  # and meets several hostile kinds
    assert_same_checkpoints(first, run(tmp_path / "b"))

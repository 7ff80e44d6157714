"""A tool is never paid for the answer, and evals run environments that read their row.

The rewards, held-out evals (pass@1, maj@k) and rejection sampling read what the model wrote
(its assistant turns); the whole episode, tool output included, reaches custom rewards as
the ``trajectory`` column. Scripted engines stand in for the model; the python tool runs in
the real code sandbox; scoring goes through a real rollout Parquet."""

from __future__ import annotations

import os

import pyarrow.parquet as pq
import pytest

from grpo_core.algorithm.evaluation import evaluate
from grpo_core.contracts.io import write_parquet
from grpo_core.contracts.rollouts import rollout_table
from grpo_core.engines.environments import Observation, ToolSpec
from grpo_core.engines.generation import SamplingParams
from grpo_core.engines.turns import run_turns
from tasks.score import score_file
from tests.tools.test_turn_loop import ScriptedEngine


def ascii_tokenizer():
    """The tool demo's tokenizer with every printable ASCII character: a model with a real
    vocabulary can write any program, the tags included."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from grpo_core.demo import model as demo

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab_list = [demo.PAD, demo.UNK, demo.EOS, demo.USER, demo.ASSISTANT, *chars]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab_list)}, unk_token=demo.UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([demo.PAD, demo.UNK, demo.EOS, demo.USER, demo.ASSISTANT])
    tok.add_tokens([*demo.TAGS, *demo.TOOL_TAGS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=demo.PAD, unk_token=demo.UNK,
                                   eos_token=demo.EOS, padding_side="left")  # fmt: skip


TOK = ascii_tokenizer()


def Scripted(script) -> ScriptedEngine:  # noqa: N802 (a model, named as one)
    """test_turn_loop's scripted model, speaking through :data:`TOK`."""
    return ScriptedEngine(script, TOK)


# the model asks the tool to print an answer tag, and writes no answer of its own
FORGE = '<tool_call>print("<"+"answer>"+str(357*46)+"</"+"answer>")</tool_call>'
ROWS = [{"prompt": "<|user|>357*46<|assistant|>", "answer": "16422"}]
PROMPTS = [TOK.encode(ROWS[0]["prompt"], add_special_tokens=False)]


def _scored(tmp_path, samples, weights) -> dict:
    table = rollout_table(ROWS, PROMPTS[:1], samples, TOK, policy_id="p", iteration=0)
    write_parquet(table, tmp_path / "rollouts.parquet")
    score_file(str(tmp_path / "rollouts.parquet"), str(tmp_path / "scored.parquet"), weights)
    return pq.read_table(tmp_path / "scored.parquet").to_pylist()


def test_an_answer_the_tool_prints_earns_nothing(tmp_path):
    engine = Scripted([[FORGE, FORGE], ["<|eos|>", "</think><answer>16422</answer><|eos|>"]])
    samples = run_turns(engine, PROMPTS[:1], SamplingParams(n=2, max_new_tokens=80), desc="t",
                        progress=False, tools=ToolSpec())  # fmt: skip
    forged, honest = samples
    assert "<answer>16422</answer>" in forged.turns[1]["text"]  # the tool printed the tag
    rows = _scored(tmp_path, samples, {"accuracy": 1.0, "format": 0.1})
    assert "<answer>16422</answer>" in rows[0]["completion"]  # the record keeps the episode
    assert rows[0]["reward_accuracy"] == 0.0 and rows[0]["reward_format"] == 0.0
    assert rows[1]["reward_accuracy"] == 1.0


def trajectory_reward(prompts, completions, trajectory, **kw):
    """1.0 where the episode's whole text holds the answer the model's own text lacks."""
    pairs = zip(completions, trajectory, strict=True)
    return [float("16422" in t and "16422" not in c) for c, t in pairs]


def test_a_custom_reward_gets_the_model_text_and_the_trajectory_by_name(tmp_path):
    engine = Scripted([[FORGE], ["<|eos|>"]])
    samples = run_turns(engine, PROMPTS[:1], SamplingParams(max_new_tokens=80), desc="t",
                        progress=False, tools=ToolSpec())  # fmt: skip
    rows = _scored(tmp_path, samples, {"tests.tools.test_tool_answers:trajectory_reward": 1.0})
    assert rows[0]["reward"] == 1.0


class Guess:
    """docs/tools.md's environment: it reads the row's answer when an episode starts."""

    def __init__(self, spec):
        self.spec = spec

    def start(self, row):
        return GuessEpisode(int(row["answer"]), self.spec)


class GuessEpisode:
    def __init__(self, target, spec):
        self.target, self.spec = target, spec

    def step(self, model_turn):
        spec = self.spec  # rollout.tool_call_start, rollout.tool_call_end, ...
        if not model_turn.rstrip().endswith(spec.tool_call_end):
            return None
        guess = int(model_turn.rsplit(spec.tool_call_start, 1)[-1].split(spec.tool_call_end)[0])
        word = "correct" if guess == self.target else "higher" if guess < self.target else "lower"
        return Observation(f"{spec.tool_result_start}{word}{spec.tool_result_end}")


def make_guess(spec):
    return Guess(spec)


def test_an_eval_hands_the_environment_its_row_and_scores_the_model_text():
    spec = ToolSpec(tools=("tests.tools.test_tool_answers:make_guess",))
    script = [["<tool_call>16000</tool_call>"], ["<answer>16422</answer><|eos|>"]]
    res = evaluate(None, TOK, ROWS, max_new_tokens=80, desc="t",
                   engine=Scripted(script), tools=spec)  # fmt: skip
    (row,) = res.table
    assert row["turns"][1]["text"] == "<tool_response>higher</tool_response>"
    assert res.accuracy == 1.0


def test_evals_and_maj_at_k_do_not_count_an_answer_the_tool_printed():
    k = 3
    script = [[FORGE] * k, ["<|eos|>"] * k]
    res = evaluate(None, TOK, ROWS, max_new_tokens=80, num_samples=k, desc="t",
                   engine=Scripted(script), tools=ToolSpec())  # fmt: skip
    assert res.accuracy == 0.0 and res.maj_at_k == 0.0 and res.pass_at_k == 0.0
    assert all("16422" in r["completion"] for r in res.table)  # shown, not paid


class NoStart:
    def __init__(self, spec):
        pass

    def start(self, row):
        raise KeyError("answer")


@pytest.mark.parametrize("rows", [None, ROWS])
def test_an_environment_that_cannot_start_is_an_error_on_its_episode(rows):
    spec = ToolSpec(tools=("tests.tools.test_tool_answers:NoStart",), max_tool_output_tokens=60)
    engine = Scripted([["<tool_call>1</tool_call>"], ["<answer>1</answer><|eos|>"]])
    (got,) = run_turns(engine, PROMPTS[:1], SamplingParams(max_new_tokens=120), desc="t",
                       progress=False, tools=spec, rows=rows)  # fmt: skip
    tool = got.turns[1]
    assert tool["role"] == "tool" and "did not start: KeyError" in tool["error"]
    assert got.finish_reason == "stop"


class RowPython:
    """The python tool behind an environment that needs its row to start, as docs/tools.md's
    ``Guess`` does (``int(row["answer"])``)."""

    def __init__(self, spec):
        from grpo_core.engines.environments import PythonTool

        self.tool = PythonTool(spec)

    def start(self, row):
        log = os.environ.get("GRPO_TEST_ROW_LOG")  # each start's answer, one per line
        if log:
            with open(log, "a") as f:
                f.write(f"{row['answer'] if row else None}\n")
        int(row["answer"])  # TypeError without a row
        return self.tool.start(row)


def make_row_python(spec):
    return RowPython(spec)


def test_the_notebook_path_samples_tool_episodes_and_scores_the_model_text():
    """``iteration.sample(..., tools=)`` then ``iteration.score``: the notebook's GRPO
    iteration samples tool-using episodes as the pipeline does, rows included."""
    from grpo_core.algorithm import iteration
    from grpo_core.config.stages import RLConfig

    spec = ToolSpec(tools=("tests.tools.test_tool_answers:make_guess",))
    model = Scripted(
        [["<tool_call>16000</tool_call>", FORGE], ["<answer>16422</answer><|eos|>", "<|eos|>"]]
    )
    table = iteration.sample(model, TOK, ROWS, SamplingParams(n=2, max_new_tokens=80),
                             policy_id="p", progress=False, tools=spec)  # fmt: skip
    rows = table.to_pylist()
    assert rows[0]["turns"][1]["text"] == "<tool_response>higher</tool_response>"
    scored = iteration.score(table, {"accuracy": 1.0}, RLConfig(num_generations=2).scoring)
    assert scored.table.column("reward_accuracy").to_pylist() == [1.0, 0.0]

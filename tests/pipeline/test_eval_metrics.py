"""Held-out metrics: pass@1 counts a code problem only when all its tests pass; k samples give
pass@k (Chen et al.'s unbiased estimator) and maj@k (majority vote of extracted answers)."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from tokenizers import decoders as tk_decoders
from transformers import PreTrainedTokenizerFast

from grpo_core.algorithm.evaluation import evaluate, majority_correct, pass_at_k
from grpo_core.config.stages import EvalConfig
from grpo_core.engines.generation import Sample


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 0, 1, 0.0),
        (5, 5, 3, 1.0),
        (10, 3, 1, 0.3),
        (4, 1, 2, 0.5),
        (3, 1, 3, 1.0),
        (6, 2, 5, 1.0),
    ],
)
def test_pass_at_k_is_the_unbiased_estimator(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(3, 4, 1)


def test_majority_vote_groups_equal_numbers_and_breaks_ties_by_first_seen():
    assert majority_correct(["1,000", "1000", "5"], [True, True, False])
    assert not majority_correct(["7", "7", "8"], [False, False, True])
    assert majority_correct(["8", None, "7"], [True, False, False])  # tie: first seen wins
    assert not majority_correct([None, None], [False, False])


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A real byte-level BPE tokenizer that round-trips any text (code included)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk_decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
    )
    tok.train_from_iterator(["def add(a, b): return a + b"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


class ScriptedEngine:
    """Stands in for the policy: returns the given completions (the scoring is under test)."""

    name = "scripted"

    def __init__(self, tokenizer, completions: list[list[str]]):
        self.tok, self.completions = tokenizer, completions
        self.params = None

    def generate(self, prompt_ids, params, *, desc="generate", progress=True):
        self.params = params
        out = []
        for p in range(len(prompt_ids)):
            for i in range(params.n):
                text = self.completions[p][i]
                ids = self.tok(text, add_special_tokens=False)["input_ids"] + [
                    self.tok.eos_token_id
                ]
                out.append(Sample(p, i, ids, [0.0] * len(ids), "stop"))
        return out


CODE_ROWS = [
    {
        "prompt": "Write add(a, b).",
        "test_list": ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 5) == 5"],
    },
    {"prompt": "Write sub(a, b).", "test_list": ["assert sub(3, 1) == 2", "assert sub(5, 5) == 0"]},
]
RIGHT_ADD = "```python\ndef add(a, b):\n    return a + b\n```"
HALF_ADD = "```python\ndef add(a, b):\n    return 3 if a == 1 else 4\n```"  # passes 2 of 3
HALF_SUB = "```python\ndef sub(a, b):\n    return 2\n```"  # passes 1 of 2


def test_code_pass_at_1_needs_every_test_to_pass(byte_tokenizer):
    engine = ScriptedEngine(byte_tokenizer, [[HALF_ADD], [HALF_SUB]])
    res = evaluate(
        None,
        byte_tokenizer,
        CODE_ROWS,
        max_new_tokens=64,
        accuracy_reward="code_tests",
        engine=engine,
    )
    assert engine.params.temperature == 0.0 and engine.params.n == 1  # greedy
    assert [t["score"] for t in res.table] == pytest.approx([2 / 3, 1 / 2])  # partial credit kept
    assert [t["correct"] for t in res.table] == [0.0, 0.0]
    assert res.accuracy == 0.0 and res.pass_at_k is None and res.num_samples == 1


def test_code_pass_at_k_over_samples_and_no_majority_vote(byte_tokenizer):
    engine = ScriptedEngine(byte_tokenizer, [[HALF_ADD, RIGHT_ADD, "no code"], [HALF_SUB] * 3])
    res = evaluate(
        None,
        byte_tokenizer,
        CODE_ROWS,
        max_new_tokens=64,
        accuracy_reward="code_tests",
        num_samples=3,
        engine=engine,
    )
    assert engine.params.n == 3 and engine.params.temperature == 1.0
    assert [t["correct"] for t in res.table] == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert [t["sample_idx"] for t in res.table] == [0, 1, 2, 0, 1, 2]
    assert res.accuracy == pytest.approx(1 / 6)  # pass@1 estimated from 3 samples
    assert res.pass_at_k == pytest.approx(0.5)  # add solved by one of 3 samples, sub by none
    assert res.maj_at_k is None  # programs are not answers to vote on
    assert "maj_at_k" not in res.summary() and res.summary()["pass_at_k"] == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("reward", "wrap"),
    [
        ("accuracy", "<think>x</think><answer>{}</answer>".format),
        ("math_verify", "so the answer is $\\boxed{{{}}}$".format),
    ],
)
def test_math_answers_give_pass_at_k_and_maj_at_k(byte_tokenizer, reward, wrap):
    rows = [{"prompt": "3+5?", "answer": "8"}, {"prompt": "10*100?", "answer": "1000"}]
    engine = ScriptedEngine(
        byte_tokenizer, [[wrap(7), wrap(7), wrap(8)], [wrap("1,000"), wrap(1000), wrap(5)]]
    )
    res = evaluate(
        None,
        byte_tokenizer,
        rows,
        max_new_tokens=32,
        num_samples=3,
        temperature=0.7,
        accuracy_reward=reward,
        engine=engine,
    )
    assert engine.params.temperature == 0.7
    assert [t["correct"] for t in res.table] == [0.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    assert res.accuracy == pytest.approx(3 / 6)
    assert res.pass_at_k == pytest.approx(1.0)
    assert res.maj_at_k == pytest.approx(0.5)  # 7 outvotes 8; 1,000 and 1000 vote together


def test_sampled_eval_through_hf_generate_on_a_real_model(tmp_path):
    from grpo_core.demo.model import save_base_model
    from grpo_core.demo.task import make_splits
    from grpo_core.training.checkpoint import load_checkpoint

    model, tok = load_checkpoint(save_base_model(tmp_path / "m", seed=0))
    rows = make_splits(0, 2, 1, 1, 0, 4).eval
    res = evaluate(model, tok, rows, max_new_tokens=8, num_samples=3, seed=1)
    assert len(res.table) == 12 and res.num_examples == 4
    assert [t["sample_idx"] for t in res.table[:3]] == [0, 1, 2]
    assert res.pass_at_k >= res.accuracy and res.maj_at_k is not None


def test_eval_config_knobs():
    cfg = EvalConfig(num_samples=8, temperature=0.6, accuracy_reward="code_tests")
    assert (cfg.num_samples, cfg.temperature) == (8, 0.6)
    with pytest.raises(ValueError):
        EvalConfig(num_samples=0)

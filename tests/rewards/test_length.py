import pytest

from grpo_core import rewards
from grpo_core.rewards.length import cosine_scaled, repetition_penalty, soft_overlong_penalty


def test_soft_overlong_dapo():
    fn = soft_overlong_penalty(max_completion_length=20, overlong_buffer=4)
    ids = [[0] * n for n in (0, 16, 18, 20, 21, 500)]
    assert fn(["p"] * 6, ["x"] * 6, completion_ids=ids) == [0.0, 0.0, -0.5, -1.0, -1.0, -1.0]
    assert fn(["p"], ["a" * 18]) == [-0.5]  # characters without completion_ids
    with pytest.raises(ValueError):
        soft_overlong_penalty(10, 0)


def test_soft_overlong_registered_with_kwargs():
    fn = rewards.get("soft_overlong")
    assert fn(
        ["p"], ["x"], completion_ids=[[0] * 18], max_completion_length=20, overlong_buffer=4
    ) == [-0.5]
    assert fn(["p"], ["x" * 10]) == [0.0]  # defaults 1024 / 256


def test_cosine_scaled():
    fn = cosine_scaled(max_len=100)
    comps = [
        "<answer>4</answer>",
        "<answer>4</answer>" + " " * 82,
        "<answer>5</answer>",
        "<answer>5</answer>" + " " * 82,
        "<answer>4</answer>",
    ]
    out = fn(["p"] * 5, comps, answer=[4, 4, 4, 4, None])
    assert out[0] == pytest.approx(
        0.5 + 0.25 * (1 + __import__("math").cos(0.18 * __import__("math").pi))
    )
    assert out[1] == pytest.approx(0.5)  # correct at max_len: min_value_correct
    assert out[0] > out[1] > 0 > out[3] > out[2]  # short wrong punished most
    assert out[3] == pytest.approx(-0.5)
    assert out[4] is None
    assert "cosine" in rewards.names()


def test_repetition_penalty():
    fn = repetition_penalty(ngram_size=2, max_penalty=-1.0)
    out = fn(["p"] * 4, ["a b c d", "a b a b a b", "", "word"])
    assert out[0] == 0.0
    assert out[1] == pytest.approx(-(1 - 2 / 5))
    assert out[2:] == [0.0, 0.0]
    assert rewards.get("repetition")(["p"], ["the same the same the same the same"])[0] < 0
    with pytest.raises(ValueError):
        repetition_penalty(max_penalty=1.0)

import pytest

from grpo_core import rewards

fmt = rewards.get("format")
tags = rewards.get("tag_count")
lang = rewards.get("language_consistency")


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>reason</think><answer>42</answer>", 1.0),
        ("  \n<think>\nreason\n</think>\n<answer>\n42\n</answer>\n ", 1.0),
        ("<think>multi\nline</think><answer>a\nb</answer>", 1.0),
        ("<think></think><answer></answer>", 1.0),
        ("<answer>42</answer>", 0.0),
        ("<think>r</think>", 0.0),
        ("<think>r</think><answer>42</answer> trailing text", 0.0),
        ("prefix <think>r</think><answer>42</answer>", 0.0),
        ("<think>r</think><answer>1</answer><answer>2</answer>", 0.0),
        ("<think>a</think><think>b</think><answer>1</answer>", 0.0),
        ("<answer>1</answer><think>r</think>", 0.0),
        ("<think>r</think><answer>42", 0.0),
        ("", 0.0),
        ("<think>" + "x" * 1_000_000 + "</think><answer>1</answer>", 1.0),
        ([{"role": "assistant", "content": "<think>r</think><answer>1</answer>"}], 1.0),
    ],
)
def test_format(completion, expected):
    assert fmt(["p"], [completion]) == [expected]


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>r</think><answer>1</answer>", 1.0),
        ("<think>r</think>", 0.5),
        ("<think>r<answer>1</answer>", 0.75),
        ("<think><think></think><answer>1</answer>", 0.75),
        ("", 0.0),
    ],
)
def test_tag_count(completion, expected):
    assert tags(["p"], [completion]) == [expected]


def test_language_consistency():
    comps = [
        "<think>The sum is five</think><answer>5</answer>",
        "<think>The 和 is five</think><answer>5</answer>",
        "<think>和是五</think><answer>5</answer>",
        "<think>2+3=5</think><answer>5</answer>",
        "no think tags, plain English",
    ]
    out = lang(["p"] * 5, comps)
    assert out[0] == 1.0
    assert out[1] == pytest.approx(9 / 10)
    assert out[2] == 0.0
    assert out[3] is None  # no letters: nothing to judge
    assert out[4] == 1.0
    assert lang(["p"], ["<think>和是五</think>"], language=["zh"]) == [1.0]
    assert lang(["p"], ["<think>Сумма равна пяти</think>"], language=["ru"]) == [1.0]

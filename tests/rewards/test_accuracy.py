import pytest

from grpo_core import rewards
from grpo_core.rewards import mathverify
from grpo_core.rewards.accuracy import extract_boxed, extract_tag, gold_text, parse_number

acc = rewards.get("accuracy")
mv = rewards.get("math_verify")


def score(fn, completion, gold):
    return fn(["prompt"], [completion], answer=[gold])[0]


@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        ("<think>7*6</think><answer>42</answer>", 42, 1.0),
        ("<think>7*6</think><answer>42</answer>", "42", 1.0),
        ("<think>..</think><answer> 42 </answer>\n", " 42", 1.0),
        ("<answer>41</answer>", 42, 0.0),
        ("<answer>42.0</answer>", 42, 1.0),
        ("<answer>1,000</answer>", "1000", 1.0),
        ("<answer>1000001</answer>", 1000000, 0.0),  # integers compare exactly
        ("<answer>0.3333333</answer>", "1/3", 1.0),  # within rel_tol 1e-6
        ("<answer>0.33</answer>", "1/3", 0.0),
        ("<answer>1</answer> then <answer>42</answer>", 42, 1.0),  # LAST answer counts
        ("<answer>42</answer> then <answer>1</answer>", 42, 0.0),
        ("<answer>x<answer>42</answer>", 42, 1.0),
        ("<answer>42", 42, 0.0),  # unterminated
        ("42", 42, 0.0),  # no tag
        ("", 42, 0.0),
        ("<answer></answer>", 42, 0.0),
        ("<answer>Paris</answer>", "Paris", 1.0),
        ("<answer>paris</answer>", "Paris", 0.0),
        ("<answer>\\boxed{42}</answer>", 42, 1.0),
        ("<answer>$42$</answer>", 42, 1.0),
        ("<answer>42</answer>", "Natalia sold 48/2 = 24 clips... #### 42", 1.0),  # GSM8K gold
        ("<answer>42</answer>", None, None),
        ("<answer>42</answer>", float("nan"), None),
        ("<answer>42</answer>", "   ", None),
        (b"<answer>42</answer>\xff\xfe", 42, 1.0),  # non-UTF-8 bytes
        ("<think>" + "blah " * 100_000 + "</think><answer>42</answer>", 42, 1.0),  # huge
    ],
)
def test_accuracy(completion, gold, expected):
    assert score(acc, completion, gold) == expected


def test_accuracy_conversational():
    comp = [{"role": "assistant", "content": "<think>t</think><answer>9</answer>"}]
    assert acc(["p"], [comp], answer=["9"]) == [1.0]


def test_accuracy_needs_answer_column():
    with pytest.raises(ValueError, match="'answer' column"):
        acc(["p"], ["<answer>1</answer>"])


needs_mv = pytest.mark.skipif(not mathverify.available(), reason="math-verify not installed")


@needs_mv
@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        ("The answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
        ("so \\boxed{\\frac{1}{2}}", "\\frac{2}{4}", 1.0),
        ("\\boxed{\\{1,2\\}}", "$\\{2,1\\}$", 1.0),
        ("\\boxed{x^2+1}", "1+x^2", 1.0),
        ("\\boxed{3}", "\\frac{1}{2}", 0.0),
        ("first \\boxed{1} then \\boxed{\\dfrac{3}{4}}", "0.75", 1.0),
        ("<think>t</think><answer>\\frac{3}{4}</answer>", "3/4", 1.0),
        ("\\boxed{10}", "10\\text{ cm}", 1.0),
        ("no answer here", "5", 0.0),
        ("\\boxed{5}", None, None),
        ("\\boxed{5}", "", None),
    ],
)
def test_math_verify(completion, gold, expected):
    assert score(mv, completion, gold) == expected


@needs_mv
def test_accuracy_uses_math_verify_for_latex():
    assert score(acc, "<answer>\\frac{1}{2}</answer>", "0.5") == 1.0
    assert score(acc, "<answer>\\frac{1}{3}</answer>", "0.5") == 0.0


def test_extractors():
    assert extract_tag("<answer> a </answer><answer>b</answer>") == "b"
    assert extract_tag("</answer><answer>") is None
    assert extract_boxed("\\boxed{\\frac{1}{2}} and \\boxed{{x}}") == "{x}"
    assert extract_boxed("\\boxed{unbalanced") is None
    assert parse_number("3/4") == parse_number("0.75")
    assert parse_number("12abc") is None
    assert gold_text(7) == "7"
    assert gold_text("#### 7") == "7"

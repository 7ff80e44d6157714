import re
import shutil

import pytest

from grpo_core import rewards
from grpo_core.rewards.code import extract_program, has_real_assert
from grpo_core.rewards.code import test_spec as spec_of
from grpo_core.rewards.sandbox import Limits, detect_isolation, run_program

FAST = Limits(wall_seconds=4.0, cpu_seconds=2)

HUMANEVAL_TEST = """
METADATA = {}

def check(candidate):
    assert candidate([1, 2, 3]) == 6
    assert candidate([]) == 0
    assert candidate([-1, 1]) == 0
"""


def test_extract_program():
    text = "Here:\n```python\nx = 1\n```\nbetter:\n```py\ndef f():\n    return 2\n```\nbye"
    assert extract_program(text) == "def f():\n    return 2\n"
    assert extract_program("```\nbare = 1\n```") == "bare = 1\n"
    assert extract_program("```python\nunterminated = 1\n") == "unterminated = 1\n"
    assert extract_program("plain = 1") == "plain = 1"
    assert extract_program([{"role": "assistant", "content": "```python\ny = 2\n```"}]) == "y = 2\n"


def test_test_spec_column_forms():
    assert spec_of({"test": HUMANEVAL_TEST, "entry_point": "f"})["kind"] == "humaneval"
    assert spec_of({"test_list": ["assert f() == 1"]})["kind"] == "asserts"
    assert spec_of({"tests": ["assert f() == 1"]})["kind"] == "asserts"
    assert spec_of({"tests": "assert f() == 1"})["kind"] == "script"
    assert spec_of({"answer": 3}) is None


def test_code_tests_reward_end_to_end():
    completions = [
        "```python\ndef total(xs):\n    return sum(xs)\n```",
        "```python\ndef total(xs):\n    return len(xs)\n```",  # 1/3 (the [] case)
        "I don't know",  # syntax error
        "```python\nimport sys\nsys.exit(0)\n```",
        "```python\ndef total(xs):\n    while True:\n        pass\n```",
        "no tests for this row",
    ]
    cols = {
        "test": [HUMANEVAL_TEST] * 5 + [None],
        "entry_point": ["total"] * 5 + [None],
    }
    res = rewards.score_completions(
        ["p"] * 6, completions, cols, {"code_tests": 1.0, "code_compiles": 0.1},
        functions={"code_tests": lambda prompts, completions, **kw: rewards.get("code_tests")(
            prompts, completions, sandbox_limits=FAST, sandbox_progress=False, **kw)},
    )  # fmt: skip
    scores = res.per_function["code_tests"]
    assert scores[0] == 1.0 and res.errors["code_tests"][0] is None
    assert scores[1] == pytest.approx(1 / 3)
    assert "2/3 asserts failed" in res.errors["code_tests"][1]
    assert scores[2] == 0.0 and "SyntaxError" in res.errors["code_tests"][2]
    assert scores[3] == 0.0
    # killed by the CPU rlimit, or by the wall clock first when the machine is loaded
    assert scores[4] == 0.0 and re.search("SIGXCPU|timeout", res.errors["code_tests"][4])
    assert scores[5] is None
    assert res.per_function["code_compiles"] == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert res.total[0] == pytest.approx(1.1)


def test_code_runs_and_compiles():
    fn = rewards.get("code_runs")
    out = fn(
        ["p"] * 3,
        ["print('hi')", "raise ValueError('x')", "import os\nos._exit(0)"],
        sandbox_progress=False,
    )
    assert list(out) == [1.0, 0.0, 0.0]
    assert "ValueError" in out.errors[1]
    assert rewards.get("code_compiles")(["p"] * 2, ["x = (", "x = 1"]) == [0.0, 1.0]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff not installed")
def test_ruff_clean():
    fn = rewards.get("code_ruff_clean")
    assert fn(["p"] * 3, ["x = 1\n", "import os\n", "def f(:\n"]) == [1.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("def test_add():\n    assert add(1, 2) == 3\n", 1.0),
        ("def test_add():\n    add(1, 2)\n", 0.0),  # the seed's reward hack: no assert
        ("def test_add():\n    assert True\n", 0.0),
        (
            "class T(unittest.TestCase):\n    def test(self):\n        self.assertEqual(add(1, 2), 3)\n",
            1.0,
        ),
        ("def test():\n    with pytest.raises(ValueError):\n        f()\n", 1.0),
        ("def test(:", 0.0),
        ("", 0.0),
    ],
)
def test_test_has_assert(code, expected):
    assert rewards.get("test_has_assert")(["p"], [code]) == [expected]
    assert has_real_assert(code) == bool(expected)


@pytest.mark.parametrize(
    "completion",
    ["", "\x00\x01 garbage \udcff", "x" * 2_000_000, "```python\n" + "(" * 10_000 + "\n```"],
)
def test_malformed_programs_score_zero(completion):
    res = run_program(
        extract_program(completion), kind="asserts", tests=["assert f() == 1"], limits=FAST
    )
    assert res.fraction == 0.0 and res.error


def test_unshare_fallback_runs_and_is_not_forgeable():
    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    try:
        detect_isolation("unshare")
    except RuntimeError:
        pytest.skip("unshare does not work here")
    good = run_program(
        "def f():\n    return 1\n",
        kind="asserts",
        tests=["assert f() == 1"],
        limits=FAST,
        isolation="unshare",
    )
    assert good.fraction == 1.0
    bad = run_program(
        "import os\nos._exit(0)",
        kind="asserts",
        tests=["assert f() == 1"],
        limits=FAST,
        isolation="unshare",
    )
    assert bad.fraction == 0.0 and bad.status == "exited"

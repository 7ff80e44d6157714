import re
import shutil

import pytest

import grpo_core.sandbox as sandbox_mod
from grpo_core import rewards
from grpo_core.rewards import code as code_mod
from grpo_core.rewards.code import extract_program, has_real_assert
from grpo_core.rewards.code import test_spec as spec_of
from grpo_core.sandbox import Limits, SandboxUnavailable, detect_isolation, run_program

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
        ["print('hi')", "raise ValueError('x')", "import os\nos._exit(0)",
         "import sys\nsys.exit(3)", "import os\nos._exit(1)"],
        sandbox_progress=False,
    )  # fmt: skip
    # the verdict is the exit status, read from outside: os._exit(0) is sys.exit(0)
    assert list(out) == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert "ValueError" in out.errors[1]
    assert rewards.get("code_compiles")(["p"] * 2, ["x = (", "x = 1"]) == [0.0, 1.0]


FORGED = (
    "import json, os\n"
    "for fd in range(3, 64):\n"  # a forged '{ok: true}' reply on every open descriptor
    "    try:\n"
    "        body = json.dumps({'ok': True, 'error': '', 'names': {}}).encode()\n"
    "        os.write(fd, body + b'\\n')\n"
    "    except OSError:\n"
    "        pass\n"
)


def test_code_runs_ignores_a_reply_the_program_forged():
    """Issue 44: a program that writes a forged first reply and then raises, or loops, got
    1.0 from code_runs; the verdict is now the candidate's exit status, read from outside."""
    fn = rewards.get("code_runs")
    out = fn(["p"] * 2, [FORGED + "raise ValueError('after')", FORGED + "while True:\n    pass"],
             sandbox_progress=False, sandbox_limits=Limits(wall_seconds=3.0))  # fmt: skip
    assert list(out) == [0.0, 0.0], out.errors


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


@pytest.mark.parametrize("mode", ["bwrap", "namespaces"])
def test_each_isolation_runs_and_is_not_forgeable(mode):
    try:
        detect_isolation(mode)
    except SandboxUnavailable:
        pytest.skip(f"no {mode} here")
    good = run_program(
        "def f():\n    return 1\n",
        kind="asserts",
        tests=["assert f() == 1"],
        limits=FAST,
        isolation=mode,
    )
    assert good.fraction == 1.0
    bad = run_program(
        "import os\nos._exit(0)",
        kind="asserts",
        tests=["assert f() == 1"],
        limits=FAST,
        isolation=mode,
    )
    assert bad.fraction == 0.0 and bad.status == "exited"


def test_sandboxed_binds_the_isolation(monkeypatch):
    """score_completions(functions=sandboxed(weights, isolation)): the executing rewards run
    under that isolation; the others are left to the registry."""
    bound = rewards.sandboxed({"code_tests": 1.0, "code_runs": 0.5, "format": 0.1}, "none")
    assert set(bound) == {"code_tests", "code_runs"}
    assert rewards.sandboxed({"accuracy": 1.0}, "bogus-never-resolved") == {}
    seen = []
    real = sandbox_mod.detect_isolation
    monkeypatch.setattr(
        code_mod, "detect_isolation", lambda iso=None: seen.append(iso) or real(iso)
    )
    res = rewards.score_completions(
        ["p"],
        ["```python\ndef total(xs):\n    return sum(xs)\n```"],
        {"test": [HUMANEVAL_TEST], "entry_point": ["total"]},
        {"code_tests": 1.0},
        functions=bound,
    )
    assert res.per_function["code_tests"] == [1.0] and seen == ["none"]
    assert rewards.isolation_label(["code_tests"], "none").startswith("none (")
    assert rewards.isolation_label(["accuracy"], "none") is None


STUB_TEST = """
def check(candidate):
    assert True, "This prints if this assert fails 1 (good for debugging!)"
    assert candidate([1, 2]) == 2
    assert not candidate([3])
    assert abs(candidate([0.5]) - 0.5) < 1e-6
    assert True, "This prints if this assert fails 2 (also good for debugging!)"
    assert candidate([]) == None
"""
STUB_CANONICAL = "def last(xs):\n    if not xs:\n        return None\n    return xs[-1] if xs[-1] != 3 else False\n"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (STUB_CANONICAL, 1.0),
        ("def last(xs):\n    return None\n", 0.25),  # only `== None` is its right answer
        ("def last(xs):\n    pass\n", 0.25),
        ("def last(xs):\n    return 0\n", 0.0),  # 0 is not False, not None
        ("def last(xs):\n    return []\n", 0.0),
    ],
)
def test_stub_partial_credit(body, expected):
    """`assert True` lines count for nothing; `assert not candidate(...)` wants a real False."""
    fn = rewards.get("code_tests")
    out = fn(
        ["p"],
        [body],
        test=[STUB_TEST],
        entry_point=["last"],
        sandbox_limits=FAST,
        sandbox_progress=False,
    )
    assert out == [pytest.approx(expected)], out.errors

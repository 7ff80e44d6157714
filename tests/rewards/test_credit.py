"""Which asserts count for partial credit (grpo_core/sandbox/credit.py), and that the scorer's
numbering of them agrees with the harness's (a mismatch would count the wrong asserts)."""

import pytest

from grpo_core.sandbox import Limits, run_program
from grpo_core.sandbox.credit import analyse, counted_asserts

FAST = Limits(wall_seconds=6.0, cpu_seconds=3)


def test_constant_asserts_do_not_count():
    test = "def check(candidate):\n    assert True\n    assert candidate(1) == 2\n    assert 1 == 1, 'x'\n"
    assert list(counted_asserts("humaneval", test, "f")) == ["t1"]


def test_mbpp_free_names_are_the_candidate():
    tests = ["assert add(1, 2) == 3", "assert True", "x = 3\nassert x == 3", "assert f(x=add)"]
    assert list(counted_asserts("asserts", tests)) == ["a0.0", "a3.0"]


def test_values_derived_from_the_candidate():
    test = """
import math
def check(candidate):
    out = []
    for x in range(3):
        out.append(candidate(x))
    assert out == [0, 1, 2]                  # t0: mutated with the candidate's results
    sol = candidate(5)
    assert math.fabs(poly([1], sol)) < 1e-4  # t1: derived variable, helper from the program
    total = 0
    total += candidate(1)
    assert total > 0                         # t2
    assert [y for y in range(3)] == [0, 1, 2]  # not counted
    helper(candidate)
    if (z := candidate(2)) is not None:
        assert z                             # t4 (t3 is the comprehension one above)

def helper(f):
    assert f(0) == 0                         # t5: a parameter fed with the candidate
"""
    counted, names = analyse("humaneval", test, "entry")
    assert list(counted) == ["t0", "t1", "t2", "t4", "t5"]
    assert {"candidate", "entry", "poly", "out", "sol", "total", "z", "f"} <= names
    assert "math" not in names and "y" not in names


def test_unparseable_tests_count_as_one_failure():
    assert list(counted_asserts("asserts", ["assert f(", "assert f() == 1"])) == ["a0.0", "a1.0"]
    assert list(counted_asserts("script", "def (:")) == ["t0"]
    assert counted_asserts("run", None) == {}


def test_numbering_matches_the_harness():
    """Counted and uncounted asserts interleaved, nested in functions, loops, ifs, classes:
    every counted one passes for the correct program, none for a program returning None.
    Credit is per assert statement: the one in the loop counts once, however often it ran."""
    test = """
def check(candidate):
    assert True
    for i in range(3):
        assert candidate(i) == i * 2
        assert i < 3
    class Inner:
        def method(self):
            assert 2 > 1
            assert candidate(10) == 20
    Inner().method()
    def nested():
        if True:
            assert candidate(0) == 0
        assert "x"
    nested()
    assert candidate(1) != 3
"""
    good = run_program(
        "def double(x):\n    return 2 * x\n",
        kind="humaneval",
        tests=test,
        entry_point="double",
        limits=FAST,
    )
    assert (good.passed, good.total, good.error) == (4, 4, None)
    stub = run_program(
        "def double(x):\n    return None\n",
        kind="humaneval",
        tests=test,
        entry_point="double",
        limits=FAST,
    )
    assert (stub.passed, stub.total) == (0, 4), stub.records


def test_tests_without_a_counted_assert_score_zero():
    res = run_program("def f():\n    return 1\n", kind="script", tests="assert True\n", limits=FAST)
    assert res.fraction == 0.0 and "exercises the candidate" in res.error


@pytest.mark.parametrize(
    ("value", "passed"),
    [("[1, 2]", 2), ("(1, 2)", 2), ("Box([1, 2])", 0), ("iter([1, 2])", 0)],
)
def test_candidate_values_must_be_plain(value, passed):
    """Inside an assert, a value from the candidate must be a builtin value (a list subclass
    or an iterator could rig the comparison or the arithmetic)."""
    program = f"class Box(list):\n    pass\ndef f():\n    return {value}\n"
    res = run_program(
        program,
        kind="asserts",
        tests=["assert list(f()) == [1, 2]", "assert len(f()) == 2 and sum(f()) - 3 == 0"],
        limits=FAST,
    )
    assert (res.passed, res.total) == (passed, 2), res.error

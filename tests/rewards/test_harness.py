"""The two-process harness: the program runs in a candidate process, the tests in the harness,
and only plain values cross (``_wire.py``); credit is per assert statement."""

import numpy as np
import pytest

from grpo_core.sandbox import Limits, _wire, run_program

FAST = Limits(wall_seconds=10.0, cpu_seconds=5)


def _roundtrip(value):
    return _wire.wire_decode(_wire.wire_encode(value))


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        3,
        10**30,
        2.5,
        float("inf"),
        "x",
        b"\x00\xff",
        1 + 2j,
        (1, (2, [3])),
        {1, 2},
        frozenset({"a"}),
        {"a": [1, {2: (3,)}]},
        {(1, 2): "pair key"},
    ],
)
def test_plain_values_cross_unchanged(value):
    out = _roundtrip(value)
    assert out == value and type(out) is type(value)


def test_numpy_by_value_object_arrays_refused():
    assert _roundtrip(np.float64(0.5)) == 0.5 and type(_roundtrip(np.int64(3))) is int
    out = _roundtrip(np.arange(4).reshape(2, 2))
    assert out == [[0, 1], [2, 3]] and type(out) is list

    class Y:
        def __eq__(self, other):
            return True

    with pytest.raises(_wire.WireError, match="dtype object"):
        _wire.wire_encode(np.array([Y()], dtype=object))
    with pytest.raises(_wire.WireError, match="not a plain value"):
        _wire.wire_encode(Y())


def test_subclasses_and_foreign_tags_refused():
    class Int(int):
        def __eq__(self, other):
            return True

    with pytest.raises(_wire.WireError):
        _wire.wire_encode(Int(3))
    with pytest.raises(_wire.WireError):
        _wire.wire_decode({"object": "Y"})
    with pytest.raises(_wire.WireError):
        _wire.wire_decode({"tuple": [1], "set": [2]})


def test_an_assert_that_never_ran_is_failed():
    """``return []`` does not pass a test that loops over the result (credit counted assert
    executions before: the loop's assert never ran and cost nothing)."""
    tests = "for v in evens(4):\n    assert v % 2 == 0\nassert evens(0) == []\n"
    stub = run_program("def evens(n):\n    return []\n", kind="script", tests=tests, limits=FAST)
    assert (stub.passed, stub.total) == (1, 2) and "1 never ran" in stub.error
    good = "def evens(n):\n    return [i for i in range(n) if i % 2 == 0]\n"
    res = run_program(good, kind="script", tests=tests, limits=FAST)
    assert (res.passed, res.total, res.error) == (2, 2, None)


def test_calls_by_value_exceptions_and_in_place_changes():
    program = (
        "def sort_in_place(xs):\n    xs.sort()\n\n"
        "def root(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x ** 0.5\n\n"
        "def pair(a, b=0):\n    return (a, b)\n\n"
        "LIMIT = (1, 2)\n"
    )
    tests = [
        "xs = [3, 1, 2]; sort_in_place(xs); assert xs == [1, 2, 3]",
        "try:\n    root(-1)\n    assert False\nexcept ValueError as e:\n    assert 'negative' in str(e) and root(4) == 2.0",
        "assert pair(1, b=2) == (1, 2) and pair(3) == (3, 0)",
        "assert LIMIT == (1, 2)",
    ]
    res = run_program(program, kind="asserts", tests=tests, limits=FAST)
    assert (res.passed, res.total, res.error) == (4, 4, None), res.error


def test_objects_of_the_program_do_not_cross():
    program = "class Box:\n    pass\n\ndef make():\n    return Box()\n\nBOX = Box()\n"
    tests = ["assert make() is not None", "assert BOX is not None and BOX == BOX"]
    res = run_program(program, kind="asserts", tests=tests, limits=FAST)
    assert res.passed == 0 and "not a plain value" in res.error


def test_threads_run_processes_do_not():
    program = (
        "import os, threading\n"
        "def total(n):\n    out = []\n    ts = [threading.Thread(target=out.append, args=(i,)) for i in range(n)]\n"
        "    [t.start() for t in ts]; [t.join() for t in ts]\n    return sum(out)\n"
        "def forks():\n    try:\n        os.fork()\n        return True\n    except PermissionError:\n        return False\n"
    )
    tests = ["assert total(4) == 6", "assert forks() is False"]
    res = run_program(program, kind="asserts", tests=tests, limits=FAST)
    assert (res.passed, res.total) == (2, 2), res.error


def test_memory_limit_is_the_programs_total():
    """One process holds all the program's memory: allocations past ``memory_bytes`` fail
    (a MemoryError the program may catch), and no second process can add more."""
    program = (
        "def grab(mb):\n    blocks = []\n    try:\n        for _ in range(mb):\n"
        "            blocks.append(bytearray(1 << 20))\n    except MemoryError:\n        pass\n"
        "    return len(blocks)\n"
    )
    limits = Limits(wall_seconds=20.0, cpu_seconds=10, memory_bytes=400 << 20)
    res = run_program(program, kind="asserts", tests=["assert 0 < grab(2000) < 400"], limits=limits)
    assert (res.passed, res.total) == (1, 1), res.error


def test_python_semantics_a_program_cannot_exploit():
    """Issue 44: the credit rules on two Python features a model can reach for.

    - An exception that would end an iteration of the tests' own code (``StopIteration``
      inside ``map``) is a plain failure of the call, as PEP 479 makes it in a generator: it
      no longer truncates ``list(map(add, ...))`` to the pairs that passed.
    - Arguments cross by value and come back changed only when the call returns None (an
      in-place function): ``xs.clear(); return []`` does not make ``my_sort(data) ==
      sorted(data)`` compare ``[]`` with ``[]``; ``xs.sort()`` returning None still sorts.
    """
    stop = (
        "calls = 0\n"
        "def add(a, b):\n    global calls\n    calls += 1\n"
        "    if calls > 1:\n        raise StopIteration\n    return a + b\n"
    )
    mapped = ["outs = list(map(add, [1, 2, 5], [2, 2, 5]))\n"
              "for got, want in zip(outs, [3, 4, 10]):\n    assert got == want"]  # fmt: skip
    res = run_program(stop, kind="asserts", tests=mapped, limits=FAST)
    assert (res.passed, res.total) == (0, 1), res
    assert "StopIteration" in res.error
    good = "def add(a, b):\n    return a + b\n"
    assert run_program(good, kind="asserts", tests=mapped, limits=FAST).passed == 1

    emptier = "def my_sort(xs):\n    xs.clear()\n    return []\n"
    sorts = ["data = [3, 1, 2]\nassert my_sort(data) == sorted(data)"]
    res = run_program(emptier, kind="asserts", tests=sorts, limits=FAST)
    assert (res.passed, res.total) == (0, 1), res
    honest = "def my_sort(xs):\n    return sorted(xs)\n"
    assert run_program(honest, kind="asserts", tests=sorts, limits=FAST).passed == 1


@pytest.mark.parametrize("reply", ["[1]", "42", '"ok"', "null"])
def test_a_first_reply_that_is_not_a_message_gives_no_credit_and_no_traceback(reply, capfd):
    """The program writes a JSON value that is not a dict on the reply pipe before the
    candidate's own reply: no credit, a plain failure, and no traceback from the harness."""
    program = (
        f"import os, sys\nos.write(int(sys.argv[2]), b'{reply}\\n')\n"
        "def add(a, b):\n    return a + b\n"
    )
    res = run_program(program, kind="asserts", tests=["assert add(1, 2) == 3"], limits=FAST)
    assert res.passed == 0 and not res.program_ok
    out = capfd.readouterr()
    assert "Traceback" not in (res.error or "") + res.stderr_tail + out.out + out.err


def test_a_nan_answer_satisfies_no_negated_comparison():
    """A NaN compares False with everything: ``not (f() > 3)`` and ``not (f() < 3)`` (a test
    of "exactly 3" written with orderings) both held for a program returning NaN, 1.0 for a
    wrong answer. A NaN now gets no credit from a negated ordering or from ``!=``; the
    positive forms fail on NaN as they always did, and a real 3 still passes."""
    tests = ["assert not (f(1, 2) > 3)", "assert not (f(1, 2) < 3)", "assert f(1, 2) != 4"]
    nan = run_program("def f(a, b):\n    return float('nan')\n", kind="asserts", tests=tests,
                      limits=FAST)  # fmt: skip
    assert (nan.passed, nan.total) == (0, 3)
    three = run_program("def f(a, b):\n    return a + b\n", kind="asserts", tests=tests,
                        limits=FAST)  # fmt: skip
    assert (three.passed, three.total) == (3, 3)

import asyncio
import math
import time

import pytest

from grpo_core.rewards import ScoreResult, score_completions

PROMPTS = ["p0", "p1", "p2", "p3"]
COMPLETIONS = [
    "<think>2+2</think><answer>4</answer>",
    "<think>hm</think><answer>5</answer>",
    "no tags at all",
    [{"role": "assistant", "content": "<think>x</think> <answer>7</answer>"}],
]
ANSWERS = [4, "4", 3, None]


def test_builtin_weighted_total():
    res = score_completions(
        PROMPTS, COMPLETIONS, {"answer": ANSWERS}, {"accuracy": 1.0, "format": 0.5}
    )
    assert isinstance(res, ScoreResult)
    assert res.per_function["accuracy"] == [1.0, 0.0, 0.0, None]
    assert res.per_function["format"] == [1.0, 1.0, 0.0, 1.0]
    assert res.total == [1.5, 0.5, 0.0, 0.5]  # None counts as missing (TRL nansum)
    assert all(e is None for errs in res.errors.values() for e in errs)
    m = res.metrics()
    assert m["rewards/accuracy/mean"] == pytest.approx(1 / 3)
    assert "reward" not in m  # the batch's reward metrics come from advantages.group_stats
    assert m["rewards/format/error_rate"] == 0.0


def test_all_none_row_is_unscorable():
    def nothing(prompts, completions, **_):
        return [None] * len(completions)

    res = score_completions(["p"], ["c"], {}, {"n": 2.0}, functions={"n": nothing})
    assert res.total == [None]  # as advantages.weighted_reward_sum: NaN, left out of statistics
    assert res.per_function["n"] == [None]


def test_failing_rows_are_isolated():
    def picky(prompts, completions, answer, **_):
        out = []
        for c, a in zip(completions, answer, strict=True):
            if a == "bad":
                raise ValueError(f"cannot use gold {a!r}")
            out.append(1.0 if c == a else 0.0)
        return out

    res = score_completions(
        ["p"] * 3,
        ["x", "y", "z"],
        {"answer": ["x", "bad", "q"]},
        {"picky": 1.0},
        functions={"picky": picky},
    )
    assert res.per_function["picky"] == [1.0, None, 0.0]
    assert res.errors["picky"] == [None, "ValueError: cannot use gold 'bad'", None]
    assert res.total == [1.0, None, 0.0]


def test_wrong_length_and_non_numbers_are_errors():
    def short(prompts, completions, **_):
        return [1.0]

    def stringy(prompts, completions, **_):
        return ["1.0", 2, float("nan"), float("inf")]

    res = score_completions(
        ["p"] * 4, list("abcd"), {}, {"short": 1.0, "stringy": 1.0},
        functions={"short": short, "stringy": stringy},
    )  # fmt: skip
    assert res.per_function["short"] == [None] * 4
    assert all("'short' returned 1 values for 4 completions" in e for e in res.errors["short"])
    assert res.per_function["stringy"] == [None, 2.0, None, None]
    assert "returned str" in res.errors["stringy"][0]
    # NaN: not applicable in the total (TRL's nansum), but reported: on every row it stops
    assert "returned NaN" in res.errors["stringy"][2]
    assert "inf" in res.errors["stringy"][3]
    assert res.total == [None, 2.0, None, None]


def test_async_functions_run_concurrently():
    async def slow_a(prompts, completions, **_):
        await asyncio.sleep(0.3)
        return [1.0] * len(completions)

    async def slow_b(prompts, completions, **_):
        await asyncio.sleep(0.3)
        return [2.0] * len(completions)

    t0 = time.perf_counter()
    res = score_completions(
        ["p"] * 2, ["a", "b"], {}, {"a": 1.0, "b": 0.5}, functions={"a": slow_a, "b": slow_b}
    )
    assert time.perf_counter() - t0 < 0.55
    assert res.total == [2.0, 2.0]


def test_async_failing_batch_retried_per_row():
    async def flaky(prompts, completions, **_):
        if any(c == "boom" for c in completions):
            raise RuntimeError("boom")
        return [1.0] * len(completions)

    res = score_completions(["p"] * 3, ["a", "boom", "c"], {}, {"f": 1.0}, functions={"f": flaky})
    assert res.per_function["f"] == [1.0, None, 1.0]
    assert res.errors["f"][1] == "RuntimeError: boom"


def test_async_inside_running_loop():
    async def f(prompts, completions, **_):
        return [1.0] * len(completions)

    async def main():
        return score_completions(["p"], ["a"], {}, {"f": 1.0}, functions={"f": f})

    assert asyncio.run(main()).total == [1.0]


def test_mismatched_columns_raise():
    with pytest.raises(ValueError, match="column 'answer' has 1 rows for 2"):
        score_completions(["p", "p"], ["a", "b"], {"answer": [1]}, {"accuracy": 1.0})
    with pytest.raises(ValueError, match="unknown reward function"):
        score_completions(["p"], ["a"], {}, {"nope": 1.0})


def test_numpy_scalars_accepted():
    np = pytest.importorskip("numpy")

    def f(prompts, completions, **_):
        return np.array([0.25, 1.0])

    res = score_completions(["p"] * 2, ["a", "b"], {}, {"f": 2.0}, functions={"f": f})
    assert res.total == [0.5, 2.0]
    assert not any(math.isnan(t) for t in res.total)

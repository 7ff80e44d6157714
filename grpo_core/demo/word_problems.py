"""Arithmetic word problems with a short worked trace, for a small pretrained chat model.

Prompt (chat messages): ``Mia has 12 apples. She buys 5 more and then gives away 7. How many
apples does Mia have now?``; completion ``<think>12+5=17, 17-7=10</think><answer>10</answer>``
(about 20 tokens with a SmolLM2/Llama-style tokenizer). One or two operations on numbers up to
``max_number``; every answer is a non-negative integer. The splits come from one seeded list of
distinct problems and never share one (``data.source: word_problems``).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from grpo_core.demo.task import DemoSplits, split_rows
from grpo_core.engines.environments import CALL_END, CALL_START, RESULT_END, RESULT_START

NAMES = [
    ("Mia", "She"),
    ("Leo", "He"),
    ("Ava", "She"),
    ("Sam", "He"),
    ("Zoe", "She"),
    ("Ben", "He"),
    ("Ivy", "She"),
    ("Tom", "He"),
]
ITEMS = ["apples", "marbles", "stickers", "cookies", "pencils", "cards", "shells", "books"]

# (question template, trace builder, answer) from (a, b, c); None when the numbers don't fit
Problem = tuple[str, str, int]


def _add_sub(n, p, item, a, b, c) -> Problem | None:
    if a + b < c:
        return None
    q = f"{n} has {a} {item}. {p} buys {b} more and then gives away {c}. How many {item} does {n} have now?"
    return q, f"{a}+{b}={a + b}, {a + b}-{c}={a + b - c}", a + b - c


def _sub_add(n, p, item, a, b, c) -> Problem | None:
    if a < b:
        return None
    q = f"{n} has {a} {item}. {p} loses {b} of them and then finds {c} more. How many {item} does {n} have now?"
    return q, f"{a}-{b}={a - b}, {a - b}+{c}={a - b + c}", a - b + c


def _mul_sub(n, p, item, a, b, c) -> Problem | None:
    a, b = a % 9 + 2, b % 9 + 2  # small factors
    if a * b < c:
        return None
    q = f"{n} buys {a} bags with {b} {item} in each. {p} gives away {c} {item}. How many {item} does {n} have left?"
    return q, f"{a}*{b}={a * b}, {a * b}-{c}={a * b - c}", a * b - c


def _mul(n, p, item, a, b, c) -> Problem | None:
    a, b = a % 9 + 2, b % 9 + 2
    q = f"There are {a} boxes with {b} {item} in each box. How many {item} are there in all?"
    return q, f"{a}*{b}={a * b}", a * b


def _div(n, p, item, a, b, c) -> Problem | None:
    k, each = a % 5 + 2, b % 9 + 2  # friends, share
    total = k * each
    q = f"{n} has {total} {item} and shares them equally among {k} friends. How many {item} does each friend get?"
    return q, f"{total}/{k}={each}", each


def _add_add(n, p, item, a, b, c) -> Problem | None:
    q = f"{n} has {a} {item}. {p} gets {b} more on Monday and {c} more on Tuesday. How many {item} does {n} have now?"
    return q, f"{a}+{b}={a + b}, {a + b}+{c}={a + b + c}", a + b + c


KINDS: list[Callable[..., Problem | None]] = [_add_sub, _sub_add, _mul_sub, _mul, _div, _add_add]


def completion(trace: str, answer: int) -> str:
    return f"<think>{trace}</think><answer>{answer}</answer>"


def expression(trace: str) -> str:
    """The trace's steps as one Python expression: ``12+5=17, 17-7=10`` -> ``(12+5)-7``
    (``/`` as ``//``: every answer is an integer)."""
    steps = [s.split("=") for s in trace.split(", ")]
    expr, value = steps[0][0], steps[0][1]
    for lhs, result in steps[1:]:
        expr, value = lhs.replace(value, f"({expr})", 1), result
    return expr.replace("/", "//")


def tool_completion(trace: str, answer: int) -> str:
    """The completion that computes with the python tool (rollout.tools, docs/tools.md)."""
    call = f"{CALL_START}{expression(trace)}{CALL_END}{RESULT_START}{answer}{RESULT_END}"
    return f"<think>{call}</think><answer>{answer}</answer>"


def make_splits(
    seed: int,
    n_sft: int = 400,
    n_rl: int = 2000,
    n_dev: int = 0,
    n_eval: int = 100,
    max_number: int = 20,
    tools: bool = False,
) -> DemoSplits:
    """Disjoint splits of distinct word problems; rows carry prompt (one user message), answer
    (text) and, in the SFT split, completion (``tools``: one that calls the python tool)."""
    rng = random.Random(seed)
    n_total = n_sft + n_rl + n_dev + n_eval
    seen: set[str] = set()
    problems: list[Problem] = []
    tries = 0
    while len(problems) < n_total:
        tries += 1
        if tries > 50 * n_total + 1000:
            raise ValueError(
                f"word problems: only {len(problems)} distinct problems found for {n_total} asked "
                f"(max_number={max_number}); lower the split sizes or raise max_number"
            )
        name, pron = rng.choice(NAMES)
        kind = rng.choice(KINDS)
        a, b, c = (rng.randint(2, max_number) for _ in range(3))
        made = kind(name, pron, rng.choice(ITEMS), a, b, c)
        if made is None or made[0] in seen:
            continue
        seen.add(made[0])
        problems.append(made)

    return split_rows(
        problems,
        n_eval=n_eval,
        n_dev=n_dev,
        n_sft=n_sft,
        row=lambda p: {"prompt": [{"role": "user", "content": p[0]}], "answer": str(p[2])},
        completion=lambda p: (tool_completion if tools else completion)(p[1], p[2]),
    )


def gsm8k_rows(rows: list[dict]) -> list[dict]:
    """The rows in GSM8K's own layout (``question``; ``answer``: worked solution, then
    ``#### N``), for trying ``data.preset: gsm8k`` without downloading GSM8K."""
    out = []
    for r in rows:
        trace = r["completion"].split("<think>", 1)[1].split("</think>", 1)[0]
        out.append(
            {"question": r["prompt"][0]["content"], "answer": f"{trace}\n#### {r['answer']}"}
        )
    return out


def save_gsm8k_like(out_dir: str, *, seed: int = 0, n_train: int = 2000, n_test: int = 200) -> str:
    """A ``datasets`` DatasetDict (``train``, ``test``) in GSM8K's layout, saved with
    ``save_to_disk`` at ``out_dir`` (``configs/gpu.yaml`` reads ``out_dir::train``)."""
    from datasets import Dataset, DatasetDict

    s = make_splits(seed, n_sft=n_train + n_test, n_rl=1, n_dev=0, n_eval=1, max_number=50)
    rows = gsm8k_rows(s.sft)
    DatasetDict(
        {"train": Dataset.from_list(rows[:n_train]), "test": Dataset.from_list(rows[n_train:])}
    ).save_to_disk(out_dir)
    return out_dir


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="write generated word problems in GSM8K's layout")
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-train", type=int, default=2000)
    ap.add_argument("--n-test", type=int, default=200)
    a = ap.parse_args()
    print(save_gsm8k_like(a.out_dir, seed=a.seed, n_train=a.n_train, n_test=a.n_test))

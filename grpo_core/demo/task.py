"""Multi-digit addition with a worked, column-by-column reasoning trace.

Prompt ``357+468``; completion ``<think>7+8=15,5+6+1=12,3+4+1=8</think><answer>825</answer>``:
the trace works from the units digit and writes each carry as ``+1``. Problems are drawn
from a seed; the SFT, RL, dev and eval splits come from one shuffled list and never share
a problem.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

P = TypeVar("P")  # one problem, as the split's maker draws it


def worked_trace(a: int, b: int) -> str:
    """The R1-format completion for ``a+b`` (without the EOS token)."""
    da, db = str(a)[::-1], str(b)[::-1]
    steps, carry = [], 0
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        s = x + y + carry
        steps.append(f"{x}+{y}" + ("+1" if carry else "") + f"={s}")
        carry = s // 10
    return f"<think>{','.join(steps)}</think><answer>{a + b}</answer>"


def prompt_messages(a: int, b: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{a}+{b}"}]


@dataclass(frozen=True)
class DemoSplits:
    sft: list[dict]
    rl: list[dict]
    dev: list[dict]
    eval: list[dict]


def make_splits(
    seed: int,
    digits: int = 3,
    n_sft: int = 1000,
    n_rl: int = 20000,
    n_dev: int = 100,
    n_eval: int = 200,
) -> DemoSplits:
    """Disjoint splits of ``digits``-digit addition problems; rows carry prompt/answer/completion."""
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    n_total = n_sft + n_rl + n_dev + n_eval
    space = (hi - lo + 1) ** 2
    if n_total > space:
        raise ValueError(
            f"demo data: asked for {n_total} problems, only {space} exist at {digits} digits"
        )
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    pairs: list[tuple[int, int]] = []
    while len(pairs) < n_total:
        p = (rng.randint(lo, hi), rng.randint(lo, hi))
        if p not in seen:
            seen.add(p)
            pairs.append(p)

    return split_rows(
        pairs,
        n_eval=n_eval,
        n_dev=n_dev,
        n_sft=n_sft,
        row=lambda ab: {"prompt": prompt_messages(*ab), "answer": str(ab[0] + ab[1])},
        completion=lambda ab: worked_trace(*ab),
    )


def split_rows(
    problems: Sequence[P],
    *,
    n_eval: int,
    n_dev: int,
    n_sft: int,
    row: Callable[[P], dict],
    completion: Callable[[P], str],
) -> DemoSplits:
    """``problems`` cut in order into the eval, dev, SFT and RL splits (the rest), each
    problem a row ``row(problem)``; SFT rows also carry ``completion(problem)``."""

    def rows(chunk: Sequence[P], with_completion: bool) -> list[dict]:
        out = []
        for problem in chunk:
            r = row(problem)
            if with_completion:
                r["completion"] = completion(problem)
            out.append(r)
        return out

    cuts = [n_eval, n_eval + n_dev, n_eval + n_dev + n_sft]
    return DemoSplits(
        eval=rows(problems[: cuts[0]], False),
        dev=rows(problems[cuts[0] : cuts[1]], False),
        sft=rows(problems[cuts[1] : cuts[2]], True),
        rl=rows(problems[cuts[2] :], False),
    )

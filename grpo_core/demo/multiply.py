"""Multiplication, the tool demo's task (``data.source: multiply``, configs/demo-tools.yaml):
``a*b`` with a 3-digit ``a`` and a 2-digit ``b``, answer in ``<answer>``.

A 1M-parameter model cannot multiply reliably in its head; with the ``python`` tool it only
has to copy the numbers into a call and the result into its answer. The SFT traces show
either way (``tools``):

- with the tool: ``<think><tool_call>357*46</tool_call><tool_response>16422</tool_response>
  </think><answer>16422</answer>`` (the response is the tool's output: the SFT loss skips it,
  ``sft.mask_spans``, as the RL update masks what the tool returns);
- without: the long multiplication written out, ``<think>357*6=2142,357*40=14280,
  2142+14280=16422</think><answer>16422</answer>``, the best a policy without a tool can
  learn from.
"""

from __future__ import annotations

import random

from grpo_core.demo.task import DemoSplits, split_rows
from grpo_core.engines.environments import CALL_END, CALL_START, RESULT_END, RESULT_START


def tool_trace(a: int, b: int) -> str:
    call = f"{CALL_START}{a}*{b}{CALL_END}{RESULT_START}{a * b}{RESULT_END}"
    return f"<think>{call}</think><answer>{a * b}</answer>"


def worked_trace(a: int, b: int) -> str:
    """Partial products by the digits of ``b``, units first, then their sum."""
    digits = [int(d) * 10**i for i, d in enumerate(reversed(str(b)))]
    parts = [a * d for d in digits]
    steps = [f"{a}*{d}={p}" for d, p in zip(digits, parts, strict=True)]
    steps.append("+".join(map(str, parts)) + f"={a * b}")
    return f"<think>{','.join(steps)}</think><answer>{a * b}</answer>"


def balance_lengths(pairs: list[tuple[int, int]], start: int, stop: int) -> None:
    """Swap problems of ``pairs[start:stop]`` (the SFT split) with ones after ``stop`` (the
    RL split) until half of the split has a 4-digit product, in place: about a fifth of all
    products have 4 digits, and a small model fitted to the natural mix copies every result
    as if it had 5 (docs/tools.md)."""

    def four_digit(i: int) -> bool:
        return pairs[i][0] * pairs[i][1] < 10_000

    want = (stop - start) // 2
    n_four = sum(four_digit(i) for i in range(start, stop))
    fives = (i for i in range(start, stop) if not four_digit(i))
    spare = (i for i in range(stop, len(pairs)) if four_digit(i))
    for _ in range(want - n_four):
        i, j = next(fives), next(spare, None)
        if j is None:
            raise ValueError("multiply data: too few RL problems to balance the SFT split")
        pairs[i], pairs[j] = pairs[j], pairs[i]


def balance_rest(pairs: list[tuple[int, int]], start: int) -> list[tuple[int, int]]:
    """``pairs`` with the problems from ``start`` on (the RL split) cut to as many 5-digit
    products as there are 4-digit ones, alternating: RL then samples both kinds equally
    often, where about a fifth of all products have 4 digits (the split shrinks to about
    two fifths of its size)."""
    rest = pairs[start:]
    fours = [p for p in rest if p[0] * p[1] < 10_000]
    fives = [p for p in rest if p[0] * p[1] >= 10_000]
    n = min(len(fours), len(fives))
    return pairs[:start] + [p for pair in zip(fours[:n], fives[:n], strict=True) for p in pair]


def make_splits(
    seed: int,
    n_sft: int,
    n_rl: int,
    n_dev: int,
    n_eval: int,
    *,
    tools: bool = True,
    balance_sft: bool = False,
    balance_rl: bool = False,
) -> DemoSplits:
    """Disjoint splits of 3-digit x 2-digit products; SFT rows carry the tool-using trace
    (``tools``) or the worked one; ``balance_sft``: as many 4-digit products as 5-digit ones
    in the SFT split (:func:`balance_lengths`); ``balance_rl``: the RL split holds as many of
    each (:func:`balance_rest`)."""
    n_total = n_sft + n_rl + n_dev + n_eval
    space = 900 * 90
    if n_total > space:
        raise ValueError(f"multiply data: asked for {n_total} problems, only {space} exist")
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    pairs: list[tuple[int, int]] = []
    while len(pairs) < n_total:
        p = (rng.randint(100, 999), rng.randint(10, 99))
        if p not in seen:
            seen.add(p)
            pairs.append(p)
    if balance_sft:
        balance_lengths(pairs, n_eval + n_dev, n_eval + n_dev + n_sft)
    if balance_rl:
        pairs = balance_rest(pairs, n_eval + n_dev + n_sft)
    trace = tool_trace if tools else worked_trace
    return split_rows(
        pairs,
        n_eval=n_eval,
        n_dev=n_dev,
        n_sft=n_sft,
        row=lambda ab: {
            "prompt": [{"role": "user", "content": f"{ab[0]}*{ab[1]}"}],
            "answer": str(ab[0] * ab[1]),
        },
        completion=lambda ab: trace(*ab),
    )

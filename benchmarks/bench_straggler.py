"""What one slow tool call costs a batch of tool episodes, and the tokens sampled past each
episode's own budget, with the turn loop's barrier and with ``rollout.tool_wait_s`` (issue
goal: a 1 s call in one of 64 episodes adds at most 0.2 s to the batch's wall, and no
episode samples past its budget).

    python benchmarks/bench_straggler.py [--episodes 64] [--turns 4] [--slow 1.0] [--repeats 3]
        [--hidden 128 --layers 4] [--wait-s none 0.1]

The model and prompts are benchmarks/bench_turn_prefill.py's (a random Qwen2 of the tool
demo's shape, or ``--hidden``/``--layers``, whose logits are clocked so that every turn ends
in a call); the environment answers every call at once, except that episode 0's first call
takes ``--slow`` seconds in the "one slow call" arm. Per ``tool_wait_s`` value, ``--repeats``
pairs of whole turn loops of the hf engine, the two arms alternating in this one process;
the medians of each arm's wall and of the pairs' differences; the model tokens the last
pair's episodes kept (an arm whose rounds are the barrier's keeps the barrier's count).
Sampled past budget: tokens the engine returned beyond what the episodes kept, all runs. Whatever the loop does, the slow episode
cannot end before its call has answered and its later turns are sampled, so the added
wall can be small only where the batch's own wall is well over ``--slow``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_turn_prefill import TURN, clock_model, prompts  # noqa: E402

from grpo_core.engines.environments import Observation, ToolSpec  # noqa: E402
from grpo_core.engines.generation import SamplingParams  # noqa: E402
from grpo_core.engines.hf import HFEngine  # noqa: E402
from grpo_core.engines.turns import run_turns  # noqa: E402


class OneSlow:
    """Answers every call at once with 4-12 tokens; a row with ``slow`` > 0 waits that long
    on its first call."""

    def __init__(self, spec):
        self.spec = spec

    def start(self, row):
        return _Episode(float((row or {}).get("slow", 0.0)))


class _Episode:
    def __init__(self, slow: float):
        self.slow, self.turn = slow, 0

    def step(self, text):
        self.turn += 1
        if self.turn == 1 and self.slow:
            time.sleep(self.slow)
        body = "7" * (2 + (len(text) * 7 + self.turn * 3) % 9)
        return Observation(f"<tool_response>{body}</tool_response>")


class Counting:
    """The engine, counting the completion tokens its ``generate`` returns."""

    def __init__(self, engine):
        self.engine, self.sampled = engine, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, *args, **kw):
        out = self.engine.generate(*args, **kw)
        self.sampled += sum(len(s.completion_ids) for s in out)
        return out


def once(model, tok, episodes: int, turns: int, slow: float, budget: int,
         wait_s: float | None = None):  # fmt: skip
    """One whole turn loop: (wall s, tokens returned by the engine, tokens the episodes
    kept)."""
    spec = ToolSpec(tools=(f"{Path(__file__).resolve()}:OneSlow",), max_turns=turns,
                    max_tool_output_tokens=16, tool_workers=episodes,
                    tool_wait_s=wait_s)  # fmt: skip
    rows = [{"slow": slow if i == 0 else 0.0} for i in range(episodes)]
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=budget, seed=0)
    engine = Counting(HFEngine(model, tok))
    t0 = time.perf_counter()
    out = run_turns(engine, prompts(tok, episodes), params, desc="bench", progress=False,
                    tools=spec, rows=rows)  # fmt: skip
    wall = time.perf_counter() - t0
    kept = sum(t["end"] - t["start"] for s in out for t in s.turns if t["role"] == "assistant")
    return wall, engine.sampled, kept


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--slow", type=float, default=1.0, help="seconds of episode 0's first call")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--hidden", type=int, default=128, help="the model's hidden size")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--wait-s", type=_wait, nargs="+", default=[None, 0.1],
                   help="rollout.tool_wait_s values to measure ('none': the barrier)")  # fmt: skip
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model, tok = clock_model(hidden_size=a.hidden, layers=a.layers)
    # a budget the turns cannot all fill: later turns start with different budgets left
    budget = TURN * a.turns + 8 * (a.turns - 1)
    print(f"{a.episodes} episodes, {a.turns} turns, budget {budget} tokens, torch threads "
          f"{torch.get_num_threads()}, {a.repeats} pairs per row", file=sys.stderr)  # fmt: skip
    head = ["rollout.tool_wait_s", "wall s, all calls instant", f"wall s, one {a.slow:g} s call",
            "added by the slow call s", "tokens kept (instant / slow)",
            "sampled past budget"]  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|---|---:|---:|---:|---:|---:|")
    for wait_s in a.wait_s:
        # the two arms alternate, so a drift of the machine's speed hits both alike
        pairs = [
            (once(model, tok, a.episodes, a.turns, 0.0, budget, wait_s),
             once(model, tok, a.episodes, a.turns, a.slow, budget, wait_s))
            for _ in range(a.repeats)
        ]  # fmt: skip
        fast = statistics.median(f[0] for f, _ in pairs)
        slow = statistics.median(s[0] for _, s in pairs)
        added = statistics.median(s[0] - f[0] for f, s in pairs)
        runs = [run for pair in pairs for run in pair]
        sampled, past = sum(r[1] for r in runs), sum(r[1] - r[2] for r in runs)
        mode = "null (barrier)" if wait_s is None else f"{wait_s:g}"
        print(f"| {mode} | {fast:.3f} | {slow:.3f} | {added:.3f} | "
              f"{pairs[-1][0][2]:,} / {pairs[-1][1][2]:,} | "
              f"{past:,} of {sampled:,} ({past / sampled:.1%}) |")  # fmt: skip


def _wait(value: str) -> float | None:
    return None if value in ("none", "null") else float(value)


if __name__ == "__main__":
    main()

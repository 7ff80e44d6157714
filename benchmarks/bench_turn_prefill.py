"""Prefill tokens and wall per tool episode at 1, 2, 4, 8 turns: the hf engine feeding each
turn the whole context (``turn_cache=False``, the old path) against keeping each episode's
KV cache across its turns (grpo_core/engines/turn_cache.py).

    python benchmarks/bench_turn_prefill.py [--episodes 128] [--repeats 3] [--decode dynamic]
        [--threads 1]

The model is the tool demo's shape (a 4-layer, 128-wide Qwen2, random weights, the tool
vocabulary) with a clock on its logits: the call marker ``</tool_call>`` is forced at every
``TURN``-th position and never elsewhere, EOS never, so every turn is a call and every
episode runs its turns out; the environment answers each call with an observation of 4-12
tokens. 128 episodes: as many as the tool demo samples an iteration (16 prompts x 8).
Prefill tokens: the real tokens fed to the model's prefill forwards, as the engine counts
them (``HFEngine.fed``); wall: the best of ``--repeats`` runs of the whole turn loop, both
paths in this one process.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from grpo_core.demo.model import build_model, build_tokenizer
from grpo_core.engines.environments import Observation, ToolSpec
from grpo_core.engines.generation import SamplingParams
from grpo_core.engines.hf import HFEngine
from grpo_core.engines.turns import run_turns

TURN = 6  # positions per model turn: the call marker ends each turn at this clock
OBS = 8  # a turn's observation: 4 to 12 tokens, markers included


def clock_model(hidden_size: int = 128, layers: int = 4, seed: int = 0):
    """The tool vocabulary's tokenizer and a random Qwen2 whose logits are clocked: the call
    marker at positions ``TURN - 1, 2 TURN - 1, ...`` (greedy and sampled alike), never EOS.
    The clock is a forward hook: any forward of the model (the trainer's too) sees it."""
    tok = build_tokenizer("tools")
    model = build_model(tok, hidden_size=hidden_size, num_hidden_layers=layers,
                        num_attention_heads=4, intermediate_size=4 * hidden_size, seed=seed)  # fmt: skip
    model.eval()
    call = tok.convert_tokens_to_ids("</tool_call>")

    def clock(module, args, kwargs, out):
        logits = out.logits  # [b, q, V]
        pos = kwargs.get("position_ids")
        if pos is None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            pos = torch.arange(ids.shape[1], device=logits.device).expand(ids.shape[0], -1)
        pos = pos[:, -logits.shape[1] :]  # the positions whose logits came back
        at = ((pos + 1) % TURN == 0).to(logits.dtype)  # [b, q]
        logits[..., tok.eos_token_id] -= 50.0
        logits[..., call] += at * 100.0 - 50.0
        return out

    model.register_forward_hook(clock, with_kwargs=True)
    return model, tok


class AlwaysCall:
    """An environment whose episodes answer every call: ``OBS`` +- 4 tokens, by the turn."""

    def __init__(self, spec):
        self.spec = spec

    def start(self, row):
        return _Episode()


class _Episode:
    def __init__(self):
        self.turn = 0

    def step(self, text):
        self.turn += 1
        body = "7" * (OBS - 6 + (len(text) * 7 + self.turn * 3) % 9)
        return Observation(f"<tool_response>{body}</tool_response>")


def spec(turns: int) -> ToolSpec:
    return ToolSpec(tools=(f"{Path(__file__).resolve()}:AlwaysCall",), max_turns=turns,
                    max_tool_output_tokens=16, tool_workers=1)  # fmt: skip


def prompts(tok, episodes: int) -> list[list[int]]:
    return [tok.encode(f"<|user|>{100 + 37 * i}*{10 + i}<|assistant|>", add_special_tokens=False)
            for i in range(episodes)]  # fmt: skip


def measure(model, tok, turns: int, kept: bool, episodes: int, decode: str, params, repeats):
    """(prefill tokens, prefill positions, best wall seconds, samples) of one turn loop."""
    engine = HFEngine(model, tok, decode=decode, turn_cache=kept)
    best, out = float("inf"), None
    for _ in range(repeats):
        engine.fed = dict.fromkeys(engine.fed, 0)
        t0 = time.perf_counter()
        out = run_turns(engine, prompts(tok, episodes), params, desc="bench", progress=False,
                        tools=spec(turns))  # fmt: skip
        best = min(best, time.perf_counter() - t0)
    return engine.fed["prefill_tokens"], engine.fed["prefill_positions"], best, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode", default="dynamic", choices=["dynamic", "static"])
    p.add_argument("--turns", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model, tok = clock_model()
    print(f"{a.episodes} episodes, {TURN} positions a turn, decode {a.decode}, "
          f"torch threads {torch.get_num_threads()}", file=sys.stderr)  # fmt: skip
    head = ["turns", "prefill tokens (old)", "prefill tokens (kept)", "old / kept",
            "wall s (old)", "wall s (kept)", "old / kept"]  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---:|" * len(head))
    for turns in a.turns:
        params = SamplingParams(n=1, temperature=1.0, max_new_tokens=TURN * turns + 16 * turns,
                                seed=0)  # fmt: skip
        old = measure(model, tok, turns, False, a.episodes, a.decode, params, a.repeats)
        new = measure(model, tok, turns, True, a.episodes, a.decode, params, a.repeats)
        got = max(sum(t["role"] == "assistant" for t in s.turns) for s in new[3])
        assert got == turns, f"episodes ran {got} turns, not {turns}"
        print(f"| {turns} | {old[0]:,} | {new[0]:,} | {old[0] / new[0]:.2f}x | {old[2]:.3f} | "
              f"{new[2]:.3f} | {old[2] / new[2]:.2f}x |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

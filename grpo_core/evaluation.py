"""Held-out evaluation: greedy pass@1, format rate and mean completion length.

The same rows, decoding and reward functions are used for every stage's checkpoint, so
the numbers are comparable across the pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo_core import rewards
from grpo_core.generation import SamplingParams, generate
from grpo_core.text import decode_completion, encode_prompt, prompt_text


@dataclass
class EvalResult:
    accuracy: float  # greedy pass@1
    format_rate: float
    mean_length: float  # completion tokens
    num_examples: int
    table: list[dict]  # one row per example: prompt, completion, answer, scores

    def summary(self) -> dict[str, float]:
        return {
            "accuracy": self.accuracy,
            "format_rate": self.format_rate,
            "mean_length": self.mean_length,
            "num_examples": float(self.num_examples),
        }


def passthrough_columns(rows: list[dict]) -> dict[str, list]:
    """Every column but ``prompt``/``completion``, as lists (TRL passes them by name)."""
    keys = [k for k in rows[0] if k not in ("prompt", "completion")] if rows else []
    return {k: [r.get(k) for r in rows] for k in keys}


def evaluate(
    model,
    tokenizer,
    rows: list[dict],
    *,
    max_new_tokens: int,
    accuracy_reward: str = "accuracy",
    format_reward: str = "format",
    batch_size: int = 512,
    temperature: float = 0.0,
    seed: int = 0,
    desc: str = "eval",
    engine=None,
) -> EvalResult:
    """Greedy (``temperature=0``) completions scored for accuracy and format. ``engine``: a
    ``grpo_core.engines`` rollout engine holding ``model``'s weights (default: HF generate)."""
    if not rows:
        raise ValueError("evaluation: no rows")
    prompt_ids = [encode_prompt(tokenizer, r["prompt"]) for r in rows]
    params = SamplingParams(n=1, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    if engine is not None:
        samples = engine.generate(prompt_ids, params, desc=desc)
    else:
        samples = generate(
            model,
            prompt_ids,
            params,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_ids=tokenizer.eos_token_id,
            batch_size=batch_size,
            desc=desc,
        )
    completions = [decode_completion(tokenizer, s.completion_ids) for s in samples]
    prompts = [r["prompt"] for r in rows]
    scored = rewards.score_completions(
        prompts,
        completions,
        passthrough_columns(rows),
        {accuracy_reward: 1.0, format_reward: 1.0},
    )
    acc = [v or 0.0 for v in scored.per_function[accuracy_reward]]
    fmt = [v or 0.0 for v in scored.per_function[format_reward]]
    lengths = [len(s.completion_ids) for s in samples]
    table = [
        {
            "prompt": prompt_text(tokenizer, r["prompt"]),
            "completion": c,
            "answer": r.get("answer"),
            "correct": a,
            "formatted": f,
            "length": n,
            "finish_reason": s.finish_reason,
        }
        for r, c, a, f, n, s in zip(rows, completions, acc, fmt, lengths, samples, strict=True)
    ]
    n = len(rows)
    return EvalResult(sum(acc) / n, sum(fmt) / n, sum(lengths) / n, n, table)

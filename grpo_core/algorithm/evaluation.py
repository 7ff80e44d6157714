"""Held-out evaluation: pass@1 (and pass@k, maj@k over k samples), format rate and mean
completion length.

A completion is correct only when the accuracy reward gives it full credit (1.0): for code
(``code_tests``) a problem counts only when all its tests pass, pass@1 in its usual meaning;
the reward's own value (partial credit) is kept in the table as ``score``.

With ``num_samples=1`` (the default) the completion is greedy and ``accuracy`` is greedy
pass@1. With ``num_samples=k > 1`` each prompt gets k samples at ``temperature`` and:

- ``accuracy``: pass@1 estimated from the k samples (mean of c/k), the same as the mean of
  ``correct`` over the table's rows;
- ``pass_at_k``: the unbiased estimator of Chen et al. 2021 (arXiv:2107.03374),
  ``1 - C(n-c, k) / C(n, k)`` per problem with n=k samples of which c are correct, averaged;
- ``maj_at_k``: the share of problems where the most frequent extracted answer (ties: the
  answer seen first) is correct. Answers come from the accuracy reward's own extraction,
  declared where it is registered (``extract_answer``; ``accuracy``: the last ``<answer>``
  tag; ``math_verify``: the last ``\\boxed{}``, else the tag; numbers compare as numbers).
  Code has no answer to vote on (two programs that pass different tests are not "the same
  answer"), so for ``code_tests`` and any reward without an extraction it is ``None``.

The same rows, decoding and reward functions are used for every stage's checkpoint, so the
numbers are comparable across the pipeline.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from math import comb

from grpo_core import rewards
from grpo_core.algorithm import sampling
from grpo_core.contracts.rollouts import env_reward_columns, turn_calls
from grpo_core.contracts.text import decode_completion, model_text, row_prompt_text
from grpo_core.engines.context import model_context
from grpo_core.engines.generation import SamplingParams
from grpo_core.engines.hf import HFEngine
from grpo_core.engines.turns import SampleRequest

FULL_CREDIT = 1.0 - 1e-9


@dataclass
class EvalResult:
    accuracy: float  # pass@1: greedy, or estimated from num_samples samples
    format_rate: float
    mean_length: float  # completion tokens
    num_examples: int
    table: list[dict]  # one row per example and sample: prompt, completion, answer, scores
    num_samples: int = 1
    pass_at_k: float | None = None  # num_samples > 1
    maj_at_k: float | None = None  # num_samples > 1 and an answer extraction exists

    def summary(self) -> dict[str, float]:
        out = {
            "accuracy": self.accuracy,
            "format_rate": self.format_rate,
            "mean_length": self.mean_length,
            "num_examples": float(self.num_examples),
        }
        if self.num_samples > 1:
            out["num_samples"] = float(self.num_samples)
            out["pass_at_k"] = self.pass_at_k
            if self.maj_at_k is not None:
                out["maj_at_k"] = self.maj_at_k
        return out


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. 2021's unbiased pass@k of one problem: n samples, c of them correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def vote_key(answer: str) -> str:
    """Answers that are the same number vote together (``1,000`` and ``1000``)."""
    from grpo_core.rewards.accuracy import parse_number

    num = parse_number(answer)
    return f"number:{num}" if num is not None else f"text:{answer.strip()}"


def majority_correct(answers: list[str | None], correct: list[bool]) -> bool:
    """Whether the most frequent extracted answer (ties: seen first) is a correct one."""
    keys = [vote_key(a) if a is not None and a.strip() else None for a in answers]
    counts = Counter(k for k in keys if k is not None)
    if not counts:
        return False
    top = max(counts.values())
    winner = next(k for k in keys if k is not None and counts[k] == top)
    return any(ok for k, ok in zip(keys, correct, strict=True) if k == winner)


def passthrough_columns(rows: list[dict]) -> dict[str, list]:
    """Every column but ``prompt``/``completion``, as lists (TRL passes them by name)."""
    keys = [k for k in rows[0] if k not in ("prompt", "completion")] if rows else []
    return {k: [r.get(k) for r in rows] for k in keys}


def _context(model, engine) -> int | None:
    """The positions of the model that generates (``model``, else the engine's own)."""
    holder = model if model is not None else getattr(engine, "model", None)
    config = getattr(holder, "config", None) or getattr(engine, "config", None)
    return model_context(config) if config is not None else None


def _episode(s) -> dict:
    """A tool-using episode's columns (grpo_core/engines/turns.py): its turns and tool calls."""
    if s.turns is None:
        return {}
    return {"turns": s.turns, "tool_calls": sum(turn_calls(t)[0] for t in s.turns)}


def _seen_prompts(flat_rows: list[dict], samples) -> list:
    """Each sample's prompt as its model saw it: the row's, with what an environment's
    ``reset()`` added (grpo_core/engines/openings.py)."""
    return [
        r["prompt"] if s.prompt is None else s.prompt
        for r, s in zip(flat_rows, samples, strict=True)
    ]


def _table(tokenizer, rows: list[dict], samples: list, scores: dict[str, list]) -> list[dict]:
    """One dict per example and sample (the eval table): its prompt, the sample, the row's
    answer, and ``scores`` (``completion``, ``correct``, ``score``, ``formatted``, ``length``:
    one value per sample each)."""
    k = len(samples) // len(rows)  # prompt-major: row i's samples are [i*k, (i+1)*k)
    flat_rows = [r for r in rows for _ in range(k)]
    texts = {i: row_prompt_text(tokenizer, r) for i, r in enumerate(rows)}
    seen = _seen_prompts(flat_rows, samples)
    table = []
    for j, (r, s) in enumerate(zip(flat_rows, samples, strict=True)):
        prompt = (
            texts[j // k]
            if s.prompt is None
            else row_prompt_text(tokenizer, {**r, "prompt": seen[j]})
        )
        table.append({"prompt": prompt, "sample_idx": j % k, "completion": scores["completion"][j],
                      "answer": r.get("answer"), "correct": scores["correct"][j],
                      "score": scores["score"][j], "formatted": scores["formatted"][j],
                      "length": scores["length"][j], "finish_reason": s.finish_reason,
                      **_episode(s)})  # fmt: skip
    return table


def _add_k_sample_metrics(
    result: EvalResult, correct: list[float], completions: list[str], accuracy_reward: str
) -> None:
    """pass@k and (where the reward extracts an answer) maj@k over each row's k samples."""
    k, n_problems = result.num_samples, result.num_examples
    per_problem = [correct[i * k : (i + 1) * k] for i in range(n_problems)]
    result.pass_at_k = sum(pass_at_k(k, int(sum(p)), k) for p in per_problem) / n_problems
    extract = rewards.spec(accuracy_reward).extract_answer  # its registration's, if any
    if extract is not None:
        votes = [
            majority_correct(
                [extract(c) for c in completions[i * k : (i + 1) * k]],
                [bool(x) for x in per_problem[i]],
            )
            for i in range(n_problems)
        ]
        result.maj_at_k = sum(votes) / n_problems


def evaluate(
    model,
    tokenizer,
    rows: list[dict],
    *,
    max_new_tokens: int,
    accuracy_reward: str = "accuracy",
    format_reward: str = "format",
    batch_size: int = 512,
    temperature: float | None = None,
    num_samples: int = 1,
    seed: int = 0,
    desc: str = "eval",
    engine=None,
    request: SampleRequest | None = None,
    tools=None,
    run=None,
    context: int | None = None,
) -> EvalResult:
    """``num_samples`` completions per row (greedy for 1, unless ``temperature`` is given;
    ``temperature`` defaults to 1.0 for more), scored for accuracy and format.

    They are sampled as the rollouts are (grpo_core/algorithm/sampling.py:
    ``sample_episodes``): ``request`` is the ``SampleRequest`` naming the engine and its
    options (its params are this evaluation's), ``tools`` adds an environment to it (each
    episode starts from its row); ``engine``, a ``grpo_core.engines`` rollout engine holding
    ``model``'s weights, runs it here (default: the hf engine on ``model``, ``batch_size``
    sequences at a time), or ``run(prompt_ids, request)`` where the pipeline's executor
    samples (tasks/evaluate.py). ``context``: the model's positions (default: ``model``'s,
    else the engine's)."""
    if not rows:
        raise ValueError("evaluation: no rows")
    if num_samples < 1:
        raise ValueError(f"evaluation: num_samples must be >= 1, got {num_samples}")
    if temperature is None:
        temperature = 0.0 if num_samples == 1 else 1.0
    k = num_samples
    params = SamplingParams(n=k, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    request = replace(request or SampleRequest(params), params=params, desc=desc)
    if context is None:
        context = _context(model, engine)
    if engine is None and run is None:
        engine = HFEngine(model, tokenizer, batch_size=batch_size)
    _, samples = sampling.sample_episodes(engine, tokenizer, rows, request, tools=tools, run=run,
                                          context=context, field="eval.max_completion_length")  # fmt: skip
    # samples are prompt-major: row i's k samples are samples[i*k : (i+1)*k]
    flat_rows = [r for r in rows for _ in range(k)]
    completions = [decode_completion(tokenizer, s.completion_ids) for s in samples]
    columns = passthrough_columns(flat_rows)
    # what the model wrote is scored; a tool's output is not its answer (as in the rollouts:
    # grpo_core/algorithm/iteration.py, reward_completions)
    written = [model_text(c, s.turns) for c, s in zip(completions, samples, strict=True)]
    if any(s.turns for s in samples):
        columns["trajectory"] = completions
    columns.update(env_reward_columns(samples))  # the environment's own reward, if any
    scored = rewards.score_completions(
        _seen_prompts(flat_rows, samples),
        written,
        columns,
        {accuracy_reward: 1.0, format_reward: 1.0},
    )
    score = [v or 0.0 for v in scored.per_function[accuracy_reward]]
    correct = [1.0 if v >= FULL_CREDIT else 0.0 for v in score]
    fmt = [v or 0.0 for v in scored.per_function[format_reward]]
    # the tokens the model wrote (a tool's output is the environment's: grpo_core/engines/turns.py)
    lengths = [len(s.completion_ids) if s.loss_mask is None else sum(s.loss_mask) for s in samples]
    scores = {"completion": completions, "correct": correct, "score": score, "formatted": fmt,
              "length": lengths}  # fmt: skip
    table = _table(tokenizer, rows, samples, scores)
    n_rows = len(table)
    result = EvalResult(
        sum(correct) / n_rows, sum(fmt) / n_rows, sum(lengths) / n_rows, len(rows), table, k
    )
    if k > 1:
        _add_k_sample_metrics(result, correct, written, accuracy_reward)
    return result

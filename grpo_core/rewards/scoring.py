"""Score a batch of completions with several weighted reward functions, failure-tolerant.

A reward function that raises on the batch is retried row by row, so one bad row costs one
score, not the batch; its error is recorded per row (``"ValueError: ..."``) and the row's score
is ``None``. Coroutine functions are awaited concurrently with each other.

``total`` follows TRL: the weighted ``nansum`` over the functions that gave a number for the
row; a row where every function gave ``None`` (or failed) is unscorable and totals ``None``
(one rule, :func:`weighted_reward_sum`, shared with the advantages).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from grpo_core.rewards.base import RewardUnavailable, get

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class ScoreRequest:
    """One batch to score, as every scorer takes it (this process, or Ray tasks over shards
    of whole groups: cluster/scoring.py): the rows, their other columns, the weights, the
    rows' group ids, and ``build``, a picklable callable returning the ``{name: function}``
    that :func:`score_completions` takes besides the registry's."""

    prompts: Sequence[Any]
    completions: Sequence[Any]
    columns: Mapping[str, Sequence[Any]]
    weights: Mapping[str, float]
    group_ids: Sequence[Any]
    build: Callable[[], Mapping[str, Callable[..., Any]]]

    def rows(self, start: int, end: int) -> ScoreRequest:
        """Rows ``[start, end)`` as plain lists (what a Ray task is sent)."""
        return ScoreRequest(
            list(self.prompts[start:end]),
            list(self.completions[start:end]),
            {k: list(v[start:end]) for k, v in self.columns.items()},
            dict(self.weights),
            list(self.group_ids[start:end]),
            self.build,
        )

    def score_here(self) -> ScoreResult:
        """:func:`score_completions` in this process, with the functions ``build`` makes."""
        return score_completions(
            self.prompts, self.completions, self.columns, self.weights, functions=self.build()
        )


@dataclass
class ScoreResult:
    """Per-function scores and errors for one batch, plus the weighted total.

    per_function: name -> one score per row (``None``: not applicable, failed, or non-number).
    errors:       name -> one error string per row (``None`` where the function succeeded),
                  e.g. ``"ValueError: bad gold answer"``.
    total:        weighted sum per row over non-``None`` scores (TRL's ``nansum``; ``None``
                  when every function gave ``None``).
    weights:      the weights used, by function name.
    """

    per_function: dict[str, list[float | None]]
    errors: dict[str, list[str | None]]
    total: list[float | None]
    weights: dict[str, float] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """Per-function metrics with TRL's names: ``rewards/<fn>/mean``, ``/std`` (over the rows
        the function scored) and ``rewards/<fn>/error_rate``. The batch's ``reward`` and
        ``reward_std`` come from ``grpo_core.algorithm.advantages.group_stats``, with the group metrics."""
        out: dict[str, float] = {}
        for name, scores in self.per_function.items():
            mean, std = _mean_std([s for s in scores if s is not None])
            out[f"rewards/{name}/mean"] = mean
            out[f"rewards/{name}/std"] = std
            errs = self.errors.get(name, [])
            out[f"rewards/{name}/error_rate"] = (
                sum(e is not None for e in errs) / len(errs) if errs else 0.0
            )
        return out


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)  # unbiased, as torch.std
    return mean, math.sqrt(var)


def _error(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()[0][:500] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def _row_columns(columns: Mapping[str, Sequence[Any]], i: int) -> dict[str, list[Any]]:
    return {k: [v[i]] for k, v in columns.items()}


MAX_REWARD = 1e12  # a score's magnitude; beyond it the row is unscorable, with the reason


def _check_value(name: str, value: Any) -> tuple[float | None, str | None]:
    """Validate one returned score: a finite real number or ``None`` (= not applicable). NaN
    is scored as not applicable, as TRL's ``nansum`` does, and reported as an error."""
    if value is None:
        return None, None
    if isinstance(value, bool):
        return float(value), None
    try:
        number = float(value) if _is_number(value) else None
    except (TypeError, ValueError):
        number = None
    if number is None:
        return (
            None,
            f"TypeError: reward function {name!r} returned {type(value).__name__}, not a number",
        )
    if math.isnan(number):  # scored as not applicable (TRL's nansum), recorded as an error:
        return None, (  # a NaN on every row stops the stage like any failing reward
            f"ValueError: reward function {name!r} returned NaN (return None for a row it does "
            "not apply to)"
        )
    if math.isinf(number) or abs(number) > MAX_REWARD:
        return None, (
            f"ValueError: reward function {name!r} returned {number}, beyond +-{MAX_REWARD:g} "
            "(weighted sums and standard deviations of such values overflow)"
        )
    return number, None


def _is_number(value: Any) -> bool:
    if isinstance(value, int | float):
        return True
    # numpy / torch scalars (0-d): have __float__ and .item(), but not str/bytes
    return hasattr(value, "__float__") and not isinstance(value, str | bytes)


def _validate_batch(name: str, out: Any, n: int) -> tuple[list[float | None], list[str | None]]:
    if isinstance(out, str | bytes) or not hasattr(out, "__len__"):
        msg = f"TypeError: reward function {name!r} returned {type(out).__name__}, not a list"
        return [None] * n, [msg] * n
    values = list(out)
    if len(values) != n:
        msg = (
            f"ValueError: reward function {name!r} returned {len(values)} values "
            f"for {n} completions"
        )
        return [None] * n, [msg] * n
    reported = getattr(out, "errors", None)  # grpo_core.rewards.Scores
    if reported is None or isinstance(reported, str) or len(reported) != n:
        reported = [None] * n
    scores, errors = [], []
    for v, r in zip(values, reported, strict=True):
        s, e = _check_value(name, v)
        scores.append(s)
        errors.append(e or (None if r is None else str(r)))
    return scores, errors


def _call_sync(name, fn, prompts, completions, columns):
    n = len(completions)
    try:
        out = fn(prompts=list(prompts), completions=list(completions), **columns)
    except RewardUnavailable:
        raise
    except Exception:
        scores: list[float | None] = []
        errors: list[str | None] = []
        for i in range(n):
            try:
                row = fn(
                    prompts=[prompts[i]], completions=[completions[i]], **_row_columns(columns, i)
                )
            except Exception as exc:  # one failing row must not sink the batch
                scores.append(None)
                errors.append(_error(exc))
                continue
            s, e = _validate_batch(name, row, 1)
            scores.append(s[0])
            errors.append(e[0])
        return scores, errors
    return _validate_batch(name, out, n)


async def _call_async(name, fn, prompts, completions, columns):
    n = len(completions)
    try:
        out = await fn(prompts=list(prompts), completions=list(completions), **columns)
    except RewardUnavailable:
        raise
    except Exception:

        async def one(i):
            try:
                row = await fn(
                    prompts=[prompts[i]], completions=[completions[i]], **_row_columns(columns, i)
                )
            except Exception as exc:
                return None, _error(exc)
            s, e = _validate_batch(name, row, 1)
            return s[0], e[0]

        rows = await asyncio.gather(*(one(i) for i in range(n)))
        return [r[0] for r in rows], [r[1] for r in rows]
    return _validate_batch(name, out, n)


def _run_coroutine(coro_factory: Callable[[], Any]) -> Any:
    """Run a coroutine to completion, also from inside a running event loop (Jupyter)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro_factory())
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["out"] = asyncio.run(coro_factory())
        except BaseException as exc:  # re-raised in the caller's thread
            box["exc"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join()
    if "exc" in box:
        raise box["exc"]
    return box["out"]


def score_completions(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    columns: Mapping[str, Sequence[Any]],
    weights: Mapping[str, float],
    *,
    functions: Mapping[str, Callable[..., Any]] | None = None,
) -> ScoreResult:
    """Score ``completions`` with every function named in ``weights``.

    prompts, completions: one entry per row (``prompts`` repeated per sample, as TRL passes
        them). columns: the other dataset columns, each a list aligned with ``completions``.
    weights: function name -> weight; the names are looked up in ``functions`` when given,
        else in the reward registry (``grpo_core.rewards.get``, so ``"module:function"`` works).
    """
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"{len(prompts)} prompts for {n} completions")
    for key, col in columns.items():
        if len(col) != n:
            raise ValueError(f"column {key!r} has {len(col)} rows for {n} completions")
    if "prompts" in columns or "completions" in columns:
        raise ValueError("columns must not be named 'prompts' or 'completions'")

    fns = {
        name: (functions[name] if functions and name in functions else get(name))
        for name in weights
    }
    per_function: dict[str, list[float | None]] = {}
    errors: dict[str, list[str | None]] = {}
    cols = dict(columns)

    async_names = [name for name, fn in fns.items() if inspect.iscoroutinefunction(fn)]
    if async_names:

        async def run_all():
            return await asyncio.gather(
                *(_call_async(name, fns[name], prompts, completions, cols) for name in async_names)
            )

        for name, (s, e) in zip(async_names, _run_coroutine(run_all), strict=True):
            per_function[name], errors[name] = s, e
    for name, fn in fns.items():
        if name not in per_function:
            per_function[name], errors[name] = _call_sync(name, fn, prompts, completions, cols)

    per_function = {name: per_function[name] for name in weights}  # config order
    errors = {name: errors[name] for name in weights}
    w = {k: float(v) for k, v in weights.items()}
    return ScoreResult(per_function, errors, weighted_total(per_function, w, n), w)


def reward_matrix(
    per_function: Mapping[str, Sequence[float | None]], weights: Mapping[str, float], n: int
):
    """``(rewards_per_func[N, K], weights[K])`` as float64 tensors in ``weights`` order, NaN
    where a function gave ``None``: the input of ``grpo_core.algorithm.advantages.compute_multi``."""
    import torch  # here: importing the reward library stays light

    names = list(weights)
    matrix = torch.tensor(
        [[math.nan if (s := per_function[k][i]) is None else s for k in names] for i in range(n)],
        dtype=torch.float64,
    ).reshape(n, len(names))  # [N, K]
    return matrix, torch.tensor([weights[k] for k in names], dtype=torch.float64)  # [K]


def weighted_reward_sum(rewards_per_func: Tensor, weights: Tensor | None = None) -> Tensor:
    """TRL's reward: weighted ``nansum`` over reward functions; NaN when all are NaN (the
    one rule the scored file's ``reward`` column and the advantages share)."""
    import torch

    k = rewards_per_func.shape[1]
    if weights is None:
        weights = torch.ones(k, dtype=rewards_per_func.dtype, device=rewards_per_func.device)
    w = weights.to(rewards_per_func.device, rewards_per_func.dtype)  # [K]
    total = (rewards_per_func * w.unsqueeze(0)).nansum(dim=1)  # [N]
    unscorable = torch.isnan(rewards_per_func).all(dim=1)  # [N]
    return total.masked_fill(unscorable, float("nan"))


def weighted_total(
    per_function: Mapping[str, Sequence[float | None]], weights: Mapping[str, float], n: int
) -> list[float | None]:
    """Per-row weighted sum of the scores, ``None`` for unscorable rows (see module doc)."""
    total = weighted_reward_sum(*reward_matrix(per_function, weights, n))  # [N]
    return [None if math.isnan(t) else t for t in total.tolist()]

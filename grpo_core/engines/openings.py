"""How an episode opens: the environment's episode for its data row, and what its ``reset``
adds to the prompt before the model's first turn.

An episode may have a ``reset()`` method (TRL's environment ``reset``, verifiers'
``setup_state``). It is called once, before the first turn, and returns text, chat messages
or None; the prompt the model sees is the data's prompt with that added
(``grpo_core.contracts.text.extend_prompt``: text at the end of a plain-text prompt or of a
chat prompt's last user message, messages after a chat prompt's), rendered and tokenised as
any prompt is (``row_prompt_ids``: chat template, the row's ``tools``). Those tokens are the
prompt's, never the completion's: no loss, no log-probs. An environment whose ``start`` or
``reset`` raises opens an episode that answers each call with that error (recorded in its
``turns``), the prompt unchanged: an error on the episode, not a crash of the batch. So
does one whose ``reset`` makes the prompt too long for the model (``context``: its
positions): the prompt it extended must leave room for at least one completion token, and
is never cut to fit; the episode samples from the prompt as given (which the caller checked:
grpo_core/engines/context.py). One that fits has what is left of the context as its
completion budget, at most ``max_completion_length`` (:func:`completion_budget`).

Nothing here imports prefect, mlflow or ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grpo_core.contracts.observations import as_text, valid_text
from grpo_core.contracts.text import extend_prompt, row_prompt_ids
from grpo_core.engines.environments import Observation


@dataclass
class Opening:
    """One episode as it opens: the environment's episode, the prompt ids the model sees,
    and the prompt as the environment extended it (None: ``reset`` added nothing)."""

    episode: Any
    ids: list[int]
    prompt: Any = None


@dataclass
class Unstarted:
    """An episode whose environment failed to start: each call answers with that error."""

    error: str

    def step(self, model_turn: str) -> Observation | None:
        raise RuntimeError(self.error)


@dataclass
class UnstartedWithReward(Unstarted):
    """An episode with a ``reward()`` whose ``reset()`` failed: its reward is that error (not
    "the episodes define no reward()")."""

    def reward(self) -> float | None:
        raise RuntimeError(self.error)


def open_episodes(
    env, prompt_ids: list[list[int]], rows, n: int, tokenizer, context: int | None = None
) -> list[Opening]:
    """``n`` openings per prompt, prompt-major (``rows[i]``: prompt i's data row, or None)."""
    return [
        open_episode(env, ids, rows[p] if rows else None, tokenizer, context)
        for p, ids in enumerate(prompt_ids)
        for _ in range(n)
    ]


def open_episode(
    env, ids: list[int], row: dict | None, tokenizer, context: int | None = None
) -> Opening:
    """``env``'s episode for ``row`` and its prompt (``ids``, the row's as the caller
    tokenised it, unless ``reset`` adds to it; ``context``: the model's positions, which
    the prompt ``reset`` extended must leave a completion token of, None: unknown)."""
    try:
        episode = env.start(row)
    except (Exception, SystemExit) as exc:
        return Opening(Unstarted(_error("the environment did not start", exc)), ids)
    reset = getattr(episode, "reset", None)
    if not callable(reset):
        return Opening(episode, ids)
    try:
        addition = valid_text(reset())  # recorded as the episode's prompt: valid text
        if addition is None or addition == "" or addition == []:
            return Opening(episode, ids)
        if row is None:
            raise ValueError("it added to the prompt, but the caller gave no data row")
        prompt = extend_prompt(row["prompt"], addition)
        extended = row_prompt_ids(tokenizer, {**row, "prompt": prompt})
    except (Exception, SystemExit) as exc:
        rewarded = any(callable(getattr(episode, k, None)) for k in ("reward", "get_reward"))
        failed = UnstartedWithReward if rewarded else Unstarted
        return Opening(failed(_error("the environment's reset() failed", exc)), ids)
    if context is not None and len(extended) >= context:
        error = (
            f"the environment's reset() made the prompt too long: {len(extended):,} tokens "
            f"with what it added ({len(ids):,} without), and the model has {context:,} "
            f"positions, none left for the completion"
        )
        return Opening(Unstarted(error), ids)
    return Opening(episode, extended, prompt)


def completion_budget(opening: Opening, max_new_tokens: int, context: int | None) -> int:
    """The tokens ``opening``'s episode may sample in all its turns: ``max_new_tokens``, or
    fewer where its prompt leaves less of the model's ``context`` (a prompt ``reset``
    extended; a prompt as given was checked to leave ``max_new_tokens``)."""
    if context is None:
        return max_new_tokens
    return max(0, min(max_new_tokens, context - len(opening.ids)))


def _error(what: str, exc: Exception) -> str:
    return as_text(f"{what}: {type(exc).__name__}: {exc}"[:300])

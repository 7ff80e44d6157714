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
``turns``), the prompt unchanged: an error on the episode, not a crash of the batch.

Nothing here imports prefect, mlflow or ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


def open_episodes(env, prompt_ids: list[list[int]], rows, n: int, tokenizer) -> list[Opening]:
    """``n`` openings per prompt, prompt-major (``rows[i]``: prompt i's data row, or None)."""
    return [
        open_episode(env, ids, rows[p] if rows else None, tokenizer)
        for p, ids in enumerate(prompt_ids)
        for _ in range(n)
    ]


def open_episode(env, ids: list[int], row: dict | None, tokenizer) -> Opening:
    """``env``'s episode for ``row`` and its prompt (``ids``, the row's as the caller
    tokenised it, unless ``reset`` adds to it)."""
    try:
        episode = env.start(row)
    except Exception as exc:
        return Opening(Unstarted(_error("the environment did not start", exc)), ids)
    reset = getattr(episode, "reset", None)
    if not callable(reset):
        return Opening(episode, ids)
    try:
        addition = reset()
        if addition is None or addition == "" or addition == []:
            return Opening(episode, ids)
        if row is None:
            raise ValueError("it added to the prompt, but the caller gave no data row")
        prompt = extend_prompt(row["prompt"], addition)
        return Opening(episode, row_prompt_ids(tokenizer, {**row, "prompt": prompt}), prompt)
    except Exception as exc:
        return Opening(Unstarted(_error("the environment's reset() failed", exc)), ids)


def _error(what: str, exc: Exception) -> str:
    return f"{what}: {type(exc).__name__}: {exc}"[:300]

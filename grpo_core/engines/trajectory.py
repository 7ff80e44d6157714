"""An episode's trajectory as the turn loop (grpo_core/engines/turns.py) grows it, turn by
turn: the ids after its prompt with their log-probs and loss mask (1: the model's token, 0:
the environment's), one record per turn (role, token span, text, a call's error, wall
seconds, and the seconds the loop stood still for that call), the tokens of its budget still
free, and, once it has ended, its :class:`Sample` with the environment's own reward."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from grpo_core.contracts.observations import as_text
from grpo_core.engines.bounded import describe

if TYPE_CHECKING:
    from grpo_core.engines.generation import Sample


@dataclass
class Trajectory:
    """One episode as the turn loop grows it: its tokens, log-probs and loss mask, the turn
    records, the budget left, and its :class:`Sample` once it has ended."""

    prompt: list[int]
    prompt_index: int
    sample_index: int
    env: Any  # the environment's Episode
    left: int  # tokens of the trajectory's budget still free
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)
    finish: str = "stop"
    opened: Any = None  # the prompt as the environment's reset() extended it (None: as given)
    policy: list[float] | None = None  # the policy's own log-probs (Sample.policy_logprobs)
    key: int = 0  # its index among the call's episodes (the engine's kept KV)
    answered: float = 0.0  # perf_counter when its last call answered
    stalled: float = 0.0  # seconds the loop stood still for its pending call (recorded next)

    def add(self, role: str, ids, logprobs, text: str, *, error=None, seconds=0.0,
            policy=None, calls: int | None = None, failed: int | None = None) -> None:  # fmt: skip
        start = len(self.ids)
        self.ids += ids
        self.logprobs += logprobs
        if policy is not None or self.policy is not None:  # tool tokens: 0, as logprobs
            self.policy = (self.policy or []) + list(policy or [0.0] * len(ids))
        self.mask += [1 if role == "assistant" else 0] * len(ids)
        self.left -= len(ids)
        stalled, self.stalled = (self.stalled, 0.0) if role == "tool" else (0.0, self.stalled)
        text, error = as_text(text), None if error is None else as_text(str(error))
        if role == "tool":  # the calls the observation answers, and the failed ones
            calls = 1 if calls is None else calls
            failed = int(error is not None) if failed is None else failed
        self.turns.append({"role": role, "start": start, "end": len(self.ids), "text": text,
                           "error": error, "seconds": round(seconds, 4),
                           "stalled": round(stalled, 4), "calls": calls or 0,
                           "failed": failed or 0})  # fmt: skip

    @property
    def model_turns(self) -> int:
        return sum(t["role"] == "assistant" for t in self.turns)

    def sample(self) -> Sample:
        from grpo_core.engines.generation import Sample

        if self.stalled and self.turns:  # a call that ended the episode: no tool turn
            self.turns[-1]["stalled"] = round(self.turns[-1]["stalled"] + self.stalled, 4)
            self.stalled = 0.0

        return Sample(self.prompt_index, self.sample_index, self.ids, self.logprobs, self.finish,
                      self.mask, self.turns, env=env_reward(self.env),
                      policy_logprobs=self.policy,
                      prompt_ids=None if self.opened is None else self.prompt,
                      prompt=self.opened)  # fmt: skip


def env_reward(episode) -> dict | None:
    """The episode's own reward once it has ended (its ``reward()``: a number or None),
    with the error when it raises or returns something else; None when it has no
    ``reward()``."""
    ask = getattr(episode, "reward", None)
    if not callable(ask):  # TRL's environments name it get_reward()
        ask = getattr(episode, "get_reward", None)
    if not callable(ask):
        return None
    try:
        value = ask()
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise TypeError(f"reward() returned {type(value).__name__}, expected a number or None")
        return {"reward": None if value is None else float(value), "error": None}
    except (Exception, SystemExit) as exc:
        return {"reward": None, "error": as_text(describe(exc))}

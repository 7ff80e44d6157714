"""User code the turn loop calls (a function tool, an environment's ``step``), bounded.

- :func:`call_within`: the call runs in a daemon thread and is waited for at most its
  deadline (``rollout.tool_timeout_s``); past it, the call is answered with a ``TimeoutError``
  and the loop goes on. Python cannot stop a thread, so a call that never returns keeps
  running in the background until the process ends (code that may loop forever belongs in
  the code sandbox, as the python tool runs it). Whatever the call raises, ``SystemExit`` and
  ``KeyboardInterrupt`` included (the thread is not the main thread: no real signal lands
  there), is its error.
- :func:`as_observation`: what ``step`` returned, checked: an :class:`Observation` with text
  or messages, the observation's text as a ``str``, or None (the episode ends); anything else
  is an error observation, never an exception out of the loop.
- :func:`clip_chars`: a tool's text cut by characters before it is tokenised, so a 50 MB
  answer costs what its budget of tokens costs.

Nothing here imports prefect, mlflow or ray.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from grpo_core.engines.environments import Observation

CHARS_PER_TOKEN = 32  # a tool's text is cut to this many characters per budget token


def describe(exc: BaseException) -> str:
    """``"Type: message"`` of an exception, even when its ``__str__`` raises."""
    try:
        text = str(exc)
    except BaseException:  # noqa: BLE001 - a user's exception whose __str__ raises
        text = f"<{type(exc).__name__} whose message cannot be shown>"
    return f"{type(exc).__name__}: {text}"[:300]


def call_guarded(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """``(fn(), None)``, or ``(None, error)`` whatever it raised: for code that bounds its own
    time (the python tool's sandbox, function tools' calls), called off the main thread."""
    try:
        return fn(), None
    except BaseException as exc:  # noqa: BLE001 - user code: its error, whatever it is
        return None, describe(exc)


def call_within(fn: Callable[[], Any], seconds: float, what: str) -> tuple[Any, str | None]:
    """``(fn(), None)``, or ``(None, error)`` when it raised or did not return within
    ``seconds`` (``what`` names it in the error)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - user code: its error, whatever it is
            box["error"] = describe(exc)

    thread = threading.Thread(target=run, name="grpo-tool-call", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        return None, (
            f"TimeoutError: {what} did not return within {seconds:g} s (rollout.tool_timeout_s)"
        )
    return box.get("value"), box.get("error")


def as_observation(value: Any) -> tuple[Observation | None, str | None]:
    """``(observation or None, None)`` for a value ``step`` may return, else ``(None,
    error)`` saying what it returned."""
    if value is None:
        return None, None
    if isinstance(value, str):
        return Observation(value), None
    if isinstance(value, Observation):
        if value.messages is not None:
            ok = isinstance(value.messages, list) and all(
                isinstance(m, dict) and isinstance(m.get("content", ""), str)
                for m in value.messages
            )
            if ok:
                return value, None
            return None, "TypeError: step() returned Observation(messages=...) that is not a "
            "list of {'role': 'tool', 'content': str} messages"
        if isinstance(value.text, str):
            return value, None
        return None, (
            f"TypeError: step() returned an Observation whose text is "
            f"{type(value.text).__name__}, expected the observation's text (str)"
        )
    return None, (
        f"TypeError: step() returned {type(value).__name__}; expected an Observation, "
        "its text (str), or None to end the episode"
    )


def clip_chars(text: str, limit_tokens: int, end: str = "") -> str:
    """``text`` cut to :data:`CHARS_PER_TOKEN` characters per budget token, keeping its
    ``end`` marker when it ends with one. What is cut lies beyond the token budget in any
    vocabulary whose tokens are shorter, so the tokens kept are the same, and the token cut
    that follows still puts the truncation mark."""
    limit = max(1, limit_tokens) * CHARS_PER_TOKEN
    if len(text) <= limit:
        return text
    tail = end if end and text.endswith(end) else ""
    return text[:limit] + tail

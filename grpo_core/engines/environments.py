"""Environments a policy acts in during a rollout: the protocol, the settings, and the
built-in ``python`` tool.

An :class:`Environment` starts an :class:`Episode` from a data row; the turn loop
(grpo_core/engines/turns.py) hands the episode each model turn (its text) and gets back an
:class:`Observation` to append to the conversation, or None when the episode ends. The
observation is text: the turn loop tokenises it once and appends the ids (never the whole
conversation again); those tokens get loss mask 0. An episode may also have a ``reset()``,
asked once before the first turn, whose text or messages are added to the prompt
(grpo_core/engines/openings.py).

Built in: ``python`` (:class:`PythonTool`): when a model turn ends with the call marker
(``</tool_call>`` by default), the code between the markers runs in the code sandbox
(grpo_core/sandbox/__init__.py: same isolation, time and memory limits per call as the code
rewards); what it prints (and the value of a last bare expression, as in a notebook) comes
back between the result markers. Each call is a fresh program: nothing persists between the
calls of one episode (nor between calls on one warm sandbox: ``rollout.tool_sandbox``,
grpo_core/sandbox/forkserver.py). A user's environment is named ``module:function`` (or
``file.py:function``), as a reward function is: a callable ``(spec: ToolSpec) ->
Environment``.

Nothing here imports prefect, mlflow or ray.
"""

from __future__ import annotations

import ast
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from grpo_core.config.tools import (  # noqa: F401  (the markers are imported from here too)
    CALL_END,
    CALL_START,
    RESULT_END,
    RESULT_START,
    ToolSpec,
    tool_spec_of,
)


@dataclass
class Observation:
    """What the environment answers a model turn with: ``text`` (appended as is, markers
    included), the call's ``error`` (None: it ran) and its wall ``seconds``."""

    text: str
    error: str | None = None
    seconds: float = 0.0
    # tool messages ({"role": "tool", "name", "content"}) the chat template renders instead
    # of ``text`` (the ``functions`` environment)
    messages: list[dict] | None = None
    # the tool calls this observation answers and how many of them failed (None: one call,
    # failed when ``error`` is set); the ``functions`` environment answers several at once
    calls: int | None = None
    failed: int | None = None


@runtime_checkable
class Episode(Protocol):
    def step(self, model_turn: str) -> Observation | None:
        """The model's turn (its text) -> the observation to append, or None: the episode
        ends here."""
        ...


@runtime_checkable
class Environment(Protocol):
    def start(self, row: dict | None) -> Episode:
        """A new episode for the data row (None when the caller has no row)."""
        ...


def environment(spec: ToolSpec) -> Environment:
    """The environment of ``spec.tools``: a registered one (``ENVIRONMENTS``: the built-in
    ``python`` tool and ``functions``), or a user's ``module:function`` factory, called with
    ``spec``."""
    from grpo_core.config.engine import ENVIRONMENTS

    (name,) = spec.tools if len(spec.tools) == 1 else (None,)
    if name in ENVIRONMENTS:
        return ENVIRONMENTS.get(name)(spec)
    if name is not None and ":" in name:
        from grpo_core.rewards.base import load_user_function

        return load_user_function(name)(spec)
    raise ValueError(
        f"rollout.tools: {list(spec.tools)}: give one environment, one of "
        f"{ENVIRONMENTS.names()} or 'module:function'"
    )


def called_code(turn: str, spec: ToolSpec) -> str | None:
    """The code of the call a model turn ends with (between the last call start and the
    call end that ends the turn; a ```python fence is dropped), or None: no call."""
    text = turn.rstrip()
    if not text.endswith(spec.tool_call_end):
        return None
    body = text[: -len(spec.tool_call_end)]
    start = body.rfind(spec.tool_call_start)
    if start < 0:
        return None
    code = body[start + len(spec.tool_call_start) :].strip()
    if code.startswith("```"):
        code = code.split("\n", 1)[1] if "\n" in code else ""
        code = code.removesuffix("```").rstrip()
    return code


def echo_last_expression(code: str) -> str:
    """``code`` with a last bare expression printed when it is not None, as a notebook
    cell shows it (code that does not parse is returned unchanged: the sandbox reports the
    SyntaxError)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return code
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return code
    last = tree.body[-1]
    value = ast.unparse(last.value)
    head = "\n".join(ast.unparse(n) for n in tree.body[:-1])
    echo = f"__grpo_value__ = ({value})\nif __grpo_value__ is not None:\n    print(repr(__grpo_value__))"
    return f"{head}\n{echo}" if head else echo


@dataclass
class PythonTool:
    """The ``python`` tool: each call runs the model's code in the code sandbox."""

    spec: ToolSpec
    calls: int = field(default=0, init=False)

    def start(self, row: dict | None) -> Episode:
        return _PythonEpisode(self)

    def run(self, code: str) -> Observation:
        """Run ``code`` in the sandbox; its output (or its error's last line) as the
        observation text between the result markers."""
        from grpo_core.sandbox import Limits

        self.calls += 1
        limits = Limits(
            wall_seconds=self.spec.tool_timeout_s,
            cpu_seconds=max(1, math.ceil(self.spec.tool_timeout_s)),
            memory_bytes=self.spec.tool_memory_mb << 20,
        )
        start = time.perf_counter()
        try:
            res = _run_call(echo_last_expression(code), limits, self.spec)
            output, error = res.output, None if res.program_ok else (res.error or "failed")
        except Exception as exc:  # the sandbox itself failed: an error observation
            output, error = "", f"{type(exc).__name__}: {exc}"
        seconds = time.perf_counter() - start
        text = output.strip() if error is None else (output.strip() + "\n" + error).strip()
        return Observation(
            f"{self.spec.tool_result_start}{text}{self.spec.tool_result_end}", error, seconds
        )


def _run_call(program: str, limits: Any, spec: ToolSpec) -> Any:
    """One call in the sandbox: on a warm server (``spec.tool_sandbox == "warm"``, under bwrap or
    namespaces: grpo_core/sandbox/forkserver.py), else in a fresh sandbox of its own."""
    from grpo_core.sandbox import detect_isolation, run_program

    iso = detect_isolation(spec.tool_isolation)
    if spec.tool_sandbox == "warm" and iso.contained:
        from grpo_core.sandbox import forkserver

        workers = spec.tool_workers or os.cpu_count() or 1
        return forkserver.run_tool(program, iso, limits, workers)
    return run_program(program, kind="tool", limits=limits, isolation=spec.tool_isolation)


@dataclass
class _PythonEpisode:
    tool: PythonTool
    bounds_itself = True  # the sandbox's wall clock, CPU and memory limits bound each call

    def step(self, model_turn: str) -> Observation | None:
        code = called_code(model_turn, self.tool.spec)
        return None if code is None else self.tool.run(code)


def load_spec(value: Any) -> ToolSpec | None:
    """A ``ToolSpec`` from itself, its fields or a record's dict, or None
    (grpo_core/config/tools.py)."""
    return tool_spec_of(value)

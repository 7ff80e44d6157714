"""Function tools in the chat template's own format (Hermes / Qwen JSON tool calls).

A tool is a Python function with type hints and a Google-style docstring (TRL's ``tools=[fn]``
convention): ``transformers.utils.get_json_schema`` makes its JSON schema, which the data
rows carry in their ``tools`` column and the chat template declares to the model
(grpo_core/contracts/text.py). ``rollout.functions`` names them: a built-in (``calculator``)
or ``module:function`` / ``path/file.py:function``.

The ``functions`` environment reads a model turn (it ends at the end-of-turn token, as a
chat model ends a turn that calls tools) for every ``<tool_call>{"name": ...,
"arguments": {...}}</tool_call>`` in it, runs each call in order, and answers with one
``tool`` message per call. The turn loop renders them through the chat template and appends
the exact ids (grpo_core/contracts/observations.py: ``encode_tool_messages``), loss-masked, as
TRL's tool suffix is. A call that is not JSON, names no known function, has arguments that do
not fit, or raises, is answered with its error as that message (and counted as a failed
call), so a model learns that its call did nothing. Functions run in this process (as in
TRL); a function that runs untrusted code should use the code sandbox itself.

Nothing here imports prefect, mlflow or ray.
"""

from __future__ import annotations

import ast
import contextlib
import json
import operator
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from grpo_core.engines.environments import Observation


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "(12+5)*3".
    """
    return _format(_Arith().eval(expression))


FUNCTIONS: dict[str, Callable[..., Any]] = {"calculator": calculator}


def load_function(name: str) -> Callable[..., Any]:
    """A built-in function tool, or a ``module:function`` one."""
    if name in FUNCTIONS:
        return FUNCTIONS[name]
    if ":" in name:
        from grpo_core.rewards.base import load_user_function

        return load_user_function(name)
    raise ValueError(
        f"rollout.functions: {name!r}: give a built-in ({', '.join(FUNCTIONS)}) or "
        "'module:function'"
    )


def function_schemas(names) -> list[dict]:
    """The JSON schemas of the function tools ``names`` (what a row's ``tools`` holds)."""
    from transformers.utils import get_json_schema

    return [get_json_schema(load_function(n)) for n in names]


def parse_calls(text: str, start: str, end: str) -> list[dict | str]:
    """The calls of a model turn: for each ``start ... end`` span, ``{"name", "arguments"}``
    (``arguments`` a dict; a JSON string of one is decoded), or the error text when the span
    is not such a call."""
    calls: list[dict | str] = []
    for body in re.findall(re.escape(start) + r"(.*?)" + re.escape(end), text, flags=re.S):
        try:
            call = json.loads(body.strip())
        except ValueError as exc:
            calls.append(f"the tool call is not JSON: {exc}")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append('a tool call is {"name": ..., "arguments": {...}}')
            continue
        args = call.get("arguments", {})
        if isinstance(args, str):
            with contextlib.suppress(ValueError):  # not JSON: refused just below
                args = json.loads(args) if args.strip() else {}
        if not isinstance(args, dict):
            calls.append(f"{call['name']}: arguments must be a JSON object")
            continue
        calls.append({"name": call["name"], "arguments": args})
    return calls


@dataclass
class FunctionTools:
    """The ``functions`` environment: the function tools of ``spec.functions``."""

    spec: Any  # grpo_core.engines.environments.ToolSpec
    functions: dict[str, Callable[..., Any]] = field(init=False)

    def __post_init__(self) -> None:
        self.functions = {}
        for name in self.spec.functions:
            fn = load_function(name)
            self.functions[getattr(fn, "__name__", name.rsplit(":", 1)[-1])] = fn

    def start(self, row: dict | None) -> _FunctionEpisode:
        return _FunctionEpisode(self)


@dataclass
class _FunctionEpisode:
    tools: FunctionTools

    def step(self, model_turn: str) -> Observation | None:
        spec = self.tools.spec
        calls = parse_calls(model_turn, spec.tool_call_start, spec.tool_call_end)
        if not calls:
            return None  # no call: the episode ends
        start, messages, errors = time.perf_counter(), [], []
        for call in calls:
            name, text, error = _run(self.tools.functions, call)
            messages.append({"role": "tool", "name": name, "content": text})
            if error is not None:
                errors.append(error)
        error = "; ".join(errors)[:300] if errors else None
        body = "\n".join(m["content"] for m in messages)
        return Observation(body, error, time.perf_counter() - start, messages=messages)


def _run(functions: dict, call: dict | str) -> tuple[str, str, str | None]:
    """``(name, what the model is told, error or None)`` of one call."""
    if isinstance(call, str):
        return "error", f"Error: {call}", call
    name, fn = call["name"], functions.get(call["name"])
    if fn is None:
        error = f"no function {name!r}; the tools are {', '.join(functions)}"
        return name, f"Error: {error}", error
    try:
        value = fn(**call["arguments"])
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"[:300]
        return name, f"Error: {error}", error
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return name, text, None


# --- the calculator's arithmetic: numbers, + - * / // % ** and parentheses, bounded -----

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_MAX_DIGITS = 1000  # a result longer than this is refused, not computed (10**10**9 would hang)


class _Arith:
    def eval(self, expression: str):
        if not isinstance(expression, str) or len(expression) > 500:
            raise ValueError("give the expression as text of at most 500 characters")
        return self._node(ast.parse(expression.replace("^", "**"), mode="eval").body)

    def _node(self, node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            v = self._node(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            a, b = self._node(node.left), self._node(node.right)
            if isinstance(node.op, ast.Pow) and abs(b) * _digits(a) > _MAX_DIGITS:
                raise ValueError("the result would be too large")
            return _OPS[type(node.op)](a, b)
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")


def _digits(x) -> int:
    return max(1, len(str(int(abs(x))))) if x else 1


def _format(value) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return str(value)


def tool_declarations(functions: list[str]) -> str | None:
    """The ``tools`` column the rows get for ``rollout.functions`` (the functions' JSON
    schemas, as JSON), or None without function tools."""
    return json.dumps(function_schemas(functions)) if functions else None

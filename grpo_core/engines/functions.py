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

from grpo_core.config.engine import FUNCTION_TOOLS
from grpo_core.engines.bounded import call_within
from grpo_core.engines.environments import Observation


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "(12+5)*3".
    """
    return _format(_Arith().eval(expression))


def load_function(name: str) -> Callable[..., Any]:
    """A registered function tool (``FUNCTION_TOOLS``: the built-ins), or a
    ``module:function`` one."""
    if name in FUNCTION_TOOLS:
        return FUNCTION_TOOLS.get(name)
    if ":" in name:
        from grpo_core.rewards.base import load_user_function

        return load_user_function(name)
    raise ValueError(
        f"rollout.functions: {name!r}: give a built-in ({', '.join(FUNCTION_TOOLS)}) or "
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
    bounds_itself = True  # each call runs within rollout.tool_timeout_s (_run)

    def step(self, model_turn: str) -> Observation | None:
        return answer_calls(self.tools.functions, model_turn, self.tools.spec)


def answer_calls(functions: dict, model_turn: str, spec: Any) -> Observation | None:
    """The ``tool`` messages answering every JSON call of ``model_turn`` with ``functions``
    (name -> callable), each call within ``spec.tool_timeout_s``, at most
    ``spec.max_calls_per_turn`` run; None when the turn calls nothing (the episode ends)."""
    calls = parse_calls(model_turn, spec.tool_call_start, spec.tool_call_end)
    if not calls:
        return None  # no call: the episode ends
    start, messages, errors = time.perf_counter(), [], []
    cap = spec.max_calls_per_turn
    for i, call in enumerate(calls):
        if i >= cap:
            name = call["name"] if isinstance(call, dict) else "error"
            error = f"call {i + 1} of {len(calls)}: over {cap} calls per turn, not run"
            text = f"Error: {error} (rollout.max_calls_per_turn)"
        else:
            name, text, error = _run(functions, call, spec.tool_timeout_s)
        messages.append({"role": "tool", "name": name, "content": text})
        if error is not None:
            errors.append(error)
    error = "; ".join(errors)[:300] if errors else None
    body = "\n".join(m["content"] for m in messages)
    return Observation(body, error, time.perf_counter() - start, messages=messages,
                       calls=len(calls), failed=len(errors))  # fmt: skip


def _run(functions: dict, call: dict | str, timeout_s: float) -> tuple[str, str, str | None]:
    """``(name, what the model is told, error or None)`` of one call, run within
    ``timeout_s`` (grpo_core/engines/bounded.py): whatever it raises or returns that is not
    text or JSON is its error."""
    if isinstance(call, str):
        return "error", f"Error: {call}", call
    name, fn = call["name"], functions.get(call["name"])
    if fn is None:
        error = f"no function {name!r}; the tools are {', '.join(functions)}"
        return name, f"Error: {error}", error

    def run() -> str:
        value = fn(**call["arguments"])
        return value if isinstance(value, str) else json.dumps(value, default=str)

    text, error = call_within(run, timeout_s, f"function {name!r}")
    if error is not None:
        return name, f"Error: {error}", error
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

"""Environments in TRL's ``environment_factory`` shape: a class (any zero-argument callable)
that makes one environment object per episode, whose public methods are the tools.

    class Counter:
        def reset(self, **row) -> str | None:   # once per episode, before the first turn;
            self.total = 0                       # text returned is appended to the prompt
        def add(self, n: int) -> str:            # a tool: type hints and a docstring
            '''Add n to the total.

            Args:
                n: how much to add
            '''
            self.total += n
            return str(self.total)
        def get_reward(self) -> float:           # optional: the environment owns the reward
            return float(self.total == 10)

``rollout.environment_factory: my_pkg.envs:Counter`` runs it; a mapping of names to factories
(``{counter: "my_pkg.envs:Counter", shop: "my_pkg.envs:Shop"}``) lets one run mix task
suites: each data row's ``environment`` column picks its environment (TRL's multi-environment
runs), and the row's ``tools`` column declares that environment's tools only. The methods
are called as the model's JSON calls name them (grpo_core/engines/functions.py:
:func:`~grpo_core.engines.functions.answer_calls`: one ``tool`` message per call, each within
``rollout.tool_timeout_s``, at most ``rollout.max_calls_per_turn``), with the state the
object keeps across the episode's calls; ``reset`` gets the data row's columns as keywords
(without ``environment``) and ``get_reward`` (or ``reward``) is asked once the episode ends,
recorded in the rollout file as ``env_reward`` (grpo_core/engines/trajectory.py).

Nothing here imports prefect, mlflow or ray.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from grpo_core.engines.environments import Observation
from grpo_core.engines.functions import answer_calls

NOT_TOOLS = ("reset", "get_reward", "reward", "step", "start")  # methods that are not tools
ROW_COLUMN = "environment"  # a mixed run's row names its environment here


def load_factory(spec: str) -> Callable[[], Any]:
    """The factory named ``module:Class`` (or ``path/file.py:Class``)."""
    from grpo_core.rewards.base import load_user_function

    return load_user_function(spec)


def tool_methods(instance: Any) -> dict[str, Callable[..., Any]]:
    """The environment object's tools: its public bound methods but reset and the reward."""
    return {
        name: member
        for name, member in inspect.getmembers(instance, predicate=inspect.ismethod)
        if not name.startswith("_") and name not in NOT_TOOLS
    }


def factory_schemas(spec: str) -> list[dict]:
    """The JSON schemas of the tools of the environment ``spec`` makes (one object made and
    read: its methods' type hints and docstrings, as function tools')."""
    from transformers.utils import get_json_schema

    instance = load_factory(spec)()
    if not callable(getattr(instance, "reset", None)):
        raise ValueError(
            f"environment_factory {spec!r}: the environment object has no reset() method "
            "(TRL's environments must define one; it may return None)"
        )
    methods = tool_methods(instance)
    if not methods:
        raise ValueError(
            f"environment_factory {spec!r}: the environment object has no tool methods"
        )
    out = []
    for name, method in methods.items():
        try:
            out.append(get_json_schema(method))
        except Exception as e:
            raise ValueError(
                f"environment_factory {spec!r}, method {name!r}: no tool schema ({e}); give "
                "it type hints and a Google-style docstring with an Args section"
            ) from None
    return out


def factory_declarations(factories: dict[str, str]) -> dict[str, str]:
    """Per environment name, the ``tools`` column its rows get (the schemas, as JSON)."""
    return {name: json.dumps(factory_schemas(spec)) for name, spec in factories.items()}


def rollout_declarations(rollout) -> str | dict[str, str] | None:
    """The ``tools`` column prepare gives the rows for the ``rollout`` section: the function
    tools' schemas (JSON), or per environment name its methods' schemas; None without JSON
    tools."""
    from grpo_core.engines.functions import tool_declarations

    if rollout.environment_factory is not None:
        return factory_declarations(rollout.factories())
    return tool_declarations(rollout.functions)


def row_environment(row: dict | None, factories: dict[str, str], where: str = "the row") -> str:
    """The name of the environment ``row`` runs in: the only one, or its ``environment``
    column's. Raises ``ValueError`` naming the row's value and the names there are."""
    if len(factories) == 1 and "" in factories:
        return ""
    name = (row or {}).get(ROW_COLUMN)
    if name not in factories:
        raise ValueError(
            f"{where}: column {ROW_COLUMN!r} is {name!r}; with several environments "
            f"(rollout.environment_factory) each row names one of {sorted(factories)}"
        )
    return name


@dataclass
class FactoryEnvironment:
    """The ``factory`` environment: ``spec.environment_factory``'s environments."""

    spec: Any  # grpo_core.engines.environments.ToolSpec
    factories: dict[str, Callable[[], Any]] = field(init=False)

    def __post_init__(self) -> None:
        specs = dict(self.spec.environment_factory)
        self.names = specs
        self.factories = {name: load_factory(s) for name, s in specs.items()}

    def start(self, row: dict | None) -> FactoryEpisode:
        name = row_environment(row, self.names)
        instance = self.factories[name]()
        rewarded = any(callable(getattr(instance, k, None)) for k in ("get_reward", "reward"))
        return (RewardedEpisode if rewarded else FactoryEpisode)(instance, self.spec, row or {})


@dataclass
class FactoryEpisode:
    """One episode's environment object, its methods answering the model's JSON calls."""

    instance: Any
    spec: Any
    row: dict
    bounds_itself = True  # each call runs within rollout.tool_timeout_s (answer_calls)

    def reset(self) -> Any:
        """The object's ``reset(**row)``: what it returns is added to the prompt."""
        kwargs = {k: v for k, v in self.row.items() if k != ROW_COLUMN}
        return self.instance.reset(**kwargs)

    def step(self, model_turn: str) -> Observation | None:
        return answer_calls(tool_methods(self.instance), model_turn, self.spec)


@dataclass
class RewardedEpisode(FactoryEpisode):
    """An episode whose environment owns its reward (``get_reward``, or ``reward``)."""

    def reward(self) -> Any:
        ask = getattr(self.instance, "get_reward", None)
        return ask() if callable(ask) else self.instance.reward()

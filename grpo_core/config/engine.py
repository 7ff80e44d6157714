"""The engine a stage samples with, as one typed value, and the names a config may give.

:class:`EngineSpec` is built once from the config (``RolloutConfig.engine_spec``): the
engine's name, its options, whether to probe its weights against the trainer's, and the
environment (``ToolSpec``: the ``rollout`` section's tool knobs under their own names, or
None). The rollout, evaluation and rejection-sampling tasks take it as it is and hand it to
``SampleRequest.of`` (grpo_core/engines/turns.py); its :meth:`EngineSpec.settings` are what
the stage cache keys and the run records see (the tool knobs under their record names,
grpo_core/config/tools.py: ``RECORD_NAMES``).

``ENGINES`` (rollout engines), ``ENVIRONMENTS`` (the built-in environments of
``rollout.tools``) and ``FUNCTION_TOOLS`` (the built-in ``rollout.functions``) are
registries (grpo_core/registry.py) whose entries are ``"module:attribute"`` strings imported
on first use, so a config checks its names without loading torch or vLLM; a user registers
another with ``ENGINES.add(name, factory)`` (the engine room re-exports the first two).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from grpo_core.config.tools import ToolSpec, tool_spec_of
from grpo_core.registry import Registry

ENGINES: Registry = Registry("rollout engine")
ENGINES.add("hf", "grpo_core.engines:make_hf")
ENGINES.add("vllm", "grpo_core.engines:make_vllm")

ENVIRONMENTS: Registry = Registry("environment")
ENVIRONMENTS.add("python", "grpo_core.engines.environments:PythonTool")
ENVIRONMENTS.add("functions", "grpo_core.engines.functions:FunctionTools")
ENVIRONMENTS.add("factory", "grpo_core.engines.factory_env:FactoryEnvironment")

# the built-in function tools ``rollout.functions`` may name (grpo_core/engines/functions.py);
# a user's own are ``module:function``, or registered with ``FUNCTION_TOOLS.add(name, fn)``
FUNCTION_TOOLS: Registry = Registry("function tool")
FUNCTION_TOOLS.add("calculator", "grpo_core.engines.functions:calculator")


def check_engine_name(name: str, where: str = "engine") -> str:
    """``name`` when it is a registered rollout engine, else a ValueError naming ``where``."""
    if name not in ENGINES:
        raise ValueError(f"{where}: {name!r} is not a rollout engine; expected one of "
                         f"{ENGINES.names()}")  # fmt: skip
    return name


@dataclass(frozen=True)
class EngineSpec:
    """What samples a stage's completions: ``name`` (a registered engine), its ``options``
    (``rollout.engine_options``), ``check_sync`` (probe that the engine's weights are the
    trainer's) and ``tools`` (the environment; None: single-turn completions)."""

    name: str = "hf"
    options: Mapping[str, Any] = field(default_factory=dict)
    check_sync: bool = False
    tools: ToolSpec | None = None

    def __post_init__(self) -> None:
        check_engine_name(self.name)
        object.__setattr__(self, "options", dict(self.options or {}))
        object.__setattr__(self, "tools", tool_spec_of(self.tools))

    @classmethod
    def of(cls, value: EngineSpec | Mapping | None) -> EngineSpec:
        """The spec itself, the default (hf) for None, or one from its
        :meth:`settings` form (``{"name", "options", "check_sync", "tools"}``)."""
        if isinstance(value, EngineSpec):
            return value
        if value is None:
            return cls()
        return cls(value["name"], value.get("options") or {}, bool(value.get("check_sync")),
                   value.get("tools"))  # fmt: skip

    def settings(self) -> dict:
        """As plain data: what run records and parameters show."""
        out = {"name": self.name, "options": dict(self.options), "check_sync": self.check_sync}
        if self.tools is not None:
            out["tools"] = self.tools_settings()
        return out

    def tools_settings(self) -> dict | None:
        """The environment's settings as the stage cache keys take them (``ToolSpec.as_dict``;
        None: no tools)."""
        return None if self.tools is None else self.tools.as_dict()

    def with_tools(self, tools: ToolSpec | Mapping | None) -> EngineSpec:
        return EngineSpec(self.name, self.options, self.check_sync, tools)


__all__ = [
    "ENGINES",
    "ENVIRONMENTS",
    "EngineSpec",
    "ToolSpec",
    "check_engine_name",
]

"""The rollout's environment settings: :class:`ToolSpec` (``rollout.tools`` and the knobs
beside it, copied by name by ``RolloutConfig.tool_spec``) and the default tool markers
(Hermes/Qwen layout). Plain data, no torch: the engines (grpo_core/engines/environments.py)
read it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

TRUNCATION_MARK = "...(truncated)"  # put where a tool's output was cut to its budget
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
RESULT_START, RESULT_END = "<tool_response>", "</tool_response>"


@dataclass(frozen=True)
class ToolSpec:
    """The rollout's environment settings, under the names of the ``rollout`` section's
    knobs (``rollout.tools``, ``rollout.tool_timeout_s``, ...: grpo_core/config/stages.py
    validates and describes them), picklable: it crosses to the engine process and the Ray
    replicas."""

    tools: tuple[str, ...] = ("python",)
    max_turns: int = 4  # model turns per episode (tool calls: at most max_turns - 1)
    max_tool_output_tokens: int = 64  # an observation's tokens, markers included
    tool_call_start: str = CALL_START
    tool_call_end: str = CALL_END
    tool_result_start: str = RESULT_START
    tool_result_end: str = RESULT_END
    tool_timeout_s: float = 5.0  # one call's wall clock
    tool_memory_mb: int = 512  # one call's address space
    tool_workers: int = 0  # tool calls run at once (0: the machine's cores)
    # the sandbox's isolation for tool calls (None: sandbox.isolation / auto); not a
    # rollout knob: tests and benchmarks set it
    tool_isolation: str | None = None
    tool_truncation_mark: str = TRUNCATION_MARK  # where an observation over its budget was cut
    # the ``functions`` environment's function tools (grpo_core/engines/functions.py): its
    # turns end at the end-of-turn token and may hold several JSON calls
    functions: tuple[str, ...] = ()
    # the python tool's sandbox per call: "warm" (a sandbox that stays up and forks a clean
    # process per call, grpo_core/sandbox/forkserver.py) or "fresh" (a new sandbox per call);
    # the same isolation, limits and outputs either way
    tool_sandbox: str = "warm"
    # how long a turn waits for its slowest tool calls (seconds) before the episodes whose
    # calls are answered go on without them (grpo_core/engines/turns.py; an engine with a
    # turn_stream, vLLM, runs each turn as a request of its own instead); None: every call
    # (a barrier per turn, and bit-reproducible samples)
    tool_wait_s: float | None = None
    # JSON function calls run per model turn; the rest are answered with an error, not run
    max_calls_per_turn: int = 16
    # the ``factory`` environment's factories (grpo_core/engines/factory_env.py), as (name,
    # "module:Class") pairs; the name is "" for one environment, else what a row's
    # ``environment`` column says
    environment_factory: tuple[tuple[str, str], ...] = ()

    def __getattr__(self, name: str):
        """The fields' record names (``call_end``, ``timeout_s``, ...: :data:`RECORD_NAMES`),
        read-only, for environments written against them."""
        if name in FIELD_NAMES:
            return getattr(self, FIELD_NAMES[name])
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def json_calls(self) -> bool:
        return self.tools in (("functions",), ("factory",))

    def as_dict(self) -> dict:
        """The settings as the stage cache keys and run records take them, under their
        record names (:data:`RECORD_NAMES`)."""
        data = {RECORD_NAMES.get(k, k): v for k, v in asdict(self).items()}
        if data["sandbox"] == type(self).tool_sandbox:  # the default, left out: stage cache
            del data["sandbox"]  # keys stay as they were (the outputs are the same both ways)
        if data["wait_s"] is None:  # the barrier, the default: left out, as the sandbox
            del data["wait_s"]
        if data["max_calls_per_turn"] == type(self).max_calls_per_turn:  # added later: the
            del data["max_calls_per_turn"]  # default is left out, keys stay as they were
        if not data["environment_factory"]:
            del data["environment_factory"]
        else:
            data["environment_factory"] = [list(p) for p in data["environment_factory"]]
        return data


# The names the tool settings had in the stage cache keys and run records before the fields
# took the ``rollout`` section's names: :meth:`ToolSpec.as_dict` keeps writing them, so
# every tool-using stage's cache key (and stage_config.json, MLflow's parameters) stays as it
# was. The one place the two sets of names meet; fields not listed record under their own.
RECORD_NAMES = {
    "tool_call_start": "call_start",
    "tool_call_end": "call_end",
    "tool_result_start": "result_start",
    "tool_result_end": "result_end",
    "tool_timeout_s": "timeout_s",
    "tool_memory_mb": "memory_mb",
    "tool_workers": "workers",
    "tool_isolation": "isolation",
    "tool_truncation_mark": "truncation_mark",
    "tool_sandbox": "sandbox",
    "tool_wait_s": "wait_s",
}
FIELD_NAMES = {record: name for name, record in RECORD_NAMES.items()}


def tool_spec_of(value: ToolSpec | Mapping | None) -> ToolSpec | None:
    """A ``ToolSpec`` from itself, its fields or its :meth:`~ToolSpec.as_dict` form (a
    record's dict), or None."""
    if value is None or isinstance(value, ToolSpec):
        return value
    data = {FIELD_NAMES.get(k, k): v for k, v in dict(value).items()}
    data["tools"] = tuple(data.get("tools") or ())
    data["functions"] = tuple(data.get("functions") or ())
    data["environment_factory"] = tuple(tuple(p) for p in data.get("environment_factory") or ())
    return ToolSpec(**data)

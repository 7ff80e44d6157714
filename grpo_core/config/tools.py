"""The rollout's environment settings: :class:`ToolSpec` (``rollout.tools`` and the knobs
beside it, built once by ``RolloutConfig.tool_spec``) and the default tool markers (Hermes/Qwen
layout). Plain data, no torch: the engines (grpo_core/engines/environments.py) read it."""

from __future__ import annotations

from dataclasses import dataclass

TRUNCATION_MARK = "...(truncated)"  # put where a tool's output was cut to its budget
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
RESULT_START, RESULT_END = "<tool_response>", "</tool_response>"


@dataclass(frozen=True)
class ToolSpec:
    """The rollout's environment settings (``rollout.tools`` and the knobs beside it),
    picklable: it crosses to the engine process and the Ray replicas."""

    tools: tuple[str, ...] = ("python",)
    max_turns: int = 4  # model turns per episode (tool calls: at most max_turns - 1)
    max_tool_output_tokens: int = 64  # an observation's tokens, markers included
    call_start: str = CALL_START
    call_end: str = CALL_END
    result_start: str = RESULT_START
    result_end: str = RESULT_END
    timeout_s: float = 5.0  # one call's wall clock
    memory_mb: int = 512  # one call's address space
    workers: int = 0  # tool calls run at once (0: the machine's cores)
    isolation: str | None = None  # the sandbox's (None: sandbox.isolation / auto)
    truncation_mark: str = TRUNCATION_MARK  # where an observation over its budget was cut
    # the ``functions`` environment's function tools (grpo_core/engines/functions.py): its
    # turns end at the end-of-turn token and may hold several JSON calls
    functions: tuple[str, ...] = ()
    # the python tool's sandbox per call: "warm" (a sandbox that stays up and forks a clean
    # process per call, grpo_core/sandbox/forkserver.py) or "fresh" (a new sandbox per call);
    # the same isolation, limits and outputs either way
    sandbox: str = "warm"

    @property
    def json_calls(self) -> bool:
        return self.tools == ("functions",)

    def as_dict(self) -> dict:
        from dataclasses import asdict

        data = asdict(self)
        if data["sandbox"] == type(self).sandbox:  # the default, left out: stage cache keys
            del data["sandbox"]  # stay as they were (the outputs are the same in both modes)
        return data

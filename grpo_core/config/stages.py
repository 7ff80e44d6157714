"""Per-stage configuration sections: one pydantic model per stage, unknown keys rejected by name.
The whole-run ``PipelineConfig`` (and loading it from YAML) is a pipeline concern: flows/config.py.

GRPO knob names follow TRL's ``GRPOConfig`` (``num_generations``, ``beta``, ``epsilon``,
``epsilon_high``, ``loss_type``, ``scale_rewards``, ``num_iterations``, ``temperature``,
``max_completion_length``) so a TRL user can carry their settings over.

The ``rl`` section is in ``rl.py``, the model and data sections in ``model.py`` and ``data.py``
of this package. Math functions never receive these objects: a section is turned once into the
typed settings a concern reads (``settings.py``, ``loss.py``), and the tasks hand those on.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from grpo_core.config.data import DataConfig, DemoDataConfig, WordProblemsConfig
from grpo_core.config.engine import EngineSpec, check_engine_name
from grpo_core.config.model import DemoModelConfig, LoraConfig, ModelConfig
from grpo_core.config.rl import RLConfig
from grpo_core.config.section import Section, TrainingKnobs
from grpo_core.config.settings import SFTSettings, same_named
from grpo_core.config.tools import ToolSpec

__all__ = [
    "DataConfig",
    "DemoDataConfig",
    "DemoModelConfig",
    "EvalConfig",
    "LoraConfig",
    "ModelConfig",
    "RLConfig",
    "RejectionConfig",
    "RolloutConfig",
    "SFTConfig",
    "Section",
    "TrainingKnobs",
    "VLLMConfig",
    "WordProblemsConfig",
]


class SFTConfig(TrainingKnobs):
    section_name: ClassVar[str] = "sft"

    max_steps: int = Field(1200, ge=0)
    batch_size: int = Field(32, ge=1)
    learning_rate: float = Field(3e-3, gt=0)
    weight_decay: float = 0.0
    warmup_steps: int = Field(20, ge=0)
    max_grad_norm: float = 1.0
    target_accuracy: float | None = Field(
        None, ge=0, le=1, description="stop once greedy dev accuracy reaches this"
    )
    eval_every: int = Field(100, ge=1)
    min_steps: int = Field(0, ge=0, description="no early stop before this step")
    checkpoint_every: int = Field(
        100, ge=0, description="save a resume checkpoint every K steps (0: off)"
    )
    mask_spans: list[tuple[str, str]] = Field(
        default_factory=list,
        description="[[start, end], ...]: completion text from a start marker to its end marker "
        "(both included) is context, not a target: no loss (a tool's output in a tool-using "
        "trace, as the RL update masks it; e.g. [['<tool_response>', '</tool_response>']]; "
        "with rollout.tools, empty means the tool's result markers)",
    )

    @field_validator("mask_spans")
    @classmethod
    def _markers_not_empty(cls, spans: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """An empty marker matches everywhere: the span search would never advance."""
        for i, (start, end) in enumerate(spans):
            if not start or not end:
                raise ValueError(f"mask_spans[{i}]: {[start, end]}: both markers must be non-empty")
        return spans

    @property
    def training(self) -> SFTSettings:
        """What ``grpo_core.training.sft.train_sft`` trains with, built from this section."""
        return same_named(SFTSettings, self, mask_spans=tuple(map(tuple, self.mask_spans)))


class VLLMConfig(Section):
    """vLLM engine options (``rollout.engine: vllm``); see docs/engines.md and configs/gpu.yaml."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    gpu_memory_utilization: float = Field(
        0.3, gt=0, le=1, description="share of GPU memory vLLM takes"
    )
    tensor_parallel_size: int = Field(1, ge=1)
    enable_sleep_mode: bool = Field(
        False, description="free vLLM's GPU memory during the update (colocated)"
    )
    max_model_len: int | None = Field(None, ge=1)
    max_num_seqs: int = Field(256, ge=1)
    enforce_eager: bool = True
    kv_cache_gib: float | None = Field(
        None, gt=0, description="CPU only: KV cache size (default 1 GiB)"
    )
    cpu_threads: int | None = Field(None, ge=1, description="CPU only (default: torch's threads)")
    offload_optimizer: bool = Field(
        False,
        description="colocated on the trainer's GPU: AdamW's state goes to CPU memory while "
        "vLLM generates and back before the update (grpo_core/training/offload.py)",
    )
    lora_sync: Literal["merged", "adapter"] = Field(
        "merged",
        description="with model.lora: merged sends the merged weights at every sync; adapter "
        "starts vLLM on the adapter's base with LoRA enabled and hands it the adapter alone "
        "(a LoRA request per policy), as verl does",
    )


# padded tokens per generation micro-batch (hf engine): the demo's largest batch (rejection
# sampling: 512 rows x ~63 tokens) fits in one
DEFAULT_MAX_BATCH_TOKENS = 65536


def _engine_name(value: str | None) -> str | None:
    """A registered rollout engine (grpo_core/config/engine.py: ``ENGINES``), or None."""
    return value if value is None else check_engine_name(value, "engine")


EngineName = Annotated[str, AfterValidator(_engine_name)]

# The environment's knobs: ToolSpec's fields (grpo_core/config/tools.py) are declared again
# below, under the same names and with ToolSpec's defaults, for their validation and their
# descriptions; ``RolloutConfig.tool_spec`` copies them across by name.
TOOL = ToolSpec()
# max_turns for TRL's max_tool_calling_iterations: null (no cap): every model turn takes a
# token of the completion budget, so the budget ends an episode long before this many turns
UNCAPPED_TURNS = 1 << 20

TOOL_KNOBS = tuple(
    f.name
    for f in fields(ToolSpec)
    if f.name not in ("tools", "functions", "tool_isolation", "environment_factory")
)


class RolloutConfig(Section):
    engine: EngineName = Field("hf", description="the rollout engine: hf or vllm (ENGINES)")
    batch_size: int = Field(512, ge=1, description="sequences per generation micro-batch")
    max_batch_tokens: int | None = Field(
        DEFAULT_MAX_BATCH_TOKENS,
        ge=1,
        description="hf: cap on padded tokens (rows x (longest prompt + max_completion_length)) "
        "per micro-batch, so generation memory follows tokens, not rows; None: rows only",
    )
    hf_decode: Literal["auto", "dynamic", "static", "cuda_graphs"] = Field(
        "auto",
        description="hf: the decode loop; dynamic (finished rows leave the batch: CPUs), "
        "static (static KV cache, host reads every few steps), cuda_graphs (static, each step "
        "replayed from a CUDA graph); auto: cuda_graphs on a CUDA device, else dynamic",
    )
    hf_turn_cache: bool = Field(
        True,
        description="hf, tools only: keep each episode's KV cache across its turns, so a "
        "turn feeds only its new tokens (the same samples up to float rounding); false: each "
        "turn feeds the whole context again",
    )
    check_sync: bool = Field(False, description="greedy probe after each weight sync")
    vllm: VLLMConfig = VLLMConfig()
    tools: list[str] = Field(
        default_factory=list,
        description="the environment the policy acts in while it samples (rollouts, held-out "
        "evals, rejection sampling): ['python'] (a model turn ending with tool_call_end runs "
        "its code in the code sandbox; the output comes back between the result markers) or "
        "['module:function'] (your own, docs/tools.md); empty: one model turn",
    )
    max_turns: int = Field(TOOL.max_turns, ge=1, description="model turns per episode (tools only)")
    max_tool_output_tokens: int = Field(
        TOOL.max_tool_output_tokens,
        ge=4,
        description="an observation's tokens, result markers included (tools only)",
    )
    tool_call_start: str = Field(TOOL.tool_call_start, min_length=1)
    tool_call_end: str = Field(
        TOOL.tool_call_end, min_length=1, description="ends a turn that calls"
    )
    tool_result_start: str = Field(TOOL.tool_result_start)
    tool_result_end: str = Field(TOOL.tool_result_end)
    tool_timeout_s: float = Field(
        TOOL.tool_timeout_s,
        ge=0.1,
        le=3600,
        description="one tool call's wall clock (0.1 s to an hour)",
    )
    tool_memory_mb: int = Field(
        TOOL.tool_memory_mb,
        ge=64,
        le=1 << 22,
        description="one tool call's address space (preflight: at most the machine's memory)",
    )
    tool_workers: int = Field(
        TOOL.tool_workers, ge=0, description="tool calls at once (0: the cores)"
    )
    tool_sandbox: Literal["warm", "fresh"] = Field(
        TOOL.tool_sandbox,
        description="the python tool's sandbox: 'warm' (started once per worker, a clean "
        "process forked per call) or 'fresh' (a new sandbox per call, ~125 ms); the same "
        "isolation, limits and outputs",
    )
    tool_wait_s: float | None = Field(
        TOOL.tool_wait_s,
        ge=0,
        le=3600,
        description="how long a turn waits for its slowest tool calls before the episodes "
        "whose calls are answered go on without them (if none has answered, it waits for the "
        "first answer; a late episode joins a later turn's batch); null: every call, one "
        "barrier per turn, bit-reproducible samples. Set, samples depend on timing whenever a "
        "call is late on the hf engine; the vllm engine then runs each turn as a request of "
        "its own, seeded on its own (docs/tools.md)",
    )
    max_calls_per_turn: int = Field(
        TOOL.max_calls_per_turn,
        ge=1,
        le=1024,
        description="JSON function calls run per model turn; the ones after are answered "
        "with an error, not run (verl's max_parallel_calls)",
    )
    functions: list[str] = Field(
        default_factory=list,
        description="function tools in the chat template's JSON format (docs/tools.md): "
        "'calculator' or 'module:function' (type hints and a docstring make its schema); the "
        "rows get a 'tools' column the template declares, and rollout.tools becomes "
        "['functions']",
    )
    environment_factory: str | dict[str, str] | None = Field(
        None,
        description="environments in TRL's environment_factory shape (docs/tools.md): "
        "'module:Class' makes one object per episode whose public methods are JSON tools, "
        "with reset(**row) and an optional get_reward(); a mapping {name: 'module:Class'} "
        "mixes several, each row's 'environment' column picking one; rollout.tools becomes "
        "['factory']",
    )
    tool_truncation_mark: str = Field(
        TOOL.tool_truncation_mark,
        description="put before the result end marker where a tool's output was cut to "
        "max_tool_output_tokens (the model and the turns record see it was cut)",
    )

    @model_validator(mode="before")
    @classmethod
    def _trl_names(cls, data: Any) -> Any:
        """TRL's ``max_tool_calling_iterations`` (tool-calling turns per episode) as
        ``max_turns`` (model turns, the last one answering): N calls -> N + 1 turns; null,
        TRL's default (no cap: the token budget ends the episode), is :data:`UNCAPPED_TURNS`."""
        if not isinstance(data, dict) or "max_tool_calling_iterations" not in data:
            return data
        data = dict(data)
        calls = data.pop("max_tool_calling_iterations")
        if calls is None:
            calls = UNCAPPED_TURNS - 1
        if not isinstance(calls, int) or isinstance(calls, bool) or calls < 0:
            raise ValueError(
                f"max_tool_calling_iterations {calls!r}: a number of tool calls (>= 0; TRL's "
                "name, max_turns here is that + 1)"
            )
        if "max_turns" in data and data["max_turns"] != calls + 1:
            raise ValueError(
                f"max_tool_calling_iterations {calls} and max_turns {data['max_turns']} "
                f"disagree: {calls} tool calls are max_turns {calls + 1}; give one of them"
            )
        return {**data, "max_turns": calls + 1}

    @model_validator(mode="after")
    def _functions_are_the_environment(self) -> RolloutConfig:
        if self.functions and self.tools not in ([], ["functions"]):
            raise ValueError(
                f"rollout.functions with rollout.tools {self.tools}: function tools are their "
                "own environment; leave rollout.tools empty (or ['functions'])"
            )
        if self.environment_factory is not None:
            if self.functions or self.tools not in ([], ["factory"]):
                raise ValueError(
                    "rollout.environment_factory with rollout.tools or rollout.functions: the "
                    "environments' methods are the tools; leave those two empty"
                )
            if not self.environment_factory:
                raise ValueError("rollout.environment_factory: name at least one environment")
        return self

    @property
    def environment(self) -> list[str]:
        """``tools``, ``['functions']`` when ``functions`` are given, ``['factory']`` with an
        ``environment_factory``."""
        if self.environment_factory is not None:
            return ["factory"]
        return ["functions"] if self.functions else list(self.tools)

    def factories(self) -> dict[str, str]:
        """``environment_factory`` as ``{name: "module:Class"}`` (name "" for one), or {}."""
        f = self.environment_factory
        if f is None:
            return {}
        return {"": f} if isinstance(f, str) else dict(f)

    def tool_spec(self) -> ToolSpec | None:
        """The environment's settings, or None without ``tools``: this section's knobs of
        the same names, copied (``tools`` is the :attr:`environment`)."""
        if not self.environment:
            return None
        knobs = {name: getattr(self, name) for name in TOOL_KNOBS}
        return ToolSpec(**knobs, tools=tuple(self.environment), functions=tuple(self.functions),
                        environment_factory=tuple(sorted(self.factories().items())))  # fmt: skip

    def engine_options(self, name: str) -> dict:
        if name == "hf":
            return {
                "batch_size": self.batch_size,
                "max_batch_tokens": self.max_batch_tokens,
                "decode": self.hf_decode,
            } | ({"turn_cache": self.hf_turn_cache} if self.environment else {})
        return self.vllm.model_dump() if name == "vllm" else {}  # a user's engine: its defaults

    def engine_spec(self, name: str | None = None) -> EngineSpec:
        """What samples a stage's completions (``name``: its engine; ``None``: ``engine``),
        built once from this section."""
        name = name or self.engine
        return EngineSpec(name, self.engine_options(name), self.check_sync, self.tool_spec())


class RejectionConfig(Section):
    num_prompts: int = Field(512, ge=1)
    num_generations: int = Field(4, ge=1)
    temperature: float = Field(1.0, gt=0)
    max_completion_length: int = Field(48, ge=1)
    min_reward: float = Field(0.0, description="keep completions whose total reward >= this")
    max_per_prompt: int = Field(2, ge=1)
    mix_sft_rows: int = Field(
        0,
        ge=0,
        description="rows of the cold-start SFT data added to the re-SFT set, drawn with the "
        "seed (R1 mixed its SFT data back in); 0: the kept completions only",
    )
    engine: EngineName | None = Field(None, description="None: rollout.engine")
    require: list[str] = Field(
        default_factory=lambda: ["accuracy", "format"],
        description="reward functions that must score 1.0 for a completion to be kept",
    )


class EvalConfig(Section):
    """Held-out evaluation (grpo_core/algorithm/evaluation.py). A completion counts as correct only with
    the accuracy reward's full credit: for ``code_tests``, all of the problem's tests pass."""

    num_examples: int | None = Field(None, ge=1, description="None: the whole eval split")
    max_completion_length: int = Field(48, ge=1)
    num_samples: int = Field(
        1, ge=1, description="k samples per problem: 1 is greedy pass@1; k > 1 adds pass@k, maj@k"
    )
    temperature: float | None = Field(
        None, ge=0, description="None: greedy for num_samples 1, else 1.0"
    )
    sample_table_rows: int = Field(20, ge=0)
    engine: EngineName | None = Field(None, description="None: rollout.engine")
    accuracy_reward: str = Field(
        "accuracy",
        description="accuracy (<answer> tag), math_verify (\\boxed{}), code_tests (all tests "
        "pass), or any reward name",
    )
    format_reward: str = "format"

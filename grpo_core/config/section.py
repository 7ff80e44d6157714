"""The base of every config section (unknown keys are rejected by name, assignments
validated) and of the sections that train (``sft``, ``rl``)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    # inf and nan are refused in every float setting (a learning rate or a temperature of inf
    # would run to a crash or to meaningless samples)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class TrainingKnobs(Section):
    """Memory and precision options of the sections that train (``sft``, ``rl``):
    docs/algorithm.md, "Training at size"."""

    section_name: ClassVar[str] = ""

    max_tokens_per_microbatch: int | None = Field(
        None,
        ge=1,
        description="split each micro-batch into chunks of at most this many padded tokens "
        "(same gradient; bounds activation memory); None: off",
    )
    lm_head: Literal["chunked", "logits"] = Field(
        "chunked",
        description="chunked: log-probs from the hidden states through the LM head, chunk by "
        "chunk; logits: the model's full logits",
    )
    bf16: bool = Field(False, description="bf16 autocast, float32 master weights and log-probs")
    fp16: bool = Field(False, description="fp16 autocast with loss scaling (CUDA only)")
    optim: Literal["adamw_torch", "adamw_torch_foreach", "adamw_torch_fused", "adamw_bnb_8bit"] = (
        Field(
            "adamw_torch",
            description="adamw_torch: torch's AdamW as the device runs it (multi-tensor on "
            "CUDA); adamw_torch_foreach / adamw_torch_fused: that implementation forced; "
            "adamw_bnb_8bit: bitsandbytes 8-bit AdamW (CUDA only)",
        )
    )

    @model_validator(mode="after")
    def _one_precision(self) -> TrainingKnobs:
        if self.bf16 and self.fp16:
            name = self.section_name
            raise ValueError(f"{name}.bf16 and {name}.fp16 are both true: choose one")
        return self

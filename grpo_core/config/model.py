"""The ``model`` section: which checkpoint, how it is loaded, and LoRA (docs/models.md)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from grpo_core.config.section import Section

DEMO_CONTEXT = 256  # the demo model's positions (prompt + completion): grpo_core/demo/model.py


class DemoModelConfig(Section):
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    intermediate_size: int = 512
    vocabulary: Literal["addition", "tools"] = Field(
        "addition", description="tools: also the tool markers and '*' (configs/demo-tools.yaml)"
    )


class LoraConfig(Section):
    """LoRA adapters through ``peft`` (``model.lora``); absent: full fine-tuning."""

    r: int = Field(16, ge=1, description="rank of the adapter matrices")
    alpha: float = Field(32, gt=0, description="scaling numerator (peft's lora_alpha)")
    dropout: float = Field(0.0, ge=0, lt=1, description="peft's lora_dropout")
    target_modules: list[str] | str = Field(
        "all-linear", description="module names (or peft's 'all-linear')"
    )
    save_merged: bool = Field(
        True,
        description="also save the merged weights (what from_pretrained, vLLM and the next "
        "stage load); the adapter is always saved under adapter/",
    )

    @model_validator(mode="after")
    def _merged_saved(self) -> LoraConfig:
        if not self.save_merged:
            raise ValueError(
                "model.lora.save_merged: false is not supported yet: every stage hands the "
                "next one (and rollouts, evals, the registry) a checkpoint of merged weights; "
                "leave it true (the adapter is saved beside them in adapter/)"
            )
        return self


class ModelConfig(Section):
    source: Literal["demo", "path"] = "demo"
    path: str | None = Field(
        None,
        description="save_pretrained directory, or a hub id found in the local Hugging Face "
        "cache, when source=path",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype the policy is loaded (stored and computed) in"
    )
    gradient_checkpointing: bool = Field(
        False, description="recompute activations in the backward pass (use_reentrant=False)"
    )
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"] | None = None
    lora: LoraConfig | None = None
    load_in_4bit: bool = Field(
        False, description="QLoRA: 4-bit NF4 base weights through bitsandbytes (GPU only)"
    )
    device: str = Field(
        "auto",
        description="where policies train and generate: auto (the current CUDA device when "
        "there is one, else cpu), cpu, cuda, cuda:N",
    )
    allow_slow_dtype: bool = Field(
        False,
        description="run bf16/fp16 settings on a CPU that emulates them (25-70x slower than "
        "float32; refused by preflight otherwise)",
    )
    demo: DemoModelConfig = DemoModelConfig()

    @field_validator("device")
    @classmethod
    def _device_name(cls, v: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", v):
            raise ValueError(f"expected auto, cpu, cuda or cuda:N, got {v!r}")
        return v

    @model_validator(mode="after")
    def _path_given(self) -> ModelConfig:
        if self.source == "path" and not self.path:
            raise ValueError("model.path is required when model.source is 'path'")
        if self.load_in_4bit and self.lora is None:
            raise ValueError("model.load_in_4bit trains through LoRA: set model.lora as well")
        return self

    def load_kwargs(self, *, trainer: bool = True) -> dict:
        """``grpo_core.training.checkpoint.load_checkpoint``'s arguments for this section: the
        trainer's (with gradient checkpointing, on ``model.device``), or with
        ``trainer=False`` a rollout replica's (inference, on the replica's own device)."""
        out = {
            "dtype": self.dtype,
            "attn_implementation": self.attn_implementation,
            "load_in_4bit": self.load_in_4bit,
        }
        if trainer:
            out |= {"gradient_checkpointing": self.gradient_checkpointing, "device": self.device}
        return out

    def load_options(self) -> dict:
        """What changes the loaded policy's numbers (enters the stage cache keys);
        gradient checkpointing recomputes the same values and does not."""
        return {
            "dtype": self.dtype,
            "attn_implementation": self.attn_implementation,
            "lora": None if self.lora is None else self.lora.model_dump(),
            "load_in_4bit": self.load_in_4bit,
        }

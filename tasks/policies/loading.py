"""How this process loads policies: its setup's ``model`` section (cluster/process.py:
``STATE.model``: ``model.dtype``, ``attn_implementation``, ``gradient_checkpointing``,
``lora``, ``load_in_4bit``), set by the run context. Every load honours it, a policy in memory
that was loaded with other options is not reused (cluster/policies.py: ``drop_unless``), and
:func:`options_key` puts what changes results into the stage cache keys."""

from __future__ import annotations

from pathlib import Path

from cluster.state import STATE
from grpo_core.config.stages import ModelConfig


def options() -> ModelConfig:
    """How this process loads policies (its setup's ``model`` section)."""
    return STATE.model


def loading() -> dict:
    """The model section's options that decide how a checkpoint loads (not where from)."""
    return STATE.model.model_dump(exclude={"source", "path", "demo"})


def options_key() -> dict | None:
    """The load options that change a stage's outputs, or None when they are the defaults
    (so the keys of a run that sets none stay what they were)."""
    opts = STATE.model.load_options()
    return None if opts == ModelConfig().load_options() else opts


def load(checkpoint: Path):
    """``(model, tokenizer)`` of ``checkpoint``, loaded as this process loads policies."""
    from grpo_core.training.checkpoint import load_checkpoint

    return load_checkpoint(checkpoint, **STATE.model.load_kwargs())


def describe(model) -> dict:
    """What a model in memory is, as loaded: dtype, LoRA, gradient checkpointing."""
    from grpo_core.training import lora
    from grpo_core.training.checkpoint import dtype_name

    return {
        "dtype": dtype_name(model),
        "lora": lora.is_peft(model),
        "gradient_checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
    }

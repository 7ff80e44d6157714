"""Typed settings of sampling, the optimizer, scoring and SFT, built once from a config section.

Like ``loss.py``: plain frozen dataclasses named as the config keys (TRL's and Hugging
Face's names), without torch, so building them costs nothing. A section makes each with
:func:`same_named` (``RLConfig.sampling``, ``RLConfig.optimization``, ``RLConfig.scoring``,
``SFTConfig.training``); the tasks hand them on, and the fields of ``Sampling`` and
``Scoring`` are also what the rollout and score stages put in their cache keys. A notebook
user may build them by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


def same_named(cls, source, **given) -> Any:
    """A ``cls`` whose fields are ``source``'s attributes of the same name; ``given`` fields
    are taken as given, and a field ``source`` lacks keeps its default."""
    values = {
        f.name: getattr(source, f.name)
        for f in fields(cls)
        if f.name not in given and hasattr(source, f.name)
    }
    return cls(**values, **given)


def settings_or_knobs(cls, settings, knobs: dict) -> Any:
    """``settings`` (a ``cls``), or a ``cls`` made of ``knobs``, its fields as keywords: a
    function that takes either (``train_sft``, ``score_file``) refuses both."""
    if settings is not None and knobs:
        raise ValueError(f"give a {cls.__name__} or keywords, not both (got {sorted(knobs)})")
    return settings if settings is not None else cls(**knobs)


@dataclass(frozen=True)
class SamplingParams:
    """One sampling request's knobs, as the engines read them (built by :meth:`Sampling.params`)."""

    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 48
    seed: int | None = None
    min_p: float = 0.0  # drop tokens with prob < min_p * max prob
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in prompt/completion
    stop: tuple[str, ...] = ()  # stop strings, matched on the decoded completion

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How completions are sampled (``rl:`` keys); :meth:`params` is the engines' request."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()  # stop strings, kept in the completion
    max_completion_length: int = 48

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))

    def params(self, n: int, seed: int | None = None):
        """The :class:`SamplingParams` of ``n`` samples per prompt."""
        return same_named(
            SamplingParams, self, n=n, seed=seed, max_new_tokens=self.max_completion_length
        )


@dataclass(frozen=True, kw_only=True)
class Optimization:
    """The optimizer, its learning-rate schedule and the gradient clip of a training section
    (Hugging Face ``TrainingArguments`` names)."""

    optim: str = "adamw_torch"
    learning_rate: float
    weight_decay: float = 0.0
    warmup_steps: int = 0
    lr_scheduler_type: str = "constant"  # SFT has no such key: constant
    max_grad_norm: float = 1.0

    def build(self, model, *, total_steps: int, section: str):
        """A fresh ``(optimizer, scheduler)`` at step 0 over ``total_steps``
        (:func:`grpo_core.training.optim.build_optimization`)."""
        from grpo_core.training.optim import build_optimization  # torch: only when training

        return build_optimization(
            model,
            self.optim,
            learning_rate=self.learning_rate,
            weight_decay=self.weight_decay,
            warmup_steps=self.warmup_steps,
            total_steps=total_steps,
            lr_scheduler_type=self.lr_scheduler_type,
            section=section,
        )


@dataclass(frozen=True, kw_only=True)
class Scoring:
    """How a scored file's rewards and advantages follow from the reward functions: the
    keyword arguments of ``tasks.score.score_file`` besides the weights (see its docstring)."""

    advantage_estimator: str = "grpo"
    scale_rewards: str = "group"
    multi_objective_aggregation: str = "sum_then_normalize"
    overlong_buffer_length: int | None = None
    overlong_penalty_factor: float = 1.0
    max_completion_length: int | None = None


@dataclass(frozen=True, kw_only=True)
class SFTSettings:
    """What :func:`grpo_core.training.sft.train_sft` trains with (``sft:`` keys; see its docstring)."""

    max_steps: int
    batch_size: int
    learning_rate: float
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    optim: str = "adamw_torch"
    target_accuracy: float | None = None
    eval_every: int = 100
    min_steps: int = 0
    checkpoint_every: int = 0
    max_tokens_per_microbatch: int | None = None
    lm_head: str = "chunked"
    bf16: bool = False
    fp16: bool = False
    mask_spans: tuple = ()  # (start, end) markers of completion text the loss skips

    @property
    def optimization(self) -> Optimization:
        return same_named(Optimization, self)

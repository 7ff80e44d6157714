"""Typed settings of the GRPO loss and update, built once from the RL config section, and
the registrations of the loss's parts.

Plain frozen dataclasses with TRL's names, without torch, so building them costs nothing:
``RLConfig.update_config()`` makes one, ``grpo_core.algorithm.update.grpo_update`` and
``grpo_core.algorithm.losses.policy_loss`` read it. A notebook user may build them by hand.

The per-token objectives (``objective``), the aggregations (``loss_type``) and the advantage
estimators (``advantage_estimator``, with an :class:`AdvantageSpec`) are registered
here by name, each once, with its function in ``grpo_core.algorithm.losses`` as ``"module:function"``
(imported when the loss first runs) and its :class:`LossSpec`: the config checks names
against these registries without loading torch. Register your own with
``POLICY_OBJECTIVES.register("name", zero_advantage_is_zero_loss=...)(fn)``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from grpo_core.registry import Registry


@dataclass(frozen=True)
class LossSpec:
    """What the update needs to know about a registered objective or aggregation.

    ``zero_advantage_is_zero_loss``: a row whose advantage is 0 contributes exactly 0 to
    the loss and its gradient (with ``beta`` 0 and no entropy quantile), so the update may
    skip its forward and backward (``skip_zero_advantage``). False for a term that does not
    vanish with the advantage (an entropy bonus): then no row is skipped."""

    zero_advantage_is_zero_loss: bool = True


POLICY_OBJECTIVES: Registry = Registry("policy objective", spec=LossSpec)
LOSS_AGGREGATIONS: Registry = Registry("loss_type", spec=LossSpec)

POLICY_OBJECTIVES.add("clip", "grpo_core.algorithm.losses:clipped_objective")
POLICY_OBJECTIVES.add("cispo", "grpo_core.algorithm.losses:cispo_objective")
LOSS_AGGREGATIONS.add("grpo", "grpo_core.algorithm.losses:agg_grpo")
LOSS_AGGREGATIONS.add("bnpo", "grpo_core.algorithm.losses:agg_bnpo")
LOSS_AGGREGATIONS.add("dapo", "grpo_core.algorithm.losses:agg_dapo")
LOSS_AGGREGATIONS.add("dr_grpo", "grpo_core.algorithm.losses:agg_dr_grpo")


@dataclass(frozen=True)
class AdvantageSpec:
    """What the config checks of a registered advantage estimator: ``scales_rewards``:
    whether it takes ``scale_rewards`` other than ``"none"`` (``dr_grpo`` and ``rloo``
    never scale, so ``rl.scale_rewards`` must be ``none`` with them)."""

    scales_rewards: bool = True


# fn(rewards[N], group_ids[N], *, scale_rewards, ...) -> advantages[N]
# (grpo_core/algorithm/advantages.py); the config also takes "module:function" for your own
ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator", spec=AdvantageSpec)
ADVANTAGE_ESTIMATORS.add("grpo", "grpo_core.algorithm.advantages:grpo_advantages")
ADVANTAGE_ESTIMATORS.add("dr_grpo", "grpo_core.algorithm.advantages:dr_grpo_advantages",
                         scales_rewards=False)  # fmt: skip
ADVANTAGE_ESTIMATORS.add("rloo", "grpo_core.algorithm.advantages:rloo_advantages",
                         scales_rewards=False)  # fmt: skip


def check_advantage_estimator(name: str) -> str:
    """``name`` when registered or of the ``module:function`` form (imported when the
    scoring runs, and by the pre-flight check), else the registry's error."""
    if name in ADVANTAGE_ESTIMATORS or re.fullmatch(r"[\w.]+:[\w.]+", name):
        return name
    return ADVANTAGE_ESTIMATORS.check(name)


def zero_advantage_is_zero_loss(loss: LossConfig) -> bool:
    """Whether ``loss``'s objective and aggregation both declare that a zero-advantage row
    has a zero policy loss (their registrations' :class:`LossSpec`)."""
    return (
        POLICY_OBJECTIVES.spec(loss.objective).zero_advantage_is_zero_loss
        and LOSS_AGGREGATIONS.spec(loss.loss_type).zero_advantage_is_zero_loss
    )


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """The knobs of :func:`grpo_core.algorithm.losses.policy_loss` (see its docstring for each)."""

    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    loss_type: str = "dapo"
    max_completion_length: int | None = None
    importance_sampling_level: str = "token"
    kl_estimator: str = "k3"
    use_bias_correction_kl: bool = False
    objective: str = "clip"
    delta: float | None = None
    clip_ratio_c: float | None = None

    def __post_init__(self) -> None:
        """The refusals of ``RLConfig`` for those who build this by hand (a notebook, a
        library call): the same rule whichever way the loss is configured."""
        if self.objective == "cispo" and self.epsilon_high is None:
            raise ValueError(
                "objective='cispo' needs epsilon_high, the cap of the importance-sampling "
                "weight min(ratio, epsilon_high) (MiniMax-M1, arXiv:2506.13585); without it "
                "the cap would be epsilon (default 0.2). TRL recommends epsilon_high=5.0"
            )
        if self.objective == "cispo":
            given = [n for n in ("delta", "clip_ratio_c") if getattr(self, n) is not None]
            if given:
                raise ValueError(
                    f"{' and '.join(given)} with objective='cispo': a bound of the clipped "
                    "objective, which cispo replaces (its only bound is epsilon_high)"
                )
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1, got {self.clip_ratio_c}")
        if self.epsilon < 0 or (self.epsilon_high is not None and self.epsilon_high < 0):
            raise ValueError("epsilon and epsilon_high must be >= 0")


@dataclass(frozen=True, kw_only=True)
class EngineCorrection:
    """TRL's vLLM importance-sampling correction (``grpo_core.algorithm.importance``)."""

    mode: str = "sequence_mask"
    clip_min: float | None = None
    clip_max: float | None = 3.0


@dataclass(frozen=True, kw_only=True)
class BehaviourWeight:
    """Token-level weights of rows an older policy sampled (``rl.async_level``), AReaL's
    decoupled objective (``grpo_core.algorithm.importance.behaviour_weights``)."""

    mode: str = "token_mask"
    cap: float = 5.0


@dataclass(frozen=True, kw_only=True)
class UpdateConfig:
    """How one generation batch becomes optimizer steps (:func:`grpo_core.algorithm.update.grpo_update`).

    As TRL: the batch is cut into ``steps_per_generation`` micro-batches of whole groups, each
    pass (``num_iterations`` of them) runs them in order, and the optimizer steps after every
    ``gradient_accumulation_steps`` micro-batches, so a generation batch gives
    ``steps_per_generation * num_iterations / gradient_accumulation_steps`` optimizer steps.
    """

    loss: LossConfig = field(default_factory=LossConfig)
    steps_per_generation: int = 1
    gradient_accumulation_steps: int = 1
    num_iterations: int = 1
    top_entropy_quantile: float = 1.0
    temperature: float = 1.0
    max_grad_norm: float = 1.0
    disable_dropout: bool = True
    engine_correction: EngineCorrection | None = None
    behaviour_weight: BehaviourWeight | None = None  # stale rows (async): pi_prox / mu per token
    max_tokens_per_microbatch: int | None = None  # physical chunks of a micro-batch (memory)
    lm_head: str = "chunked"  # "chunked": hidden states through the head; "logits": full logits
    bf16: bool = False  # autocast bf16, float32 master weights and log-probs
    fp16: bool = False  # autocast fp16 with a GradScaler (CUDA only)
    # where old log-probs come from when needed: a no-grad forward ("recompute") or the
    # batch's sampling log-probs ("sampler"; grpo_core.logprobs.old says when that is exact)
    old_logprobs: str = "recompute"
    # rows whose loss is zero whatever the weights (advantage 0 with beta 0 and no entropy
    # quantile, or no completion token that counts) skip the forward and backward; the
    # normaliser still counts them, so the gradient is the same (grpo_core.algorithm.update)
    skip_zero_advantage: bool = True
    # with a skip: the skipped rows' entropy through a no-grad forward, so that ``entropy`` is
    # the whole batch's (TRL's); False: ``entropy/trained_rows`` over the rows that ran only
    entropy_of_skipped_rows: bool = True

    def __post_init__(self) -> None:
        if self.old_logprobs not in ("recompute", "sampler"):
            raise ValueError(
                f"old_logprobs must be 'recompute' or 'sampler', got {self.old_logprobs!r}"
            )
        if self.max_tokens_per_microbatch is not None and self.max_tokens_per_microbatch < 1:
            raise ValueError(
                f"max_tokens_per_microbatch must be >= 1, got {self.max_tokens_per_microbatch}"
            )
        if self.steps_per_generation % self.gradient_accumulation_steps:
            raise ValueError(
                f"steps_per_generation ({self.steps_per_generation}) must be a multiple of "
                f"gradient_accumulation_steps ({self.gradient_accumulation_steps})"
            )

    @property
    def optimizer_steps_per_generation(self) -> int:
        """Optimizer steps of one pass over the generation batch."""
        return self.steps_per_generation // self.gradient_accumulation_steps

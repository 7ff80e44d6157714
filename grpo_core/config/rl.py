"""The ``rl:`` section: GRPO with TRL's ``GRPOConfig`` names, its checks, and the typed
settings each concern reads, built from it once (``sampling``, ``optimization``,
``scoring``, ``update_config()``). Re-exported by ``grpo_core.config.stages``."""

from __future__ import annotations

import warnings
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, Field, model_validator

from grpo_core.config.loss import (
    ADVANTAGE_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_OBJECTIVES,
    EngineCorrection,
    LossConfig,
    UpdateConfig,
    check_advantage_estimator,
)
from grpo_core.config.section import TrainingKnobs
from grpo_core.config.settings import Optimization, Sampling, Scoring, same_named
from grpo_core.registry import Registry


def registered(registry: Registry) -> Any:
    """A name that must be registered in ``registry`` when the config is validated (so
    names registered by the user's code count): an unknown one fails with the registry's
    message, which lists the valid names. The JSON schema lists the names registered when
    it is made."""

    def enum(schema: dict) -> None:
        schema["enum"] = registry.names()

    return Annotated[str, AfterValidator(registry.check), Field(json_schema_extra=enum)]


LossTypeName = registered(LOSS_AGGREGATIONS)
EstimatorName = Annotated[str, AfterValidator(check_advantage_estimator)]
ObjectiveName = registered(POLICY_OBJECTIVES)


def _warn(message: str) -> None:
    """A config warning, pointing at the code that built the section."""
    warnings.warn(message, UserWarning, stacklevel=3)


# a field whose value does not change an update's result: the update's cache key leaves it
# out (tasks/update.py: UNKEYED; the reward weights are in the scored file the update reads)
NOT_IN_UPDATE_KEY = {"update_key": False}


def update_unkeyed(model: type) -> set[str]:
    """The fields of ``model`` marked :data:`NOT_IN_UPDATE_KEY`."""
    return {
        name
        for name, f in model.model_fields.items()
        if isinstance(f.json_schema_extra, dict) and f.json_schema_extra.get("update_key") is False
    }


class RLConfig(TrainingKnobs):
    section_name: ClassVar[str] = "rl"

    iterations: int = Field(
        40,
        json_schema_extra=NOT_IN_UPDATE_KEY,
        ge=0,
        description="generation batches (rollout->score->update)",
    )
    prompts_per_iteration: int = Field(32, ge=1)
    num_generations: int = Field(8, ge=2)
    steps_per_generation: int = Field(
        4, ge=1, description="micro-batches per generation batch (TRL's meaning)"
    )
    gradient_accumulation_steps: int = Field(
        1, ge=1, description="micro-batches per optimizer step (TRL's meaning)"
    )
    num_iterations: int = Field(1, ge=1, description="mu: passes over each generation batch")
    disable_dropout: bool = Field(
        True, description="dropout off in policy and reference (TRL's option, default off there)"
    )
    learning_rate: float = Field(1e-4, gt=0)
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    beta: float = Field(0.0, ge=0)
    epsilon: float = Field(0.2, gt=0)
    epsilon_high: float | None = None
    loss_type: LossTypeName = Field(
        "dapo", description="how the per-token loss is averaged (grpo_core/algorithm/losses.py)"
    )
    scale_rewards: Literal["group", "batch", "none"] = "group"
    advantage_estimator: EstimatorName = Field(
        "grpo",
        description="grpo, dr_grpo, rloo (registered: grpo_core/config/loss.py), or your own "
        "as 'module:function' with their signature",
    )
    importance_sampling_level: Literal["token", "sequence"] = "token"
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    use_bias_correction_kl: bool = False
    objective: ObjectiveName = Field(
        "clip", description="the per-token policy objective (grpo_core/algorithm/losses.py)"
    )
    delta: float | None = Field(
        None, gt=1, description="two-sided clip: cap of the unclipped ratio"
    )
    clip_ratio_c: float | None = Field(
        None, gt=1, description="dual-clip bound for negative advantages"
    )
    top_entropy_quantile: float = Field(1.0, gt=0, le=1)
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = (
        "sum_then_normalize"
    )
    dynamic_sampling: bool = Field(
        False, description="DAPO: drop groups whose rewards are all equal"
    )
    overlong_buffer_length: int | None = Field(
        None, ge=1, description="DAPO soft overlong penalty L_cache"
    )
    overlong_penalty_factor: float = Field(1.0, ge=0)
    vllm_importance_sampling_correction: bool | Literal["auto"] = Field(
        "auto",
        description="reweight tokens by trainer/engine probability ratios (TRL's name; any "
        "engine). auto: on where the engine's numbers differ from the trainer's (vLLM, "
        "bf16, not float32, 4-bit; rows of an older policy get rl.behaviour_weight instead), decided "
        "per scored file and logged (grpo_core/logprobs/old.py: engine_correction_choice)",
    )
    async_level: int = Field(
        0,
        ge=0,
        description="k: iteration i's rollouts are sampled by the policy k updates behind "
        "the newest (after i-k updates; 0: on-policy), so the engine generates while the "
        "trainer updates; a fixed schedule, reproducible and cached like the on-policy "
        "loop (docs/algorithm.md)",
    )
    behaviour_weight: Literal["token_mask", "token_truncate", "none"] = Field(
        "token_mask",
        description="rows sampled by an older policy (async_level): each token's loss times "
        "pi_prox/mu, the policy being updated over the sampler, AReaL's decoupled objective; "
        "token_mask: tokens above behaviour_weight_cap get 0 (AReaL), token_truncate: capped "
        "(truncated IS); none: stale rows train as if the updated policy had sampled them",
    )
    behaviour_weight_cap: float = Field(5.0, gt=0, description="AReaL's behav_imp_weight_cap")
    vllm_importance_sampling_mode: Literal[
        "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
    ] = "sequence_mask"
    vllm_importance_sampling_clip_min: float | None = None
    vllm_importance_sampling_clip_max: float | None = 3.0
    mask_truncated_completions: bool = False
    old_logprobs: Literal["auto", "recompute", "sampler"] = Field(
        "auto",
        description="old log-probs (needed with several optimizer steps or passes per "
        "generation batch): recompute with a no-grad forward, or take the sampler's stored "
        "ones; auto: the sampler's when they are the same numbers (hf engine, same policy, "
        "float32, unprocessed distribution: grpo_core/logprobs/old.py)",
    )
    skip_zero_advantage: bool = Field(
        True,
        description="skip the forward and backward of completions whose loss is zero whatever "
        "the weights (advantage 0 with beta 0 and top_entropy_quantile 1, or no token that "
        "counts); the loss normaliser still counts them, so the update is the same",
    )
    entropy_of_skipped_rows: bool = Field(
        True,
        description="with skip_zero_advantage: a no-grad forward of the skipped completions so "
        "that the entropy metric is the whole batch's, as TRL's (about +40% update time when "
        "60% of the rows are skipped); false: the metric is logged as entropy/trained_rows",
    )
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    stop: list[str] = Field(
        default_factory=list, description="stop strings (kept in the completion)"
    )
    max_completion_length: int = Field(48, ge=1)
    eval_every: int = Field(
        10,
        json_schema_extra=NOT_IN_UPDATE_KEY,
        ge=1,
        description="held-out eval every N iterations",
    )
    eval_on_start: bool = Field(
        True,
        json_schema_extra=NOT_IN_UPDATE_KEY,
        description="held-out eval of the starting checkpoint (step 0 of the stage's curves; "
        "in `grpo run` it is also the previous stage's final evaluation, so it costs nothing)",
    )
    save_steps: int = Field(
        10,
        json_schema_extra=NOT_IN_UPDATE_KEY,
        ge=1,
        description="keep the full train state (weights, AdamW, schedule, RNG) every N "
        "iterations and at the stage's end; the iterations between stay in memory and are "
        "replayed from their cached scored files when a rerun needs them (TRL's save_steps)",
    )
    save_total_limit: int = Field(
        2,
        json_schema_extra=NOT_IN_UPDATE_KEY,
        ge=1,
        description="kept train states of the stage besides its final checkpoint (the oldest "
        "are deleted; TRL's save_total_limit)",
    )
    reward_weights_from: dict[int, dict[str, float]] = Field(
        json_schema_extra=NOT_IN_UPDATE_KEY,
        default_factory=dict,
        description="{iteration: {reward: weight}}: from that iteration on, these weights "
        "replace the `rewards` entries of the same name (a reward curriculum; a rerun that "
        "adds one reuses the iterations before it)",
    )
    rewards_max_error_rate: float = Field(
        1.0,
        gt=0,
        le=1,
        description="stop the stage when a reward function fails on at least this share of an "
        "iteration's rows (1.0: only when it fails on every row)",
    )

    def rewards_at(self, iteration: int, weights: dict[str, float]) -> dict[str, float]:
        """The reward weights of ``iteration``: ``weights`` with the entries of
        ``reward_weights_from`` at or before it applied in order."""
        out = dict(weights)
        for start in sorted(k for k in self.reward_weights_from if k <= iteration):
            out.update(self.reward_weights_from[start])
        return out

    def saves_at(self, iteration: int) -> bool:
        """Whether the update of ``iteration`` keeps its train state (a save point)."""
        return (iteration + 1) % self.save_steps == 0 or iteration + 1 == self.iterations

    @model_validator(mode="after")
    def _consistent(self) -> RLConfig:
        name = self.advantage_estimator
        scales = name not in ADVANTAGE_ESTIMATORS or ADVANTAGE_ESTIMATORS.spec(name).scales_rewards
        if not scales and self.scale_rewards != "none":
            raise ValueError(
                f"rl.advantage_estimator={self.advantage_estimator!r} never scales rewards: "
                "set rl.scale_rewards to 'none'"
            )
        if self.overlong_buffer_length and self.overlong_buffer_length > self.max_completion_length:
            raise ValueError("rl.overlong_buffer_length must be <= rl.max_completion_length")
        return self

    @model_validator(mode="after")
    def _cispo_cap_given(self) -> RLConfig:
        if self.objective == "cispo" and self.epsilon_high is None:
            raise ValueError(
                "rl.objective='cispo' needs rl.epsilon_high, the cap of the importance-sampling "
                "weight min(ratio, epsilon_high) (MiniMax-M1, arXiv:2506.13585, tunes only this "
                "upper bound); without it the cap would be rl.epsilon (default 0.2): REINFORCE "
                "scaled down to 0.2. TRL's GRPOConfig recommends epsilon_high=5.0 for cispo "
                "(ScaleRL's epsilon_max, arXiv:2510.13786)"
            )
        return self

    @model_validator(mode="after")
    def _ignored_loss_knobs(self) -> RLConfig:
        if self.objective == "cispo":
            given = [n for n in ("delta", "clip_ratio_c") if getattr(self, n) is not None]
            if given:
                raise ValueError(
                    f"rl.{' and rl.'.join(given)} with rl.objective='cispo': "
                    f"{'they are' if len(given) > 1 else 'it is'} a bound of the clipped "
                    "objective, which cispo replaces (its only bound is rl.epsilon_high); "
                    "remove it or use objective 'clip'"
                )
        if self.importance_sampling_level == "sequence" and self.loss_type != "grpo":
            _warn(
                f"rl.importance_sampling_level='sequence' (GSPO) with loss_type="
                f"{self.loss_type!r}: GSPO's objective averages the sequence terms per "
                "sequence (loss_type 'grpo'); a token-sum loss weights each sequence's ratio by "
                "its length. TRL warns the same; set rl.loss_type=grpo to follow the paper",
            )
        return self

    @model_validator(mode="after")
    def _warn_processed_sampling_logprobs(self) -> RLConfig:
        filters = [
            f"{name}={value}"
            for name, value, neutral in (
                ("top_p", self.top_p, 1.0),
                ("top_k", self.top_k, 0),
                ("min_p", self.min_p, 0.0),
                ("repetition_penalty", self.repetition_penalty, 1.0),
            )
            if value != neutral
        ]
        if self.vllm_importance_sampling_correction is True and filters:
            _warn(
                f"rl.vllm_importance_sampling_correction with {', '.join(filters)}: vLLM's "
                "sampling log-probs are of the filtered/penalised distribution, so the ratio to "
                "the trainer's full softmax is < 1 on every token and the sequence-level modes "
                "collapse (weights near 0; the hf engine also records the policy's own "
                "log-probs, completion_policy_logprobs, and is not affected); with vLLM sample "
                "from the full distribution (top_p=1, top_k=0, min_p=0, repetition_penalty=1) "
                "or turn the correction off",
            )
        return self

    @model_validator(mode="after")
    def _sampler_without_correction(self) -> RLConfig:
        if self.old_logprobs == "sampler" and self.vllm_importance_sampling_correction is True:
            raise ValueError(
                "rl.old_logprobs=sampler with rl.vllm_importance_sampling_correction: the "
                "correction's ratio would be 1 on every token; use auto or recompute"
            )
        return self

    @property
    def optimizer_steps_per_generation(self) -> int:
        """Optimizer steps per pass over one generation batch."""
        return self.steps_per_generation // self.gradient_accumulation_steps

    @property
    def total_optimizer_steps(self) -> int:
        """Optimizer steps of the whole stage (the learning-rate schedule's length)."""
        return self.iterations * self.optimizer_steps_per_generation * self.num_iterations

    def update_config(self) -> UpdateConfig:
        """The typed settings of ``grpo_core.algorithm.update.grpo_update``, built from this section."""
        engine = None
        if self.vllm_importance_sampling_correction is True:  # "auto": per file (tasks/update)
            engine = EngineCorrection(
                mode=self.vllm_importance_sampling_mode,
                clip_min=self.vllm_importance_sampling_clip_min,
                clip_max=self.vllm_importance_sampling_clip_max,
            )
        return same_named(
            UpdateConfig,
            self,
            loss=same_named(LossConfig, self),
            engine_correction=engine,
            behaviour_weight=None,  # per scored file: rows of an older policy (grpo_core/algorithm/iteration.py)
            old_logprobs="recompute",  # the update task picks the source (rl.old_logprobs)
        )

    @property
    def sampling(self) -> Sampling:
        """How the rollouts sample (the rollout stage's cache key holds these fields)."""
        return same_named(Sampling, self)

    @property
    def optimization(self) -> Optimization:
        """The update's optimizer, learning-rate schedule and gradient clip."""
        return same_named(Optimization, self)

    @property
    def scoring(self) -> Scoring:
        """How scoring turns rewards into advantages (the score stage's cache key)."""
        return same_named(Scoring, self)

    @model_validator(mode="after")
    def _divisible(self) -> RLConfig:
        if self.steps_per_generation % self.gradient_accumulation_steps:
            raise ValueError(
                f"rl.steps_per_generation ({self.steps_per_generation}) must be a multiple of "
                f"rl.gradient_accumulation_steps ({self.gradient_accumulation_steps}): an "
                "optimizer step never spans two generation batches"
            )
        if self.prompts_per_iteration % self.steps_per_generation:
            raise ValueError(
                f"rl.prompts_per_iteration ({self.prompts_per_iteration}) must be divisible by "
                f"rl.steps_per_generation ({self.steps_per_generation}) so each step sees whole groups"
            )
        return self

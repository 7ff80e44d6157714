"""One GRPO iteration, in the paper's order: sample -> score -> advantages -> update.

Each step is a plain call on objects in memory, so an iteration runs in a notebook::

    from grpo_core.algorithm import iteration
    from grpo_core.engines.hf import HFEngine
    from grpo_core.config.rl import RLConfig
    from grpo_core.algorithm.scored_batch import ScoredRows
    from grpo_core.training.train_state import TrainState

    rl = RLConfig(num_generations=8, max_completion_length=48)
    engine = HFEngine(model=model, tokenizer=tok)
    rollouts = iteration.sample(engine, tok, rows, rl.sampling.params(rl.num_generations, seed=0),
                                policy_id="start")
    scored = iteration.score(rollouts, {"accuracy": 1.0, "format": 0.1}, rl.scoring)
    train = TrainState.fresh(model, rl, seed=0)
    update = iteration.update(model, train, ScoredRows.of_table(scored.table), rl,
                              policy_id="start", pad_id=tok.pad_token_id)

The pipeline's stage tasks (tasks/rollout.py, tasks/score.py, tasks/update.py) wrap the
same calls with the stage cache, the Parquet files and the executor (where the engine, the
reward functions and the update run); they hold no algorithm of their own. The held-out
evaluation (grpo_core/algorithm/evaluation.py) samples through step 1 too
(:func:`sample_episodes`, the samples before they are a table). The pieces: step 1 itself
(grpo_core/algorithm/sampling.py) and its turn loop (grpo_core/engines/turns.py), the reward
functions (grpo_core/rewards/), the advantage estimators (grpo_core/algorithm/advantages.py),
the old log-probs' source (grpo_core/logprobs/old.py), the objective
(grpo_core/algorithm/losses.py) and the optimizer steps (grpo_core/algorithm/update.py).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from grpo_core.algorithm.sampling import sample as sample  # 1. sample
from grpo_core.algorithm.sampling import sample_episodes as sample_episodes
from grpo_core.errors import UserError

if TYPE_CHECKING:
    import pyarrow as pa

    from grpo_core.algorithm.scored_batch import ScoredRows
    from grpo_core.config.settings import Scoring
    from grpo_core.config.stages import RLConfig
    from grpo_core.rewards.scoring import ScoreRequest, ScoreResult
    from grpo_core.training.parallel import LocalParallel
    from grpo_core.training.train_state import TrainState

log = logging.getLogger(__name__)
OVERLONG = "overlong_penalty"  # the reward column of DAPO's soft overlong penalty


# 1. sample ------------------------------------------------------------------------------
# sample, sample_episodes: grpo_core/algorithm/sampling.py (imported above)


# 2. score -------------------------------------------------------------------------------


@dataclass
class Scored:
    """A scored table (the rollout rows, one ``reward_<fn>``/``error_<fn>`` per function,
    ``reward`` and ``advantage``), its TRL-named metrics and how many reward calls failed."""

    table: pa.Table
    metrics: dict[str, float]
    errors: int


def score(
    rollouts: pa.Table,
    weights: Mapping[str, float],
    scoring: Scoring,
    *,
    scorer: Callable[[ScoreRequest], ScoreResult] | None = None,
    sandbox_isolation: str | None = None,
    max_error_rate: float = 1.0,
    label: str = "rollouts",
) -> Scored:
    """Every completion of ``rollouts`` scored by the reward functions of ``weights`` (plus
    DAPO's soft overlong penalty as reward ``overlong_penalty`` when
    ``scoring.overlong_buffer_length`` is set), then the advantages (:func:`advantages`).

    ``scorer``: how the functions run over the rows (the executor's ``score``: here or as
    Ray tasks over whole groups; default here). A function that fails on
    ``max_error_rate`` or more of the rows raises a ``UserError`` naming ``label``."""
    import torch

    from grpo_core import rewards
    from grpo_core.algorithm.advantages import group_stats
    from grpo_core.contracts.rollouts import ROLLOUT_COLUMNS, group_ids, scored_table
    from grpo_core.rewards.scoring import ScoreRequest

    build = functools.partial(reward_functions, dict(weights), sandbox_isolation, scoring)
    all_weights = dict(weights)
    if scoring.overlong_buffer_length:
        all_weights[OVERLONG] = scoring.overlong_penalty_factor
    cols = rollouts.to_pydict()
    extra = {k: v for k, v in cols.items() if k not in ROLLOUT_COLUMNS or k == "completion_ids"}
    completions = reward_completions(cols, extra, label)
    gids = group_ids(rollouts, label)
    # the prompts the model saw: the data's, with what an environment's reset() added
    prompts = cols.get("episode_prompt", cols["prompt"])
    request = ScoreRequest(prompts, completions, extra, all_weights, gids, build)
    result = scorer(request) if scorer is not None else request.score_here()
    check_reward_failures(result, max_error_rate, label)
    adv, informative = advantages(result, gids, rollouts.num_rows, scoring)
    metadata = {
        "rewards": all_weights,
        "advantage_estimator": scoring.advantage_estimator,
        "scale_rewards": scoring.scale_rewards,
        "multi_objective_aggregation": scoring.multi_objective_aggregation,
        "overlong_buffer_length": scoring.overlong_buffer_length,
        "sandbox": rewards.isolation_label(weights, sandbox_isolation),
    }
    table = scored_table(
        rollouts, result.per_function, result.errors, result.total, adv.tolist(), metadata=metadata
    )
    # rewards and group ids are host data (the reward functions' numbers): on the CPU, as
    # the advantages are computed, whatever device the policy is on
    host = torch.device("cpu")
    total = [math.nan if v is None else v for v in result.total]
    total = torch.tensor(total, dtype=torch.float64, device=host)
    gid_t = torch.tensor(gids, device=host)
    metrics = {**result.metrics(), **group_stats(total, gid_t, informative)}
    n_err = sum(e is not None for errs in result.errors.values() for e in errs)
    return Scored(table, metrics, n_err)


def reward_completions(cols: dict, extra: dict, label: str) -> list[str]:
    """The texts the reward functions score: the model's own (a tool-using episode's
    assistant turns, ``grpo_core.contracts.text.model_text``), with the whole episode, tool
    output included, as the ``trajectory`` column beside them (``extra``, in place)."""
    from grpo_core.contracts.text import model_text

    if "turns" not in cols:
        return cols["completion"]
    if "trajectory" in cols:
        raise UserError(
            f"{label}: a data column is named 'trajectory', the name reward functions get "
            "a tool-using episode's whole text under; rename that column"
        )
    extra["trajectory"] = cols["completion"]
    return [model_text(c, t) for c, t in zip(cols["completion"], cols["turns"], strict=True)]


def reward_functions(
    weights: dict[str, float], sandbox_isolation: str | None, scoring: Scoring
) -> dict:
    """The functions ``score_completions`` takes besides the registry's: the code rewards
    bound to the sandbox isolation (None: sandbox.isolation / auto), which is resolved now,
    so a machine that cannot isolate stops here (SandboxUnavailable), and DAPO's soft
    overlong penalty under ``OVERLONG`` when ``scoring.overlong_buffer_length`` is set."""
    from grpo_core import rewards
    from grpo_core.rewards.length import soft_overlong_penalty

    functions = rewards.sandboxed(weights, sandbox_isolation)
    if scoring.overlong_buffer_length:
        if OVERLONG in weights:
            raise ValueError(
                f"rewards: {OVERLONG!r} is the name of rl.overlong_buffer_length's penalty; "
                "rename your reward function"
            )
        functions[OVERLONG] = soft_overlong_penalty(
            scoring.max_completion_length, scoring.overlong_buffer_length
        )
    return functions


def check_reward_failures(result, max_error_rate: float, label: str) -> None:
    """Raise when a reward function failed (raised, or returned no number, on a row: score
    ``None`` with an error) on at least ``max_error_rate`` of the rows. Rows a function
    scored while reporting an error (e.g. a sandbox timeout scored 0.0) do not count."""
    for name, scores in result.per_function.items():
        errors = result.errors.get(name) or [None] * len(scores)
        failed = [i for i, (s, e) in enumerate(zip(scores, errors, strict=True)) if s is None and e]
        n = len(scores)
        if not failed or len(failed) < max_error_rate * n:
            continue
        first = failed[0]
        if len(failed) == n:
            share = f"all {n} rows"
        else:
            share = (
                f"{len(failed)} of {n} rows ({len(failed) / n:.0%}, rl.rewards_max_error_rate="
                f"{max_error_rate:g})"
            )
        raise UserError(
            f"reward {name!r} failed on {share} of {label}: {errors[first]} (first row {first})"
        )


# 3. advantages --------------------------------------------------------------------------


def advantages(result, group_ids: list[int], n_rows: int, scoring: Scoring):
    """The advantages [N] of the scored rows (the weighted sum normalised per group, or
    GDPO's per-reward normalisation: ``scoring.multi_objective_aggregation``; a group
    without variance gets exactly 0) and which groups carry a signal."""
    import torch

    from grpo_core.algorithm import advantages as estimators
    from grpo_core.rewards.scoring import reward_matrix

    gids = torch.tensor(group_ids, device="cpu")  # host data, as the reward matrix
    matrix, w = reward_matrix(result.per_function, result.weights, n_rows)  # [N, K]
    aggregation = scoring.multi_objective_aggregation
    adv = estimators.compute_multi(
        matrix,
        gids,
        weights=w,
        aggregation=aggregation,
        name=scoring.advantage_estimator,
        scale_rewards=scoring.scale_rewards,
    )  # [N]
    return adv, estimators.informative_groups(matrix, gids, w, aggregation)


# 4. update ------------------------------------------------------------------------------


@dataclass
class RLUpdate:
    """What one update did: one metrics dict per optimizer step, the stage's step after it,
    the seconds and peak memory of the optimizer steps, and the decisions it made for these
    rows (``engine_correction``, ``old_logprobs``: each ``(choice, reason)``)."""

    history: list[dict]
    global_step: int
    seconds: float
    peak_memory_gib: float
    engine_correction: tuple = ()
    old_logprobs: tuple = ()


def update(
    model,
    train: TrainState,
    rows: ScoredRows,
    rl: RLConfig,
    *,
    policy_id: str,
    pad_id: int,
    quantized: bool = False,
    reference: Callable[[], object] | None = None,
    on_step: Callable[[dict], None] | None = None,
    parallel: LocalParallel | None = None,
    logger: logging.Logger | logging.LoggerAdapter | None = None,
) -> RLUpdate:
    """GRPO steps on ``rows``' kept rows from ``train`` (the stage's state at its
    ``global_step``, advanced in place as the checkpoint written next saves it).

    First the decisions for these rows: the engine importance-sampling correction
    (:func:`engine_correction_for`), where the old log-probs come from
    (:func:`old_logprobs_for`) and the stale rows' behaviour weight
    (:func:`behaviour_weight_for`); then the optimizer steps. ``policy_id``: the id of
    ``model``'s weights (against the rows' sampling policies); ``quantized``: loaded in 4
    bits; ``reference()``: the reference model, asked for only when rows are trained on;
    ``parallel``: this process's strategy (a rank of N; default one process)."""
    from grpo_core.algorithm.update import grpo_update
    from grpo_core.logprobs.precision import new_scaler
    from grpo_core.training.memory import PeakMemory
    from grpo_core.training.parallel import LOCAL
    from grpo_core.training.train_state import rng_state, set_rng_state

    logger = logger or log
    rl, correction = engine_correction_for(rows, rl, model, quantized=quantized, policy=policy_id)
    source, why = old_logprobs_for(rows, rl, model, policy=policy_id, quantized=quantized)
    behaviour = behaviour_weight_for(rows, rl, policy_id)
    if behaviour is not None and (gap := behaviour_gap(rows)):
        logger.warning("%s: rl.behaviour_weight: %s", rows.path, gap)
    set_rng_state(train.rng)  # as saved with the policy checkpoint, resumed or not
    cfg = dataclasses.replace(rl.update_config(), old_logprobs=source, behaviour_weight=behaviour)
    history: list[dict] = []
    seconds = 0.0
    mem = PeakMemory(model.device)
    if rows.keep:
        sampler = (
            rl.vllm_importance_sampling_correction is True
            or source == "sampler"
            or behaviour is not None
        )
        batch = rows.batch(
            pad_id, mask_truncated=rl.mask_truncated_completions, sampling_logprobs=sampler
        )
        ref = reference() if reference is not None else None
        if rl.fp16 and train.scaler is None:  # the stage's loss scaler, kept with its state
            train.scaler = new_scaler(next(model.parameters()).device.type)
        start = time.perf_counter()
        with mem:
            history = grpo_update(
                model,
                train.optimizer,
                train.scheduler,
                batch,
                cfg,
                ref_model=ref,
                on_step=on_step,
                data_parallel=parallel or LOCAL,
                scaler=train.scaler,
            )
        seconds = time.perf_counter() - start
    else:
        logger.warning("%s: no group with reward variance; no update this iteration", rows.path)
    train.global_step, train.rng = train.global_step + len(history), rng_state()
    bad = [h for h in history if not math.isfinite(h["loss"])]
    if bad:
        logger.warning("%d update steps had a non-finite loss", len(bad))
    extra = {**rows.metrics, "peak_memory_gib": mem.gib}
    for h in history:
        h.update(extra)
    on = rl.vllm_importance_sampling_correction
    return RLUpdate(history, train.global_step, seconds, mem.gib, (on, correction), (source, why))


def engine_correction_for(
    rows: ScoredRows, rl: RLConfig, model, *, quantized: bool = False, policy: str | None = None
):
    """``rl`` with ``vllm_importance_sampling_correction`` decided for these rows
    (``auto``: grpo_core/logprobs/old.py, ``engine_correction_choice``; ``policy``: the id of
    the weights being updated, against the rows' sampling policies), and the reason. Rows
    that get a behaviour weight (:func:`behaviour_weight_for`) get no engine correction: the
    behaviour weight divides by the same sampler's log-probs, the engine's mismatch included."""
    from grpo_core.contracts.rollouts import POLICY_LOGPROBS, read_metadata_of
    from grpo_core.logprobs.old import engine_correction_choice
    from grpo_core.training.checkpoint import compute_dtype_name

    if behaviour_weight_for(rows, rl, policy) is not None:
        why = (
            f"off: rows sampled by an older policy get rl.behaviour_weight={rl.behaviour_weight} "
            "(pi_prox / mu per token, the engine's mismatch included)"
        )
        return rl.model_copy(update={"vllm_importance_sampling_correction": False}), why
    on, why = engine_correction_choice(
        rl.vllm_importance_sampling_correction,
        file_meta=read_metadata_of(rows.table),
        model_dtype=compute_dtype_name(model),
        bf16=rl.bf16,
        fp16=rl.fp16,
        quantized=quantized,
        old_logprobs=rl.old_logprobs,
        policy_logprobs=POLICY_LOGPROBS in rows.table.column_names,
    )
    return rl.model_copy(update={"vllm_importance_sampling_correction": on}), why


def behaviour_weight_for(rows: ScoredRows, rl: RLConfig, policy: str | None):
    """The behaviour weight of these rows (a ``BehaviourWeight``), or None: on when an older
    policy than ``policy`` sampled them (``rl.async_level``), ``rl.behaviour_weight`` is not
    ``none`` and old log-probs are recomputed (with ``old_logprobs: sampler`` the ratio itself
    is against the sampler: plain off-policy PPO)."""
    from grpo_core.config.loss import BehaviourWeight

    if policy is None or rl.behaviour_weight == "none" or rl.old_logprobs == "sampler":
        return None
    if set(rows.table.column("policy_id").unique().to_pylist()) == {policy}:
        return None
    return BehaviourWeight(mode=rl.behaviour_weight, cap=rl.behaviour_weight_cap)


def behaviour_gap(rows: ScoredRows) -> str | None:
    """Why these rows' behaviour weights would not compare like with like, or None
    (grpo_core/logprobs/old.py, ``behaviour_logprobs_gap``)."""
    from grpo_core.contracts.rollouts import POLICY_LOGPROBS, read_metadata_of
    from grpo_core.logprobs.old import behaviour_logprobs_gap

    return behaviour_logprobs_gap(
        read_metadata_of(rows.table), policy_logprobs=POLICY_LOGPROBS in rows.table.column_names
    )


def old_logprobs_for(
    rows: ScoredRows, rl: RLConfig, model, *, policy: str, quantized: bool = False
) -> tuple[str, str]:
    """``rl.old_logprobs`` resolved for these rows and the policy being updated (``model``,
    whose weights are ``policy``; ``quantized``: loaded in 4 bits): ``(source, reason)``."""
    from grpo_core.contracts.rollouts import read_metadata_of
    from grpo_core.logprobs.old import old_logprobs_source
    from grpo_core.training.checkpoint import compute_dtype_name

    return old_logprobs_source(
        rl.old_logprobs,
        file_meta=read_metadata_of(rows.table),
        policy_ids=set(rows.table.column("policy_id").unique().to_pylist()),
        policy_id=policy,
        temperature=rl.temperature,
        model_dtype=compute_dtype_name(model),
        bf16=rl.bf16,
        fp16=rl.fp16,
        quantized=quantized,
        disable_dropout=rl.disable_dropout,
        engine_correction=rl.vllm_importance_sampling_correction is True
        or behaviour_weight_for(rows, rl, policy) is not None,
    )

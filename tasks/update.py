"""Update task: a scored Parquet (this run's, an older run's, anyone's) -> GRPO optimizer
steps on the policy -> a new checkpoint. Reference log-probs are recomputed from the token ids
in the file, so any scored file with the contract's columns will do; old log-probs too, unless
the file's own sampling log-probs are the same numbers (``rl.old_logprobs``,
grpo_core/old_logprobs.py)."""

from __future__ import annotations

import dataclasses
import math

from prefect import task
from prefect.cache_policies import NO_CACHE

from cluster import process, storage
from grpo_core.checkpoint import policy_id, save_checkpoint
from grpo_core.config import RLConfig
from grpo_core.old_logprobs import old_logprobs_source
from grpo_core.rollouts import group_ids, read_metadata_of, read_scored
from tasks import warm
from tasks.cache import cached, stage_key
from tasks.common import logger, pull, timer
from tasks.results import UpdateResult


def update_from_file(
    policy_checkpoint: str,
    scored_path: str,
    out_checkpoint: str,
    rl: RLConfig,
    *,
    reference_checkpoint: str | None = None,
    global_step: int = 0,
    total_steps: int | None = None,
    on_step=None,
    stage: str = "offline",
    init_checkpoint: str | None = None,
    seed: int = 0,
    data_parallel=None,
) -> UpdateResult:
    """GRPO steps on ``scored_path`` from ``policy_checkpoint``, saved to ``out_checkpoint``
    with the trainer state (AdamW, LR schedule, RNG states, step) that the next iteration of
    the stage continues from (``tasks/warm.py: train_state``).

    ``stage`` and ``init_checkpoint`` (the stage's first policy; default the reference
    checkpoint, else the policy) name the stage the optimizer belongs to: at ``global_step``
    0 it is fresh, later it is the state saved with ``policy_checkpoint`` by this stage.

    ``data_parallel`` (a ``grpo_core.distributed.DataParallel``): this is one rank of N that
    run the same call (``flows/ddp_update.py``); the update is the one-process update and
    rank 0 alone writes the checkpoint.
    """
    from grpo_core.memory import PeakMemory
    from grpo_core.trainer_state import rng_state, set_rng_state
    from grpo_core.update import grpo_update

    table, cols, gids, keep, extra = _scored_rows(scored_path, rl)
    init = init_checkpoint or reference_checkpoint or policy_checkpoint
    # a trainer rank on another node: the inputs this update reads that its node lacks
    pull(
        policy_checkpoint,
        reference_checkpoint if rl.beta > 0 else None,
        init if warm.options().lora is not None else None,  # the LoRA adapter's base
    )
    w = warm.get(policy_checkpoint, mutate=True, lora_base=init)
    tok = w.tokenizer
    dp = data_parallel
    sharded = dp is not None and dp.sharded
    if sharded:
        _shard(dp, w)
    elif dp is not None:
        dp.broadcast_parameters(w.model)  # replicas start from rank 0's weights
    total = total_steps or (global_step + rl.optimizer_steps_per_generation * rl.num_iterations)
    key = _optimizer_key(rl, stage, init, total, sharded)

    def build(model):
        return rl.optimization.build(model, total_steps=total, section="rl")

    source, why = _old_logprobs_source(rl, table, w)
    update_cfg = dataclasses.replace(rl.update_config(), old_logprobs=source)
    logger(__name__).debug("%s: old log-probs: %s (%s)", scored_path, source, why)
    train = warm.train_state(
        w,
        key=key,
        global_step=global_step,
        build=build,
        seed=seed,
        load_optimizer=dp.load_full_optimizer_state if sharded else None,
    )
    set_rng_state(train.rng)  # as saved with the policy checkpoint, resumed or not
    history: list[dict] = []
    t = {"seconds": 0.0}
    mem = PeakMemory(w.model.device)
    if keep:
        batch = _batch(cols, gids, keep, rl, tok.pad_token_id, sampler_logprobs=source == "sampler")
        ref = warm.reference(w, reference_checkpoint) if rl.beta > 0 else None
        with timer() as t, mem:
            history = grpo_update(
                w.model,
                train.optimizer,
                train.scheduler,
                batch,
                update_cfg,
                ref_model=ref,
                on_step=on_step,
                data_parallel=dp,
            )
    else:
        logger(__name__).warning(
            "%s: no group with reward variance; no update this iteration", scored_path
        )
    step = global_step + len(history)
    train.global_step, train.rng = step, rng_state()
    _save(w, train, out_checkpoint, {"scored": scored_path, "global_step": step}, dp)
    warm.put(out_checkpoint, w)
    bad = [h for h in history if not math.isfinite(h["loss"])]
    if bad:
        logger(__name__).warning("%d update steps had a non-finite loss", len(bad))
    extra["peak_memory_gib"] = mem.gib
    for h in history:
        h.update(extra)
    return UpdateResult(out_checkpoint, step, history, t["seconds"], mem.gib)


def _scored_rows(scored_path: str, rl: RLConfig):
    """The scored file's columns the update reads, its group ids, the rows it trains on (with
    ``rl.dynamic_sampling``: the groups with reward variance, DAPO) and their metrics."""
    import torch

    from grpo_core.sampling_filters import dynamic_sampling_mask

    pull(scored_path)
    table = read_scored(scored_path)
    cols = table.select(
        ["prompt_ids", "completion_ids", "completion_logprobs", "advantage", "finish_reason"]
    ).to_pydict()
    gids = group_ids(table, scored_path)
    keep = list(range(table.num_rows))
    extra: dict[str, float] = {}
    if rl.dynamic_sampling:  # DAPO: groups without reward variance carry no signal
        informative = dynamic_sampling_mask(
            torch.tensor(cols["advantage"], dtype=torch.float64), torch.tensor(gids)
        )
        keep = informative.nonzero().squeeze(-1).tolist()
        extra["dynamic_sampling/kept_frac"] = len(keep) / max(1, table.num_rows)
    return table, cols, gids, keep, extra


def _optimizer_key(rl: RLConfig, stage: str, init: str, total: int, sharded: bool) -> dict:
    """What the optimizer state belongs to: a saved state is reused only under the same key."""
    return {
        "stage": stage,
        "init_policy_id": policy_id(init),
        "learning_rate": rl.learning_rate,
        "weight_decay": rl.weight_decay,
        "warmup_steps": rl.warmup_steps,
        "lr_scheduler_type": rl.lr_scheduler_type,
        "total_steps": total,
        # the default is left out so that trainer states saved before the choice existed match
        **({"optim": rl.optim} if rl.optim != "adamw_torch" else {}),
        # a sharded optimizer's saved state is keyed by parameter name, a replica's by index
        **({"strategy": "fsdp"} if sharded else {}),
    }


def _batch(cols: dict, gids: list, keep: list[int], rl: RLConfig, pad_id: int, *, sampler_logprobs):
    """The update's batch of rows ``keep`` (truncated rows marked with
    ``rl.mask_truncated_completions``; the sampler's log-probs when something reads them)."""
    from grpo_core.update import build_batch

    pick = lambda name: [cols[name][i] for i in keep]  # noqa: E731
    return build_batch(
        pick("prompt_ids"),
        pick("completion_ids"),
        pick("advantage"),
        pad_id,
        truncated=[r == "length" for r in pick("finish_reason")]
        if rl.mask_truncated_completions
        else None,
        group_ids=[gids[i] for i in keep],
        sampling_logprobs=pick("completion_logprobs")
        if rl.vllm_importance_sampling_correction or sampler_logprobs
        else None,
    )


def _save(w, train, out_checkpoint: str, info: dict, dp) -> None:
    """The policy and its trainer state to ``out_checkpoint``. With ranks: a sharded model's
    weights and optimizer gathered on every rank (collectives), written by rank 0 and shared
    through the store; every rank returns once it exists."""
    sharded = dp is not None and dp.sharded
    state, weights = train.state_dict(), None
    if sharded:
        state["optimizer"] = dp.full_optimizer_state(w.model, train.optimizer)
        weights = dp.full_state_dict(w.model)
    if dp is None or dp.rank == 0:
        save_checkpoint(
            w.model,
            w.tokenizer,
            out_checkpoint,
            trainer_state=state,
            info={**info, **warm.lora_info(w)},
            state_dict=weights,
        )
        if dp is not None:  # the driver (and the next iteration's ranks) may be elsewhere
            storage.publish(out_checkpoint)
    if dp is not None:
        dp.barrier()  # the checkpoint exists when any rank returns
        if dp.rank != 0:  # on another node than rank 0's: its copy, from the shared store
            pull(out_checkpoint)


def _shard(dp, w) -> None:
    """Shard the warm policy's decoder layers (FSDP2) the first time this rank trains it; a
    reloaded policy is sharded again and its optimizer state rebuilt (grpo_core/fsdp.py)."""
    if dp.is_wrapped(w.model):
        return
    if warm.lora_info(w):
        raise ValueError(
            "cluster.trainer.strategy: fsdp does not shard LoRA adapters; use strategy: ddp "
            "with model.lora"
        )
    w.train = None  # an optimizer built on the unsharded parameters
    dp.broadcast_parameters(w.model)  # equal weights on every rank before sharding
    dp.wrap(w.model)


def update_on_rank(data_parallel, model_options, **kwargs) -> UpdateResult:
    """One rank of the trainer group (a Ray actor): the run's model load options, then
    :func:`update_from_file` with this rank's ``data_parallel``."""
    process.load_policies_with(model_options)
    return update_from_file(**kwargs, data_parallel=data_parallel)


def run_update(*, iteration: int, **kwargs) -> UpdateResult:
    """:func:`update_from_file` (keywords) where this process's executor runs updates: here,
    or on every rank of the trainer group (``cluster.backend: ray``,
    cluster/trainer_group.py) with the run's model load options."""
    import functools

    from cluster import runtime

    return runtime.executor().update(
        update_from_file,
        functools.partial(update_on_rank, model_options=warm.options()),
        kwargs,
        what=f"{kwargs.get('stage', 'offline')} iteration {iteration} update",
        out_checkpoint=kwargs["out_checkpoint"],
    )


def _old_logprobs_source(rl: RLConfig, table, w) -> tuple[str, str]:
    """``rl.old_logprobs`` resolved for this scored table and warm policy."""
    param = next(w.model.parameters())
    return old_logprobs_source(
        rl.old_logprobs,
        file_meta=read_metadata_of(table),
        policy_ids=set(table.column("policy_id").unique().to_pylist()),
        policy_id=w.policy_id,
        temperature=rl.temperature,
        model_dtype=str(param.dtype).removeprefix("torch."),
        bf16=rl.bf16,
        fp16=rl.fp16,
        quantized=warm.options().load_in_4bit,
        disable_dropout=rl.disable_dropout,
        engine_correction=rl.vllm_importance_sampling_correction,
    )


@task(name="update", task_run_name="{stage}-update-{iteration}", cache_policy=NO_CACHE)
def update(
    stage: str,
    iteration: int,
    policy_checkpoint: str,
    scored_path: str,
    out_checkpoint: str,
    rl: RLConfig,
    *,
    reference_checkpoint: str | None = None,
    init_checkpoint: str | None = None,
    global_step: int = 0,
    total_steps: int | None = None,
    seed: int = 0,
    force: bool = False,
) -> UpdateResult:
    """``init_checkpoint``: the stage's first policy (with ``stage``, the optimizer's
    identity: tasks/warm.py); ``seed`` seeds the RNGs at the stage's first step."""
    knobs = rl.model_dump(exclude={"eval_every", "eval_on_start", "iterations"})
    inputs = [policy_checkpoint, scored_path] + ([reference_checkpoint] if rl.beta > 0 else [])
    settings = {**knobs, "global_step": global_step, "total_steps": total_steps, "seed": seed}
    key = stage_key("update", settings, inputs)

    def compute() -> UpdateResult:
        out = run_update(
            iteration=iteration,
            policy_checkpoint=policy_checkpoint,
            scored_path=scored_path,
            out_checkpoint=out_checkpoint,
            rl=rl,
            reference_checkpoint=reference_checkpoint,
            global_step=global_step,
            total_steps=total_steps,
            stage=stage,
            init_checkpoint=init_checkpoint,
            seed=seed,
        )
        last = out.history[-1] if out.history else {}
        logger(__name__).info(
            "%s iteration %d: %d steps, loss %.4f, entropy %.3f, %.1fs, peak %.2f GiB",
            stage,
            iteration,
            len(out.history),
            last.get("loss", math.nan),
            last.get("entropy", math.nan),  # not measured when every row was skipped
            out.seconds,
            out.peak_memory_gib,
        )
        return out

    return cached(
        f"{stage} iteration {iteration} update", out_checkpoint, key, compute, force=force
    )

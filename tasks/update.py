"""Update task: a scored Parquet (this run's, an older run's, anyone's) -> GRPO optimizer
steps on the policy -> a new checkpoint. Old and reference log-probs are recomputed from
the token ids in the file, so any scored file with the contract's columns will do."""

from __future__ import annotations

import math

from prefect import task
from prefect.cache_policies import NO_CACHE

from grpo_core.checkpoint import policy_id, save_checkpoint
from grpo_core.config import RLConfig
from grpo_core.rollouts import group_ids, read_scored
from tasks import warm
from tasks.cache import cached, stage_key
from tasks.common import logger, timer
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
) -> UpdateResult:
    """GRPO steps on ``scored_path`` from ``policy_checkpoint``, saved to ``out_checkpoint``
    with the trainer state (AdamW, LR schedule, RNG states, step) that the next iteration of
    the stage continues from (``tasks/warm.py: train_state``).

    ``stage`` and ``init_checkpoint`` (the stage's first policy; default the reference
    checkpoint, else the policy) name the stage the optimizer belongs to: at ``global_step``
    0 it is fresh, later it is the state saved with ``policy_checkpoint`` by this stage.
    """
    import torch  # here, not at the top: a cached rerun never loads torch

    from grpo_core.sampling_filters import dynamic_sampling_mask
    from grpo_core.schedule import lr_lambda
    from grpo_core.trainer_state import rng_state, set_rng_state
    from grpo_core.update import build_batch, grpo_update

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
    w = warm.get(policy_checkpoint, mutate=True)
    tok = w.tokenizer
    total = total_steps or (global_step + rl.optimizer_steps_per_generation * rl.num_iterations)
    init = init_checkpoint or reference_checkpoint or policy_checkpoint
    key = {
        "stage": stage,
        "init_policy_id": policy_id(init),
        "learning_rate": rl.learning_rate,
        "weight_decay": rl.weight_decay,
        "warmup_steps": rl.warmup_steps,
        "lr_scheduler_type": rl.lr_scheduler_type,
        "total_steps": total,
    }

    def build(model):
        opt = torch.optim.AdamW(
            model.parameters(), lr=rl.learning_rate, weight_decay=rl.weight_decay
        )
        kind = rl.lr_scheduler_type
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(rl.warmup_steps, total, kind))
        return opt, sched

    train = warm.train_state(w, key=key, global_step=global_step, build=build, seed=seed)
    set_rng_state(train.rng)  # as saved with the policy checkpoint, resumed or not
    history: list[dict] = []
    t = {"seconds": 0.0}
    if keep:
        pick = lambda name: [cols[name][i] for i in keep]  # noqa: E731
        batch = build_batch(
            pick("prompt_ids"),
            pick("completion_ids"),
            pick("advantage"),
            tok.pad_token_id,
            truncated=[r == "length" for r in pick("finish_reason")]
            if rl.mask_truncated_completions
            else None,
            group_ids=[gids[i] for i in keep],
            sampling_logprobs=pick("completion_logprobs")
            if rl.vllm_importance_sampling_correction
            else None,
        )
        ref = warm.get(reference_checkpoint, slot="reference").model if rl.beta > 0 else None
        with timer() as t:
            history = grpo_update(
                w.model,
                train.optimizer,
                train.scheduler,
                batch,
                rl.update_config(),
                ref_model=ref,
                on_step=on_step,
            )
    else:
        logger(__name__).warning(
            "%s: no group with reward variance; no update this iteration", scored_path
        )
    step = global_step + len(history)
    train.global_step, train.rng = step, rng_state()
    save_checkpoint(
        w.model,
        tok,
        out_checkpoint,
        trainer_state=train.state_dict(),
        info={"scored": scored_path, "global_step": step},
    )
    warm.put(out_checkpoint, w)
    bad = [h for h in history if not math.isfinite(h["loss"])]
    if bad:
        logger(__name__).warning("%d update steps had a non-finite loss", len(bad))
    for h in history:
        h.update(extra)
    return UpdateResult(out_checkpoint, step, history, t["seconds"])


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
    knobs = rl.model_dump(exclude={"eval_every", "iterations"})
    inputs = [policy_checkpoint, scored_path] + ([reference_checkpoint] if rl.beta > 0 else [])
    settings = {**knobs, "global_step": global_step, "total_steps": total_steps, "seed": seed}
    key = stage_key("update", settings, inputs)

    def compute() -> UpdateResult:
        out = update_from_file(
            policy_checkpoint,
            scored_path,
            out_checkpoint,
            rl,
            reference_checkpoint=reference_checkpoint,
            global_step=global_step,
            total_steps=total_steps,
            stage=stage,
            init_checkpoint=init_checkpoint,
            seed=seed,
        )
        last = out.history[-1] if out.history else {"loss": math.nan, "entropy": math.nan}
        logger(__name__).info(
            "%s iteration %d: %d steps, loss %.4f, entropy %.3f, %.1fs",
            stage,
            iteration,
            len(out.history),
            last["loss"],
            last["entropy"],
            out.seconds,
        )
        return out

    return cached(
        f"{stage} iteration {iteration} update", out_checkpoint, key, compute, force=force
    )

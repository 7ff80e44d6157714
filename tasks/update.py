"""Update task: a scored Parquet (this run's, an older run's, anyone's) -> GRPO optimizer
steps on the policy -> a new checkpoint. Old and reference log-probs are recomputed from
the token ids in the file, so any scored file with the contract's columns will do."""

from __future__ import annotations

import math

from prefect import task
from prefect.cache_policies import NO_CACHE

from grpo_core.checkpoint import save_checkpoint
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
) -> UpdateResult:
    import torch  # here, not at the top: a cached rerun never loads torch

    from grpo_core.sampling_filters import dynamic_sampling_mask
    from grpo_core.schedule import lr_lambda
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
        opt = warm.optimizer_for(w, learning_rate=rl.learning_rate, weight_decay=rl.weight_decay)
        steps = rl.optimizer_steps_per_generation * rl.num_iterations
        total = total_steps or (global_step + steps)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lr_lambda(rl.warmup_steps, total, rl.lr_scheduler_type), last_epoch=-1
        )
        for _ in range(global_step):  # position the schedule at this iteration's first step
            sched.step()
        ref = warm.get(reference_checkpoint, slot="reference").model if rl.beta > 0 else None
        with timer() as t:
            history = grpo_update(
                w.model, opt, sched, batch, rl.update_config(), ref_model=ref, on_step=on_step
            )
    else:
        logger(__name__).warning(
            "%s: no group with reward variance; no update this iteration", scored_path
        )
    step = global_step + len(history)
    state = {
        "optimizer": None if w.optimizer is None else w.optimizer.state_dict(),
        "optimizer_key": w.optimizer_key,
        "global_step": step,
        "rng": torch.get_rng_state(),
    }
    save_checkpoint(
        w.model,
        tok,
        out_checkpoint,
        trainer_state=state,
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
    global_step: int = 0,
    total_steps: int | None = None,
    force: bool = False,
) -> UpdateResult:
    knobs = rl.model_dump(exclude={"eval_every", "iterations"})
    inputs = [policy_checkpoint, scored_path] + ([reference_checkpoint] if rl.beta > 0 else [])
    key = stage_key(
        "update", {**knobs, "global_step": global_step, "total_steps": total_steps}, inputs
    )

    def compute() -> UpdateResult:
        out = update_from_file(
            policy_checkpoint,
            scored_path,
            out_checkpoint,
            rl,
            reference_checkpoint=reference_checkpoint,
            global_step=global_step,
            total_steps=total_steps,
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

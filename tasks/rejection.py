"""Rejection-sampling task: sample from the RL policy, score, keep correct and well-formed
completions, dedupe, write an SFT dataset (JSONL) for re-SFT."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from grpo_core.checkpoint import policy_id
from grpo_core.config import RejectionConfig
from grpo_core.data import load_rows
from grpo_core.errors import UserError
from grpo_core.io import write_jsonl
from grpo_core.rejection import select_completions, to_sft_rows
from grpo_core.rollouts import read_scored
from tasks.cache import cached, stage_key
from tasks.common import logger
from tasks.results import RejectionResult
from tasks.rollout import HF_ENGINE, rollout_shards, sample_rollouts, select_prompts
from tasks.score import score_file
from tasks.tracking import Tracking
from tasks.workspace import SamplingDir


@task(name="rejection_sampling", cache_policy=NO_CACHE)
def rejection_sampling(
    checkpoint: str,
    rl_path: str,
    stage_dir: str,
    cfg: RejectionConfig,
    weights: dict[str, float],
    tracking: Tracking,
    seed: int,
    force: bool = False,
    engine: dict | None = None,
) -> RejectionResult:
    engine = engine or HF_ENGINE
    settings = {**cfg.model_dump(), "rewards": weights, "seed": seed, "engine": engine["name"]}
    shards = rollout_shards(cfg.num_prompts)
    if shards > 1:  # replicas sample their shards with their own seeds (cluster/)
        settings["rollout_shards"] = shards
    run_id = tracking.start_child(
        "rejection_sampling",
        {"init_checkpoint": checkpoint, "policy_id": policy_id(checkpoint)},
        config=settings,
    )
    tracking.log_params(run_id, {**cfg.model_dump(), "rewards": weights})
    key = stage_key("rejection_sampling", settings, [checkpoint, rl_path])
    files = SamplingDir(Path(stage_dir))
    sft_path = str(files.sft_data)
    out = cached(
        "rejection_sampling",
        sft_path,
        key,
        force=force,
        outputs=[files.rollouts, files.scored],
        compute=lambda: _sample_and_filter(
            checkpoint, rl_path, stage_dir, cfg, weights, seed, engine
        ),
    )
    tracking.log_metrics(run_id, out.metrics)
    tracking.log_artifact(run_id, sft_path)
    tracking.set_tags(run_id, {"cache_key": key, "cached": str(out.cached).lower()})
    per_prompt = acceptance_by_prompt(files, cfg)
    tracking.log_table(run_id, per_prompt, "acceptance_by_prompt.json")
    publish_rejection_artifact(out.metrics, per_prompt, tracking.run_url(run_id))
    tracking.end(run_id)
    return dataclasses.replace(out, run_id=run_id)


def acceptance_by_prompt(files: SamplingDir, cfg: RejectionConfig) -> list[dict]:
    """Per prompt: completions sampled, kept and the acceptance rate (the selection is
    recomputed from the scored file: it is a pure function of its rows and the settings)."""
    rows = read_scored(files.scored).to_pylist()
    kept = select_completions(
        rows,
        min_reward=cfg.min_reward,
        max_per_prompt=cfg.max_per_prompt,
        require={k: 1.0 for k in cfg.require},
    )
    stats: dict[str, dict] = {}
    for r in rows:
        s = stats.setdefault(
            r["prompt_id"], {"prompt": r["prompt_text"], "sampled": 0, "kept": 0, "rewards": []}
        )
        s["sampled"] += 1
        s["rewards"].append(r["reward"] if r["reward"] is not None else 0.0)
    for r in kept:
        stats[r["prompt_id"]]["kept"] += 1
    return [
        {
            "prompt_id": pid,
            "prompt": s["prompt"],
            "sampled": s["sampled"],
            "kept": s["kept"],
            "acceptance_rate": s["kept"] / s["sampled"],
            "mean_reward": sum(s["rewards"]) / len(s["rewards"]),
        }
        for pid, s in stats.items()
    ]


def publish_rejection_artifact(metrics: dict, per_prompt: list[dict], run_url: str | None) -> None:
    """The Prefect artifact of rejection sampling (key ``rejection-sampling``): kept /
    sampled, and the acceptance of each prompt (a table artifact, ``...-by-prompt``)."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    link = f"[MLflow run]({run_url})" if run_url else "MLflow run: see the tracking store"
    md = (
        f"## rejection_sampling\n\nKept **{int(metrics['kept'])}** of "
        f"**{int(metrics['sampled'])}** completions ({100 * metrics['acceptance_rate']:.1f}%) "
        f"over {int(metrics.get('prompts_covered', 0))} of {len(per_prompt)} prompts; mean "
        f"reward {metrics.get('reward', float('nan')):.3f}. {link}\n\n"
        "Per-prompt acceptance: artifact `rejection-sampling-by-prompt`."
    )
    create_markdown_artifact(
        key="rejection-sampling", markdown=md, description="rejection sampling: kept / sampled"
    )
    table = [
        {**r, "prompt": r["prompt"][-120:], "acceptance_rate": round(r["acceptance_rate"], 3)}
        for r in per_prompt
    ]
    create_table_artifact(
        key="rejection-sampling-by-prompt",
        table=[{k: v for k, v in r.items() if k != "prompt_id"} for r in table],
        description="rejection sampling: acceptance per prompt",
    )


def _sample_and_filter(
    checkpoint, rl_path, stage_dir, cfg: RejectionConfig, weights, seed, engine
) -> RejectionResult:
    files = SamplingDir(Path(stage_dir))
    rows = load_rows(rl_path)
    idx = select_prompts(len(rows), min(cfg.num_prompts, len(rows)), 0, seed, "rejection_sampling")
    roll = sample_rollouts(
        checkpoint,
        [rows[i] for i in idx],
        str(files.rollouts),
        num_generations=cfg.num_generations,
        temperature=cfg.temperature,
        max_completion_length=cfg.max_completion_length,
        iteration=0,
        seed=seed,
        engine=engine["name"],
        engine_options=engine["options"],
        check_sync=engine["check_sync"],
        desc="rejection sampling",
    )
    scored = score_file(roll.path, str(files.scored), weights)
    kept = select_completions(
        read_scored(scored.path).to_pylist(),
        min_reward=cfg.min_reward,
        max_per_prompt=cfg.max_per_prompt,
        require={k: 1.0 for k in cfg.require},
    )
    n = len(idx) * cfg.num_generations
    if not kept:
        means = ", ".join(
            f"{k} {scored.metrics.get(f'rewards/{k}/mean', float('nan')):.2f}" for k in cfg.require
        )
        raise UserError(
            f"rejection sampling kept no completion of {n} from {checkpoint} (mean reward "
            f"{scored.metrics['reward']:.2f}{'; ' + means if means else ''}): lower "
            f"rejection_sampling.min_reward ({cfg.min_reward:g}), require fewer rewards "
            f"(rejection_sampling.require={cfg.require}), sample more "
            "(rejection_sampling.num_prompts/num_generations) or train rl_1 longer (rl.iterations)"
        )
    sft_path = write_jsonl(to_sft_rows(kept), files.sft_data)
    stats = {
        "sampled": float(n),
        "kept": float(len(kept)),
        "acceptance_rate": len(kept) / n,
        "prompts_covered": float(len({r["prompt_id"] for r in kept})),
        "reward": scored.metrics["reward"],
        **{k: v for k, v in scored.metrics.items() if k.startswith("rewards/")},
        "completions/mean_length": roll.metrics["completions/mean_length"],
    }
    logger(__name__).info(
        "rejection sampling: kept %d of %d completions (%.1f%%) over %d prompts",
        len(kept),
        n,
        100 * stats["acceptance_rate"],
        int(stats["prompts_covered"]),
    )
    return RejectionResult(str(sft_path), stats)

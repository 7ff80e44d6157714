"""Rejection-sampling task: sample from the RL policy, score, keep correct and well-formed
completions, dedupe, write an SFT dataset (JSONL) for re-SFT. Its report counts the
completions that passed, the duplicates and the per-prompt cap apart from the ones kept
(:func:`rejection_line`, the ``rejection-sampling`` artifacts)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from grpo_core.algorithm.rejection import (
    DUPLICATE,
    FAILED,
    KEPT,
    OVER_CAP,
    classify_completions,
    mix_sft_rows,
    to_sft_rows,
)
from grpo_core.config.engine import EngineSpec
from grpo_core.config.stages import RejectionConfig
from grpo_core.contracts.io import write_jsonl
from grpo_core.contracts.prompts import load_rows
from grpo_core.contracts.rollouts import read_scored
from grpo_core.errors import UserError
from grpo_core.training.checkpoint import policy_id
from tasks.cache import cached, stage_key, tool_code
from tasks.results import RejectionOutcome
from tasks.rollout import rollout_shards, sample_rollouts, select_prompts
from tasks.run_log import logger
from tasks.score import score_file
from tasks.tracking.runs import stage_run
from tasks.tracking.stages import Tracking
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
    engine: EngineSpec | None = None,
    cold_start_data: str | None = None,
) -> RejectionOutcome:
    """``cold_start_data``: the cold-start SFT data, read when ``cfg.mix_sft_rows`` mixes some
    of it into the re-SFT set."""
    engine = EngineSpec.of(engine)
    if cfg.mix_sft_rows and not cold_start_data:
        raise UserError("rejection_sampling.mix_sft_rows: no cold-start SFT data was given")
    settings = {**cfg.model_dump(), "rewards": weights, "seed": seed, "engine": engine.name}
    if not cfg.mix_sft_rows:  # keys of runs from before the setting stay as they were
        del settings["mix_sft_rows"]
        cold_start_data = None
    if engine.tools:  # the environment the policy acts in
        settings["tools"] = engine.tools_settings()
    shards = rollout_shards(cfg.num_prompts)
    if shards > 1:  # replicas sample their shards with their own seeds (cluster/)
        settings["rollout_shards"] = shards
    with stage_run(
        tracking,
        "rejection_sampling",
        {"init_checkpoint": checkpoint, "policy_id": policy_id(checkpoint)},
        config=settings,
    ) as run_id:
        tracking.log_params(run_id, {**cfg.model_dump(), "rewards": weights})
        inputs = [checkpoint, rl_path] + ([cold_start_data] if cold_start_data else [])
        code = (*weights, *tool_code(settings.get("tools")))
        key = stage_key("rejection_sampling", settings, inputs, code=code)
        files = SamplingDir(Path(stage_dir))
        sft_path = str(files.sft_data)
        out = cached(
            "rejection_sampling",
            sft_path,
            key,
            force=force,
            outputs=[files.rollouts, files.scored],
            compute=lambda: _sample_and_filter(
                checkpoint, rl_path, stage_dir, cfg, weights, seed, engine, cold_start_data
            ),
        )
        per_prompt = acceptance_by_prompt(files, cfg)
        # a result recorded before the passed / duplicate counts gets them from the scored file
        out = dataclasses.replace(out, metrics={**selection_metrics(per_prompt), **out.metrics})
        tracking.log_metrics(run_id, out.metrics)
        tracking.log_artifact(run_id, sft_path)
        tracking.set_tags(run_id, {"cache_key": key, "cached": str(out.cached).lower()})
        tracking.log_table(run_id, per_prompt, "acceptance_by_prompt.json")
        publish_rejection_artifact(out.metrics, per_prompt, tracking.run_url(run_id), cfg)
    return dataclasses.replace(out, run_id=run_id)


def _require(cfg: RejectionConfig) -> dict[str, float]:
    return {k: 1.0 for k in cfg.require}


def _classify(rows: list[dict], cfg: RejectionConfig) -> list[str]:
    return classify_completions(
        rows, min_reward=cfg.min_reward, max_per_prompt=cfg.max_per_prompt, require=_require(cfg)
    )


def by_prompt(
    rows: list[dict], cfg: RejectionConfig, status: list[str] | None = None
) -> list[dict]:
    """Per prompt, in order of first appearance: completions ``sampled``, ``passed`` (met the
    requirements: ``min_reward`` and the ``require`` rewards at 1.0), ``duplicates`` (passed,
    dropped as a repeat of another passing completion of the prompt), ``capped`` (passed and
    distinct, dropped by ``max_per_prompt``) and ``kept`` (written to the re-SFT data);
    ``passed = duplicates + capped + kept``. Rates and the mean reward are rounded to 3
    decimals (they are read by people; the counts are exact). ``status``: the rows'
    :func:`~grpo_core.algorithm.rejection.classify_completions` when already computed."""
    stats: dict[str, dict] = {}
    for r, st in zip(rows, status or _classify(rows, cfg), strict=True):
        s = stats.setdefault(r["prompt_id"], {"prompt": r["prompt_text"], "sampled": 0})
        for k in (FAILED, DUPLICATE, OVER_CAP, KEPT, "rewards"):
            s.setdefault(k, [] if k == "rewards" else 0)
        s["sampled"] += 1
        s[st] += 1
        s["rewards"].append(r["reward"] if r["reward"] is not None else 0.0)
    return [
        {
            "prompt_id": pid,
            "prompt": s["prompt"],
            "sampled": s["sampled"],
            "passed": s["sampled"] - s[FAILED],
            "duplicates": s[DUPLICATE],
            "capped": s[OVER_CAP],
            "kept": s[KEPT],
            "pass_rate": round((s["sampled"] - s[FAILED]) / s["sampled"], 3),
            "acceptance_rate": round(s[KEPT] / s["sampled"], 3),  # kept / sampled
            "mean_reward": round(sum(s["rewards"]) / len(s["rewards"]), 3),
        }
        for pid, s in stats.items()
    ]


def acceptance_by_prompt(files: SamplingDir, cfg: RejectionConfig) -> list[dict]:
    """:func:`by_prompt` of the stage's scored file (the selection is recomputed from it: it
    is a pure function of its rows and the settings)."""
    return by_prompt(read_scored(files.scored).to_pylist(), cfg)


def selection_metrics(per_prompt: list[dict]) -> dict[str, float]:
    """The stage's ``passed``, ``duplicates``, ``capped`` and ``pass_rate`` (passed /
    sampled) from :func:`by_prompt`'s rows."""
    total = {
        k: float(sum(r[k] for r in per_prompt))
        for k in ("sampled", "passed", "duplicates", "capped")
    }
    sampled = total.pop("sampled")
    return {**total, "pass_rate": total["passed"] / sampled if sampled else 0.0}


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def rejection_line(metrics: dict) -> str:
    """The one-line summary, e.g. ``rejection sampling: 2048 sampled, 1530 passed (74.7%),
    1046 duplicates, 484 kept`` (with ``N over the per-prompt cap`` before ``kept`` when the
    cap dropped passing completions). ``metrics``: the stage's metrics, or the pipeline
    summary's ``rejection_sampling`` entry; one without ``passed`` (recorded before it was
    counted) gives ``... N sampled, K kept (P%)``."""
    n, kept = int(metrics["sampled"]), int(metrics["kept"])
    if metrics.get("passed") is None:
        return f"rejection sampling: {n} sampled, {kept} kept ({_pct(kept, n)})"
    passed, dups = int(metrics["passed"]), int(metrics.get("duplicates") or 0)
    capped = int(metrics.get("capped", passed - dups - kept) or 0)
    parts = [f"{n} sampled", f"{passed} passed ({_pct(passed, n)})", f"{dups} duplicates"]
    if capped:
        parts.append(f"{capped} over the per-prompt cap")
    line = "rejection sampling: " + ", ".join([*parts, f"{kept} kept"])
    mixed = int(metrics.get("mixed_sft_rows") or 0)
    return f"{line}, + {mixed} cold-start SFT rows" if mixed else line


def publish_rejection_artifact(
    metrics: dict,
    per_prompt: list[dict],
    run_url: str | None,
    cfg: RejectionConfig | None = None,
) -> None:
    """The Prefect artifact of rejection sampling (key ``rejection-sampling``): sampled,
    passed, duplicates, capped and kept, and per prompt the same counts (a table artifact,
    ``rejection-sampling-by-prompt``). ``cfg`` names the requirements and the cap."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    link = f"[MLflow run]({run_url})" if run_url else "MLflow run: see the tracking store"
    n, kept = int(metrics["sampled"]), int(metrics["kept"])
    counts = {**selection_metrics(per_prompt), **metrics}
    passed, dups, capped = (int(counts[k]) for k in ("passed", "duplicates", "capped"))
    if cfg is not None:
        rule = f"total reward >= {cfg.min_reward:g}" + (
            f" and {', '.join(cfg.require)} at 1.0" if cfg.require else ""
        )
        cap = f"max_per_prompt {cfg.max_per_prompt}"
    else:
        rule, cap = "the stage's requirements", "max_per_prompt"
    md = "\n".join(
        [
            "## rejection_sampling",
            "",
            f"{rejection_line(counts)}",
            "",
            f"- **{passed}** of **{n}** sampled completions passed ({_pct(passed, n)}): {rule}",
            f"- {dups} of the passing ones were duplicates of another passing completion of "
            "their prompt (dropped)",
            f"- {capped} passing, distinct ones were over the per-prompt cap ({cap}; dropped)",
            f"- Kept **{kept}** of **{n}** completions ({_pct(kept, n)}) for re-SFT, over "
            f"{int(metrics.get('prompts_covered', 0))} of {len(per_prompt)} prompts",
            *(
                [f"- Added **{int(mixed)}** rows of the cold-start SFT data (mix_sft_rows)"]
                if (mixed := metrics.get("mixed_sft_rows"))
                else []
            ),
            "",
            f"Mean reward {metrics.get('reward', float('nan')):.3f}. {link}",
            "",
            "Per prompt (sampled, passed, duplicates, capped, kept): artifact "
            "`rejection-sampling-by-prompt`.",
        ]
    )
    create_markdown_artifact(
        key="rejection-sampling",
        markdown=md,
        description="rejection sampling: sampled / passed / duplicates / kept",
    )
    create_table_artifact(
        key="rejection-sampling-by-prompt",
        table=[
            {**{k: v for k, v in r.items() if k != "prompt_id"}, "prompt": r["prompt"][-120:]}
            for r in per_prompt
        ],
        description="rejection sampling per prompt: sampled, passed, duplicates, capped, kept",
    )


def _sample_and_filter(
    checkpoint,
    rl_path,
    stage_dir,
    cfg: RejectionConfig,
    weights,
    seed,
    engine,
    cold_start_data=None,
) -> RejectionOutcome:
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
        engine=engine.name,
        engine_options=engine.options,
        check_sync=engine.check_sync,
        tools=engine.tools,
        desc="rejection sampling",
    )
    scored = score_file(roll.path, str(files.scored), weights)
    scored_rows = read_scored(scored.path).to_pylist()
    status = _classify(scored_rows, cfg)
    kept = [r for r, st in zip(scored_rows, status, strict=True) if st == KEPT]
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
    mixed = []
    if cold_start_data:
        sft_rows = load_rows(cold_start_data, required=("prompt", "completion"))
        mixed = mix_sft_rows(sft_rows, cfg.mix_sft_rows, seed)
    out_path = write_jsonl(to_sft_rows(kept) + mixed, files.sft_data)
    stats = {
        "sampled": float(n),
        "kept": float(len(kept)),
        "acceptance_rate": len(kept) / n,
        **selection_metrics(by_prompt(scored_rows, cfg, status)),
        "prompts_covered": float(len({r["prompt_id"] for r in kept})),
        **({"mixed_sft_rows": float(len(mixed))} if cold_start_data else {}),
        "reward": scored.metrics["reward"],
        **{k: v for k, v in scored.metrics.items() if k.startswith("rewards/")},
        "completions/mean_length": roll.metrics["completions/mean_length"],
    }
    logger(__name__).info(
        "%s, over %d prompts", rejection_line(stats), int(stats["prompts_covered"])
    )
    return RejectionOutcome(str(out_path), stats)

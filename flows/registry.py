"""Register a pipeline's final checkpoint in the MLflow model registry.

The registered artifact is the part of the final checkpoint that ``from_pretrained`` reads
(config.json, generation_config.json, ``*.safetensors`` weights and their index, tokenizer
files, chat template), logged under the parent run's ``final_checkpoint/`` artifacts:
``mlflow artifacts download`` (or the model version's source URI) gives back a folder that
``AutoModelForCausalLM.from_pretrained`` and vLLM load as is; no MLflow flavor wrapper.
Files are chosen by an allow-list: what else a checkpoint holds (``trainer_state.pt`` with
the optimizer state, ``policy_id.txt``, ``checkpoint_info.json``, anything added later) stays
out. A LoRA checkpoint's adapter goes along under ``final_checkpoint/adapter/`` (for
``PeftModel.from_pretrained`` on the stage's initial weights; tag ``adapter``), beside the
merged weights that ``from_pretrained`` loads. The policy id becomes a version tag. Stage metrics go to the version's tags and
description.
"""

from __future__ import annotations

from pathlib import Path

from grpo_core.checkpoint import model_files, policy_id

ARTIFACT_PATH = "final_checkpoint"


def _flatten(stage_metrics: dict) -> dict[str, float]:
    """``{"rl_2": {"accuracy": .9}}`` or ``{"rl_2/eval/accuracy": .9}`` -> flat names."""
    flat: dict[str, float] = {}
    for key, value in stage_metrics.items():
        if isinstance(value, dict):
            for metric, v in value.items():
                if isinstance(v, int | float) and not isinstance(v, bool):
                    flat[f"{key}/eval/{metric}"] = float(v)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            flat[key] = float(value)
    return flat


def _describe(run_name: str, flat: dict[str, float]) -> str:
    stages: dict[str, dict[str, float]] = {}
    for key, v in flat.items():
        stage, _, metric = key.partition("/eval/")
        if metric:
            stages.setdefault(stage, {})[metric] = v
    lines = [
        f"Final checkpoint of R1 pipeline run `{run_name}` (Hugging Face save_pretrained "
        "directory).",
        "",
    ]
    if stages:
        lines += ["| stage | accuracy | format rate | mean length |", "|---|---|---|---|"]
        for stage, m in stages.items():
            acc, fmt, length = (m.get(k) for k in ("accuracy", "format_rate", "mean_length"))
            lines.append(
                f"| {stage} | {'-' if acc is None else f'{100 * acc:.1f}%'} "
                f"| {'-' if fmt is None else f'{100 * fmt:.1f}%'} "
                f"| {'-' if length is None else f'{length:.1f}'} |"
            )
    return "\n".join(lines)


def _log_checkpoint(client, run_id: str, checkpoint_dir: Path) -> None:
    for item in model_files(checkpoint_dir):  # grpo_core.checkpoint's allow-list
        folder = item.parent.relative_to(checkpoint_dir).as_posix()
        client.log_artifact(
            run_id, str(item), ARTIFACT_PATH if folder == "." else f"{ARTIFACT_PATH}/{folder}"
        )


def register_final_checkpoint(
    tracking_uri: str,
    parent_run_id: str,
    checkpoint_dir: str | Path,
    stage_metrics: dict,
    model_name: str | None = None,
    final_stage: str | None = None,
):
    """Log the model files of ``checkpoint_dir`` (``grpo_core.checkpoint.MODEL_FILES``) as artifacts of the
    parent run and register a model version.

    Args:
        stage_metrics: per-stage eval metrics, ``{stage: {"accuracy": ..., ...}}`` or flat
            ``{"<stage>/eval/accuracy": ...}``; they become version tags (the flat names) and
            a markdown table in the version's description.
        model_name: registered model name; default: the parent run's experiment name.
        final_stage: recorded as the ``stage`` tag (default: the last stage in the metrics).

    Returns the ``ModelVersion``; its ``source`` is the artifact URI of the directory.
    """
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / "config.json").exists():
        raise FileNotFoundError(
            f"{checkpoint_dir} is not a save_pretrained directory (no config.json)"
        )
    if not any(checkpoint_dir.glob("*.safetensors")):
        raise FileNotFoundError(f"{checkpoint_dir}: no *.safetensors weights to register")
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    run = client.get_run(parent_run_id)
    name = model_name or client.get_experiment(run.info.experiment_id).name
    flat = _flatten(stage_metrics)
    stages = list(dict.fromkeys(k.partition("/eval/")[0] for k in flat if "/eval/" in k))
    final_stage = final_stage or (stages[-1] if stages else "")

    _log_checkpoint(client, parent_run_id, checkpoint_dir)
    try:
        client.create_registered_model(
            name,
            tags={"pipeline": "r1"},
            description="R1 pipeline final checkpoints (Hugging Face directories).",
        )
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    tags = {
        "pipeline_run_id": parent_run_id,
        "run_name": run.info.run_name or "",
        "stage": final_stage,
        "format": "huggingface",
        "git_commit": run.data.tags.get("mlflow.source.git.commit", "unknown"),
        "policy_id": policy_id(checkpoint_dir),  # the weights' hash, verified
        **({"adapter": "adapter/"} if (checkpoint_dir / "adapter").is_dir() else {}),
        **{k: f"{v:.6g}" for k, v in flat.items()},
    }
    version = client.create_model_version(
        name,
        source=f"{run.info.artifact_uri.rstrip('/')}/{ARTIFACT_PATH}",
        run_id=parent_run_id,
        tags=tags,
        description=_describe(run.info.run_name or parent_run_id, flat),
    )
    client.set_tag(parent_run_id, "registered_model", f"{name}/{version.version}")
    return version

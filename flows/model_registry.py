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

Each version is tagged with its held-out accuracy (``heldout_accuracy``: the final stage's
``<stage>/eval/accuracy``), and the registered model's ``champion`` alias points at the
version with the best held-out accuracy so far (``models:/<name>@champion``): a new version
takes it only when it is strictly better (ties keep the older champion), so the newest
version is not necessarily the one to deploy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_core.training.checkpoint import model_files, policy_id

ARTIFACT_PATH = "final_checkpoint"
CHAMPION = "champion"  # the registered model's alias of its best version
ACCURACY_TAG = "heldout_accuracy"


@dataclass(frozen=True)
class Registered:
    """What :func:`register_final_checkpoint` registered: the new ``ModelVersion`` (its
    attributes read through: ``name``, ``version``, ``tags``, ``source``...) and the version
    the ``champion`` alias points at after it (None: no version has a held-out accuracy)."""

    model_version: Any  # mlflow.entities.model_registry.ModelVersion
    accuracy: float | None  # the new version's held-out accuracy
    champion_version: str | None
    champion_accuracy: float | None

    def __getattr__(self, attr: str):
        if attr.startswith("__") or attr == "model_version":
            raise AttributeError(attr)
        return getattr(self.model_version, attr)

    @property
    def is_champion(self) -> bool:
        return self.champion_version == str(self.model_version.version)

    def champion(self) -> dict | None:
        """For the pipeline summary: ``{"version", "accuracy", "uri", "is_new_version"}``."""
        if self.champion_version is None:
            return None
        return {
            "version": self.champion_version,
            "accuracy": self.champion_accuracy,
            "uri": f"models:/{self.model_version.name}@{CHAMPION}",
            "is_new_version": self.is_champion,
        }

    def line(self) -> str:
        """``registered as grpo-demo/3 (champion: version 2, accuracy 41.0%)``."""
        return registration_line(
            f"{self.model_version.name}/{self.model_version.version}", self.champion()
        )


def _pct(accuracy: float | None) -> str:
    return "unknown" if accuracy is None else f"{100 * accuracy:.1f}%"


def registration_line(registered_model: str, champion: dict | None) -> str:
    """The summary's line for ``summary["registered_model"]`` and ``summary["champion"]``
    (:meth:`Registered.champion`): ``registered as grpo-demo/3 (champion: version 2,
    accuracy 41.0%)``, ``... (champion: this version, accuracy 45.0%)``."""
    if not champion:
        return f"registered as {registered_model} (no champion: no held-out accuracy)"
    which = "this version" if champion.get("is_new_version") else f"version {champion['version']}"
    return (
        f"registered as {registered_model} (champion: {which}, "
        f"accuracy {_pct(champion.get('accuracy'))})"
    )


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


def _describe(
    run_name: str, flat: dict[str, float], final_stage: str = "", accuracy: float | None = None
) -> str:
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
    if accuracy is not None:
        where = final_stage or "final stage"
        lines += [f"Held-out accuracy ({where}): **{_pct(accuracy)}**.", ""]
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


def _tag_accuracy(tags: dict[str, str]) -> float | None:
    """A version's held-out accuracy from its tags: ``heldout_accuracy``, or for a version
    registered before that tag, its ``<stage>/eval/accuracy`` tag."""
    for key in (ACCURACY_TAG, f"{tags.get('stage', '')}/eval/accuracy"):
        try:
            return float(tags[key])
        except (KeyError, ValueError):
            continue
    return None


def _current_champion(client, name: str, exclude: str) -> tuple[str, float] | None:
    """The version the ``champion`` alias points at and its accuracy; without the alias
    (or when its version has no accuracy tag), the best of the model's other versions by
    their tags, the oldest of equals."""
    aliases = client.get_registered_model(name).aliases or {}
    if CHAMPION in aliases:
        mv = client.get_model_version_by_alias(name, CHAMPION)
        acc = _tag_accuracy(mv.tags)
        if acc is not None:
            return str(mv.version), acc
    scored = [
        (acc, -int(mv.version), str(mv.version))
        for mv in client.search_model_versions(f"name = '{name}'")
        if str(mv.version) != exclude and (acc := _tag_accuracy(mv.tags)) is not None
    ]
    if not scored:
        return None
    acc, _, version = max(scored)
    return version, acc


def _update_champion(client, name: str, version: str, accuracy: float | None):
    """Point the ``champion`` alias at ``version`` when its accuracy beats the current
    champion's (strictly: ties keep the older one); the champion's version and accuracy."""
    current = _current_champion(client, name, exclude=version)
    if accuracy is not None and (current is None or accuracy > current[1]):
        current = (version, accuracy)
    if current is None:
        return None, None
    if str((client.get_registered_model(name).aliases or {}).get(CHAMPION)) != current[0]:
        client.set_registered_model_alias(name, CHAMPION, current[0])
    return current


def _log_checkpoint(client, run_id: str, checkpoint_dir: Path) -> None:
    for item in model_files(checkpoint_dir):  # grpo_core.training.checkpoint's allow-list
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
    """Log the model files of ``checkpoint_dir`` (``grpo_core.training.checkpoint.MODEL_FILES``) as artifacts of the
    parent run and register a model version.

    Args:
        stage_metrics: per-stage eval metrics, ``{stage: {"accuracy": ..., ...}}`` or flat
            ``{"<stage>/eval/accuracy": ...}``; they become version tags (the flat names) and
            a markdown table in the version's description.
        model_name: registered model name; default: the parent run's experiment name.
        final_stage: recorded as the ``stage`` tag (default: the last stage in the metrics);
            its ``accuracy`` is the version's held-out accuracy (tag ``heldout_accuracy``),
            which decides whether the ``champion`` alias moves to the new version.

    Returns a :class:`Registered`: the ``ModelVersion`` (``.name``, ``.version``, ``.tags``,
    ``.source``: the artifact URI of the directory) and the champion after registering
    (``.champion_version``, ``.champion_accuracy``; ``.line()`` for the summary).
    """
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from tasks.tracking.store import Shielded

    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / "config.json").exists():
        raise FileNotFoundError(
            f"{checkpoint_dir} is not a save_pretrained directory (no config.json)"
        )
    if not any(checkpoint_dir.glob("*.safetensors")):
        raise FileNotFoundError(f"{checkpoint_dir}: no *.safetensors weights to register")
    # as every tracking call: a sqlite store's write is not cut by Ctrl-C (tasks/tracking/store.py)
    client = Shielded(MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri))
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
            description="R1 pipeline final checkpoints (Hugging Face directories). Alias "
            f"`{CHAMPION}`: the version with the best held-out accuracy (tag "
            f"`{ACCURACY_TAG}`); load it with `models:/{name}@{CHAMPION}`.",
        )
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    accuracy = flat.get(f"{final_stage}/eval/accuracy")
    tags = {
        "pipeline_run_id": parent_run_id,
        "run_name": run.info.run_name or "",
        "stage": final_stage,
        "format": "huggingface",
        "git_commit": run.data.tags.get("mlflow.source.git.commit", "unknown"),
        "policy_id": policy_id(checkpoint_dir),  # the weights' hash, verified
        **({"adapter": "adapter/"} if (checkpoint_dir / "adapter").is_dir() else {}),
        **{k: f"{v:.6g}" for k, v in flat.items()},
        **({ACCURACY_TAG: f"{accuracy:.6g}"} if accuracy is not None else {}),
    }
    version = client.create_model_version(
        name,
        source=f"{run.info.artifact_uri.rstrip('/')}/{ARTIFACT_PATH}",
        run_id=parent_run_id,
        tags=tags,
        description=_describe(run.info.run_name or parent_run_id, flat, final_stage, accuracy),
    )
    client.set_tag(parent_run_id, "registered_model", f"{name}/{version.version}")
    champion, champion_acc = _update_champion(client, name, str(version.version), accuracy)
    return Registered(version, accuracy, champion, champion_acc)

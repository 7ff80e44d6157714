"""The pipeline's configuration: the R1 recipe's stages, the whole-run ``PipelineConfig`` built
from the per-stage sections of ``grpo_core.config.stages``, and loading it from a YAML preset plus
``--set`` overrides.

The stage names are defined here once; flows, tests and benchmarks import them.
"""

from __future__ import annotations

import copy
import difflib
import os
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, PrivateAttr, ValidationError, model_validator

from cluster.config import ClusterConfig
from grpo_core.config.stages import (
    DataConfig,
    EvalConfig,
    ModelConfig,
    RejectionConfig,
    RLConfig,
    RolloutConfig,
    Section,
    SFTConfig,
)
from grpo_core.errors import UserError
from tasks.workspace import Workspace

# The R1 recipe in order: (stage, whether it writes a checkpoint that the final evaluation scores)
_STAGES = (
    ("cold_start_sft", True),
    ("rl_1", True),
    ("rejection_sampling", False),
    ("re_sft", True),
    ("rl_2", True),
    ("final_evaluation", False),
)
STAGE_NAMES = tuple(name for name, _ in _STAGES)
CHECKPOINT_STAGES = tuple(name for name, checkpoint in _STAGES if checkpoint)

DEFAULT_CONFIG = "demo.yaml"
DEFAULT_CRON = "0 2 * * *"  # the deployments' example schedule: nightly at 02:00, created paused


DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
TRACKING_ENV = "MLFLOW_TRACKING_URI"


class TrackingConfig(Section):
    """Where MLflow runs go. ``uri`` is resolved once, by :func:`load_config`, in this order:
    ``--set tracking.uri``, the user's config file, ``MLFLOW_TRACKING_URI``, the default
    (``sqlite:///mlflow.db``; the packaged presets' value counts as the default).
    ``uri_source`` says which one won."""

    uri: str = DEFAULT_TRACKING_URI
    experiment: str = "grpo-pipeline"
    _source: str = PrivateAttr("default")

    @property
    def uri_source(self) -> str:
        return self._source


def resolve_tracking_uri(
    raw: dict, overrides: list[str], *, packaged: bool, env: dict | None = None
) -> tuple[str | None, str]:
    """``(uri, source)``: the tracking URI to use and where it came from (``--set``, the
    config file, ``MLFLOW_TRACKING_URI``, the default). ``raw`` is the config file's mapping
    before overrides; a packaged preset's ``tracking.uri`` counts as the default. ``uri`` is
    None when the default applies and the preset names none."""
    env = os.environ if env is None else env
    for item in reversed(overrides):
        key, _, value = item.partition("=")
        if key.strip() == "tracking.uri":
            return str(_parse_value(value)), "--set tracking.uri"
        parsed = _parse_value(value) if key.strip() == "tracking" else None
        if isinstance(parsed, dict) and "uri" in parsed:
            return str(parsed["uri"]), "--set tracking"
    section = raw.get("tracking") if isinstance(raw.get("tracking"), dict) else {}
    if "uri" in section and not packaged:
        return str(section["uri"]), "config file"
    if env.get(TRACKING_ENV):
        return env[TRACKING_ENV], TRACKING_ENV
    return section.get("uri"), "default"


class SandboxConfig(Section):
    """Isolation of the rewards that execute model-written code (docs/rewards.md)."""

    isolation: Literal["auto", "bwrap", "namespaces", "none"] = Field(
        "auto",
        description="auto: bwrap, else built-in namespaces, else refuse; none only on purpose",
    )


class StorageConfig(Section):
    """Where the run folder is shared between machines (cluster/storage.py, docs/cluster.md).
    ``output_dir`` stays this machine's working copy."""

    url: str | None = Field(
        None,
        description="fsspec URL the run folder is mirrored to (file:///mnt/nfs/runs, "
        "s3://bucket/runs, memory://runs); empty: the run folder is not shared",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec storage options (e.g. endpoint_url for an S3-compatible server); "
        "keep credentials in the environment (AWS_ACCESS_KEY_ID, ...): config is logged",
    )


MAX_REWARD_WEIGHT = 1e6


class PipelineConfig(Section):
    """The whole R1 recipe. ``rl_2`` and ``re_sft`` hold overrides on top of ``rl``/``sft``."""

    run_name: str = "demo"
    seed: int = 0
    output_dir: str = "runs"
    torch_threads: int | None = Field(None, ge=1, description="torch threads (None: torch's)")
    force: list[str] = Field(
        default_factory=list,
        description="stages to rerun even when their inputs are unchanged ('all' for every stage)",
    )
    tracking: TrackingConfig = TrackingConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rewards: dict[str, float] = Field(default_factory=lambda: {"accuracy": 1.0, "format": 0.1})
    sandbox: SandboxConfig = SandboxConfig()
    rollout: RolloutConfig = RolloutConfig()
    sft: SFTConfig = SFTConfig()
    rl: RLConfig = RLConfig()
    rejection_sampling: RejectionConfig = RejectionConfig()
    re_sft: dict[str, Any] = Field(default_factory=dict)
    rl_2: dict[str, Any] = Field(default_factory=dict)
    eval: EvalConfig = EvalConfig()
    cluster: ClusterConfig = ClusterConfig()
    storage: StorageConfig = StorageConfig()

    @model_validator(mode="after")
    def _overrides_valid(self) -> PipelineConfig:
        self.sft_config()
        self.re_sft_config()
        self.rl_2_config()
        if not self.rewards:
            raise ValueError("rewards: at least one reward function is required")
        unknown = set(self.force) - {*STAGE_NAMES, "all"}
        if unknown:
            raise ValueError(
                f"force: unknown stage(s) {sorted(unknown)}; valid: {', '.join(STAGE_NAMES)}, all"
            )
        self._replicas_fit_the_engine()
        self._engine_process_gets_merged_weights()
        self._reward_weights_bounded()
        return self

    def _reward_weights_bounded(self) -> None:
        """A reward weight beyond ``MAX_REWARD_WEIGHT`` makes the weighted sum infinite in
        float32 for ordinary rewards: every advantage 0, a run that learns nothing."""
        tables = {"rewards": self.rewards}
        for stage, rl in (("rl", self.rl), ("rl_2", self.rl_2_config())):
            for it, weights in rl.reward_weights_from.items():
                tables[f"{stage}.reward_weights_from.{it}"] = weights
        for where, weights in tables.items():
            for name, w in weights.items():
                if not abs(w) <= MAX_REWARD_WEIGHT:
                    raise ValueError(
                        f"{where}.{name}: weight {w} is outside +-{MAX_REWARD_WEIGHT:g}: the "
                        "weighted reward would overflow and every advantage would be 0; scale "
                        "the weights down (only their ratios matter after normalisation)"
                    )

    def _engine_process_gets_merged_weights(self) -> None:
        """With ``async_level`` on one machine the engine process receives each policy's
        weights merged (cluster/engine_process.py): a vLLM there started for adapter sync
        would sample its base, not the policy the rollout file records."""
        overlaps = max(self.rl.async_level, self.rl_2_config().async_level) > 0
        if (
            overlaps
            and self.cluster.backend == "local"
            and self.rollout.engine == "vllm"
            and self.model.lora is not None
            and self.rollout.vllm.lora_sync == "adapter"
        ):
            raise ValueError(
                "rollout.vllm.lora_sync: adapter with rl.async_level > 0 on cluster.backend: "
                "local is not supported: the engine process receives each policy's weights "
                "merged, so its vLLM could not sample the adapter; use lora_sync: merged (or "
                "cluster.backend: ray, whose replicas load each checkpoint's adapter)"
            )

    def _replicas_fit_the_engine(self) -> None:
        """On Ray, a vLLM replica spans ``tensor_parallel_size`` GPUs: its actor must reserve
        that many (``cluster.rollout.num_gpus``), or vLLM fails at start inside the actor."""
        tp = self.rollout.vllm.tensor_parallel_size
        uses_vllm = "vllm" in (self.rollout.engine, self.eval.engine)
        if self.cluster.backend == "ray" and uses_vllm and self.cluster.rollout.num_gpus < tp:
            raise ValueError(
                f"cluster.rollout.num_gpus is {self.cluster.rollout.num_gpus}, but each vLLM "
                f"replica spans rollout.vllm.tensor_parallel_size = {tp} GPUs: set "
                f"cluster.rollout.num_gpus to {tp} or lower tensor_parallel_size"
            )

    def run_folder(self) -> Workspace:
        """This run's folder (``output_dir/run_name``), named only: flows/run_context.py
        creates it and points the shared store at it."""
        return Workspace(Path(self.output_dir) / self.run_name)

    def forced(self, stage: str) -> bool:
        return "all" in self.force or stage in self.force

    def sft_config(self) -> SFTConfig:
        """The cold start's settings: ``sft``, masking the tool's output when tools are on
        (:meth:`_tool_output_masked`)."""
        return self._tool_output_masked(self.sft, "sft")

    def re_sft_config(self) -> SFTConfig:
        try:
            cfg = SFTConfig(**{**self.sft.model_dump(), **self.re_sft})
        except ValidationError as e:
            raise ValueError(validation_message(e, SFTConfig, "re_sft")) from None
        return self._tool_output_masked(cfg, "re_sft")

    def _tool_output_masked(self, cfg: SFTConfig, where: str) -> SFTConfig:
        """With ``rollout.tools``, an SFT stage's traces hold the tool's output (the cold
        start's, and every rejection-sampled episode's): it is context, never a target. An
        empty ``mask_spans`` becomes the tool's result markers; one that leaves them out is
        refused (the stage would train the model to write what the tool printed)."""
        if not self.rollout.environment:
            return cfg
        span = (self.rollout.tool_result_start, self.rollout.tool_result_end)
        if not cfg.mask_spans:
            return cfg.model_copy(update={"mask_spans": [span]})
        if span not in [tuple(s) for s in cfg.mask_spans]:
            raise ValueError(
                f"{where}.mask_spans: {[list(s) for s in cfg.mask_spans]} does not mask the "
                f"tool's output {list(span)} (rollout.tool_result_start, "
                f"rollout.tool_result_end): {where} would train the model to write what the "
                "tool printed; add that pair, or leave mask_spans empty (with rollout.tools "
                "it is the tool's result markers)"
            )
        return cfg

    def rl_2_config(self) -> RLConfig:
        try:
            return RLConfig(**{**self.rl.model_dump(), **self.rl_2})
        except ValidationError as e:
            raise ValueError(validation_message(e, RLConfig, "rl_2")) from None


def default_config_path() -> Path:
    return Path(str(resources.files("configs") / DEFAULT_CONFIG))


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key given twice in one mapping (PyYAML keeps the
    last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found the key {key!r} twice (first on line {seen[key] + 1})",
                    key_node.start_mark,
                )  # fmt: skip
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """``line L, column C: <problem>`` of a YAML syntax error, on one line."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}"


def _parse_value(text: str) -> Any:
    return yaml.safe_load(text) if text != "" else ""


def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The section model that ``loc`` (a pydantic error location) points into, or None."""
    for part in loc:
        field = model.model_fields.get(str(part))
        ann = field.annotation if field is not None else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def validation_message(e: ValidationError, model: type[BaseModel], prefix: str = "") -> str:
    """A pydantic error as one line: ``section.key: what is wrong (got value)`` per error,
    with the valid keys (and the closest one) for an unknown key."""
    parts = []
    for err in e.errors():
        loc = tuple(err.get("loc", ()))
        where = ".".join(str(p) for p in ((prefix,) if prefix else ()) + loc)
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            section = _model_at(model, loc[:-1])
            valid = sorted(section.model_fields) if section else []
            close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
            if close:
                msg = f"unknown key; did you mean {close[0]!r}?"
            else:
                msg = f"unknown key; valid keys: {', '.join(valid)}" if valid else "unknown key"
        elif "input" in err and err.get("type") not in (
            "missing",
            "value_error",
            "assertion_error",
        ):
            got = repr(err["input"])
            msg += f" (got {got[:60] + '...' if len(got) > 60 else got})"
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(" ".join(p.split()) for p in parts)


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` overrides (value parsed as YAML) to a nested dict, in order."""
    out = copy.deepcopy(raw)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r}: expected KEY=VALUE, e.g. rl.learning_rate=1e-5")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        try:
            parsed = _parse_value(value)
        except yaml.YAMLError as e:
            raise UserError(
                f"override {item!r}: the value is not valid YAML ({_yaml_problem(e)}); quote it, "
                f"e.g. --set {key.strip()}='\"...\"'"
            ) from None
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {p!r} is not a section")
        node[parts[-1]] = parsed
    return out


def _override_of(e: ValidationError, message: str, overrides: list[str]) -> str | None:
    """``--set key=value`` when the first invalid field is one an override set, so the
    message does not blame the YAML file for a value typed on the command line."""
    errors = e.errors()
    loc = ".".join(str(x) for x in errors[0].get("loc", ())) if errors else ""
    loc = loc or message.split(":", 1)[0].strip()  # a section's own validator: no loc
    for ov in reversed(overrides):  # the last override of a key is the one that counts
        key = ov.split("=", 1)[0].strip()
        if key == loc or loc.startswith(key + ".") or key.startswith(loc + "."):
            return f"--set {ov}"
    return None


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None
) -> PipelineConfig:
    """Read a YAML preset (the packaged demo by default), apply overrides, validate."""
    path = Path(path) if path else default_config_path()
    packaged = path.resolve().parent == default_config_path().resolve().parent
    if not path.exists():
        raise FileNotFoundError(f"config file {path} does not exist")
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as e:
        raise UserError(f"{path}, {_yaml_problem(e)} (YAML syntax); fix the file there") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read the config file ({e})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    file_raw, raw = raw, apply_overrides(raw, overrides or [])  # overrides checked here
    uri, source = resolve_tracking_uri(file_raw, overrides or [], packaged=packaged)
    if uri is not None and isinstance(raw.get("tracking", {}), dict):
        raw["tracking"] = {**raw.get("tracking", {}), "uri": uri}
    try:
        cfg = PipelineConfig(**raw)
    except ValidationError as e:
        message = validation_message(e, PipelineConfig)
        where = _override_of(e, message, overrides or []) or str(path)
        raise UserError(f"{where}: {message}") from None
    cfg.tracking._source = source
    return cfg

import os
import warnings
from pathlib import Path

import pytest

from flows.config import (
    CHECKPOINT_STAGES,
    STAGE_NAMES,
    PipelineConfig,
    default_config_path,
    load_config,
)
from flows.env import apply_defaults
from grpo_core.config import RLConfig

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))


def test_packaged_default_is_demo_yaml():
    assert default_config_path().name == "demo.yaml"
    assert default_config_path().exists()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_preset_loads_and_validates(path):
    cfg = load_config(path)
    assert isinstance(cfg, PipelineConfig)
    cfg.rl_2_config()
    cfg.re_sft_config()


def test_unknown_key_is_rejected_by_name(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("rl:\n  learning_rat: 1.0e-5\n")
    with pytest.raises(ValueError, match="learning_rat"):
        load_config(p)


def test_dotted_overrides_are_parsed_as_yaml():
    cfg = load_config(
        None, ["rl.learning_rate=1e-5", "rl.loss_type=grpo", "rewards={accuracy: 2.0}"]
    )
    assert cfg.rl.learning_rate == 1e-5
    assert cfg.rl.loss_type == "grpo"
    assert cfg.rewards == {"accuracy": 2.0}


def test_bad_override_value_names_the_field():
    with pytest.raises(ValueError, match="loss_type"):
        load_config(None, ["rl.loss_type=ppo"])
    with pytest.raises(ValueError, match="KEY=VALUE"):
        load_config(None, ["rl.learning_rate"])


def test_rl_2_overrides_are_validated():
    with pytest.raises(ValueError, match="rl_2"):
        load_config(None, ["rl_2={num_generations: 1}"])
    cfg = load_config(None, ["rl_2={iterations: 3, learning_rate: 5e-5}"])
    assert cfg.rl_2_config().iterations == 3
    assert cfg.rl_2_config().num_generations == cfg.rl.num_generations


def test_steps_per_generation_must_split_whole_groups():
    with pytest.raises(ValueError, match="divisible"):
        load_config(None, ["rl.prompts_per_iteration=10", "rl.steps_per_generation=4"])


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_force_names_come_from_the_one_stage_list():
    cfg = load_config(None, [f"force={list(STAGE_NAMES)}"])
    assert all(cfg.forced(s) for s in STAGE_NAMES)
    assert set(CHECKPOINT_STAGES) < set(STAGE_NAMES)
    with pytest.raises(ValueError, match="unknown stage"):
        load_config(None, ["force=[rl_3]"])


def test_cispo_requires_epsilon_high_and_names_the_recommended_value():
    with pytest.raises(ValueError, match=r"epsilon_high=5\.0"):
        load_config(None, ["rl.objective=cispo"])
    with pytest.raises(ValueError, match="rl_2"):  # the rl_2 overrides are checked the same way
        load_config(None, ["rl_2={objective: cispo}"])
    cfg = load_config(None, ["rl.objective=cispo", "rl.epsilon_high=5.0"])
    assert cfg.rl.epsilon_high == 5.0
    assert RLConfig(objective="clip").epsilon_high is None  # clip keeps epsilon_high optional


@pytest.mark.parametrize(
    "knob", [{"top_p": 0.9}, {"top_k": 8}, {"min_p": 0.05}, {"repetition_penalty": 1.1}]
)
def test_engine_is_correction_with_processed_sampling_warns(knob):
    name = next(iter(knob))
    with pytest.warns(UserWarning, match=f"{name}=.*< 1 on every token"):
        RLConfig(vllm_importance_sampling_correction=True, **knob)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RLConfig(**knob)  # no correction: nothing to warn about
        RLConfig(vllm_importance_sampling_correction=True)  # full distribution


def test_env_defaults_do_not_override_user_settings(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    for key in (
        "HF_HOME",
        "HF_HUB_DISABLE_PROGRESS_BARS",
        "TRANSFORMERS_VERBOSITY",
        "PREFECT_LOGGING_EXTRA_LOGGERS",
    ):
        monkeypatch.delenv(key, raising=False)  # restored (or unset again) after the test
    apply_defaults(tmp_path, flow_logs=False)
    assert os.environ["HF_HUB_OFFLINE"] == "0"
    assert os.environ["MLFLOW_DISABLE_TELEMETRY"] == "true"
    assert os.environ["HF_HOME"] == str(tmp_path.resolve() / ".hf_home")
    assert "PREFECT_LOGGING_EXTRA_LOGGERS" not in os.environ

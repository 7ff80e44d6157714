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
from grpo_core.config.stages import RLConfig
from grpo_core.errors import UserError

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


def test_a_bad_set_value_is_blamed_on_the_set_not_the_file(tmp_path):
    with pytest.raises(UserError) as e:
        load_config(None, ["rl.learning_rate=abc"])
    assert str(e.value).startswith("--set rl.learning_rate=abc: rl.learning_rate:")
    with pytest.raises(UserError) as e:
        load_config(None, ["rl_2={iterations: -1}"])
    assert str(e.value).startswith("--set rl_2={iterations: -1}: rl_2.iterations")
    mine = tmp_path / "mine.yaml"
    mine.write_text("rl:\n  learning_rate: abc\n")
    with pytest.raises(UserError, match=r"mine\.yaml: rl\.learning_rate"):  # from the file
        load_config(mine, ["rl.iterations=3"])


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


GPU_PRESETS = {"gpu.yaml": ("bfloat16", "gsm8k"), "gpu-code.yaml": ("bfloat16", None)}


@pytest.mark.parametrize("name", sorted(GPU_PRESETS))
def test_gpu_presets_validate_and_build_their_engines_settings(name):
    """configs/gpu*.yaml as written: vLLM rollouts, every rollout.vllm knob reaching the
    arguments vllm.LLM gets (built without importing vllm or needing a GPU)."""
    from grpo_core.engines.vllm_engine import llm_options

    cfg = load_config(Path(__file__).parents[2] / "configs" / name)
    dtype, preset = GPU_PRESETS[name]
    assert cfg.rollout.engine == "vllm" and cfg.data.preset == preset
    spec = cfg.rollout.engine_spec()
    assert spec.name == "vllm"
    for stage_engine in (cfg.eval.engine, cfg.rejection_sampling.engine):
        assert cfg.rollout.engine_spec(stage_engine).name == "vllm"
    opts = llm_options("/ckpt", device="cuda", **spec.options)
    v = cfg.rollout.vllm
    assert opts.llm_kwargs == {
        "model": "/ckpt",
        "dtype": dtype,
        "seed": 0,
        "max_model_len": v.max_model_len,
        "max_num_seqs": v.max_num_seqs,
        "gpu_memory_utilization": v.gpu_memory_utilization,
        "tensor_parallel_size": 1,
        "enable_sleep_mode": True,
        "enforce_eager": False,
        "enable_prefix_caching": True,
        "logprobs_mode": "processed_logprobs",
        "distributed_executor_backend": "uni",
    }
    assert opts.env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert v.max_model_len >= cfg.rl.max_completion_length
    # every field of the section reaches the builder (a new knob must be wired, not dropped)
    assert set(spec.options) == set(type(v).model_fields)


def test_vllm_settings_on_cpu_and_with_several_gpus():
    from grpo_core.config.stages import VLLMConfig
    from grpo_core.engines.vllm_engine import llm_options

    cpu = llm_options("/c", device="cpu", **VLLMConfig(cpu_threads=3).model_dump())
    assert cpu.llm_kwargs["kv_cache_memory_bytes"] == 1 << 30 and cpu.env["OMP_NUM_THREADS"] == "3"
    assert cpu.llm_kwargs["enable_chunked_prefill"] is False  # CPU generators cannot rewind
    tp = llm_options("/c", device="cuda", **VLLMConfig(tensor_parallel_size=2).model_dump())
    assert tp.llm_kwargs["distributed_executor_backend"] == "mp"
    assert (
        "kv_cache_memory_bytes" not in tp.llm_kwargs
        and "enable_chunked_prefill" not in tp.llm_kwargs
    )


def test_ray_replicas_must_reserve_the_engines_tensor_parallel_gpus():
    ray_tp2 = ["cluster.backend=ray", "rollout.engine=vllm", "rollout.vllm.tensor_parallel_size=2"]
    with pytest.raises(ValueError, match="cluster.rollout.num_gpus is 0.0, but each vLLM"):
        load_config(None, ray_tp2)
    cfg = load_config(None, [*ray_tp2, "cluster.rollout={workers: 1, num_gpus: 2}"])
    assert cfg.cluster.rollout.num_gpus == 2


def test_smollm2_preset_runs_the_recipe_on_generated_word_problems():
    cfg = load_config(Path(__file__).parents[2] / "configs" / "smollm2-cpu.yaml")
    assert cfg.model.source == "path" and cfg.model.path == "models/smollm2-135m-instruct"
    assert cfg.data.source == "word_problems" and cfg.data.system_prompt
    assert cfg.rl.max_completion_length <= 64 and cfg.rollout.engine == "hf"


def test_ignored_loss_knobs_are_refused_or_warned():
    with pytest.raises(ValueError, match="rl.delta and rl.clip_ratio_c with rl.objective='cispo'"):
        RLConfig(objective="cispo", epsilon_high=5.0, delta=2.0, clip_ratio_c=3.0)
    with pytest.warns(UserWarning, match="GSPO.*loss_type='dapo'"):
        RLConfig(importance_sampling_level="sequence", loss_type="dapo")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RLConfig(importance_sampling_level="sequence", loss_type="grpo")


def test_typed_settings_carry_the_section_values():
    from grpo_core.config.stages import SFTConfig
    from grpo_core.engines.generation import SamplingParams

    rl = RLConfig(
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        min_p=0.05,
        repetition_penalty=1.1,
        stop=["</answer>"],
        max_completion_length=64,
        learning_rate=3e-5,
        lr_scheduler_type="cosine",
        warmup_steps=3,
        weight_decay=0.1,
        max_grad_norm=0.5,
        overlong_buffer_length=8,
        overlong_penalty_factor=0.5,
        scale_rewards="batch",
    )
    assert rl.sampling.params(4, seed=7) == SamplingParams(
        n=4,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        min_p=0.05,
        repetition_penalty=1.1,
        stop=("</answer>",),
        max_new_tokens=64,
        seed=7,
    )
    opt = rl.optimization
    assert (opt.optim, opt.learning_rate, opt.lr_scheduler_type) == ("adamw_torch", 3e-5, "cosine")
    assert (opt.warmup_steps, opt.weight_decay, opt.max_grad_norm) == (3, 0.1, 0.5)
    scoring = rl.scoring
    assert (scoring.overlong_buffer_length, scoring.overlong_penalty_factor) == (8, 0.5)
    assert (scoring.scale_rewards, scoring.max_completion_length) == ("batch", 64)
    sft = SFTConfig(max_steps=7, learning_rate=1e-3, warmup_steps=2, bf16=True).training
    assert (sft.max_steps, sft.learning_rate, sft.bf16, sft.checkpoint_every) == (
        7,
        1e-3,
        True,
        100,
    )
    assert sft.optimization.lr_scheduler_type == "constant"  # SFT has no schedule key


def test_cache_keys_name_the_same_settings():
    """The rollout and score keys hold these names (docs/architecture.md, "Cache keys"):
    renaming a field of Sampling or Scoring would rerun every finished stage."""
    import dataclasses

    rl = RLConfig()
    assert sorted(dataclasses.asdict(rl.sampling)) == sorted(
        ["temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop"]
        + ["max_completion_length"]
    )
    assert sorted(dataclasses.asdict(rl.scoring)) == sorted(
        ["advantage_estimator", "scale_rewards", "multi_objective_aggregation"]
        + ["overlong_buffer_length", "overlong_penalty_factor", "max_completion_length"]
    )


def test_settings_or_keywords_not_both():
    from grpo_core.config.settings import Scoring, settings_or_knobs

    assert settings_or_knobs(Scoring, None, {"scale_rewards": "none"}).scale_rewards == "none"
    with pytest.raises(ValueError, match="not both"):
        settings_or_knobs(Scoring, Scoring(), {"scale_rewards": "none"})


def test_async_vllm_adapter_sync_on_one_machine_is_refused():
    """The engine process gets merged weights: its vLLM cannot sample an adapter (issue 41)."""
    from flows.config import load_config

    sets = ["rl.async_level=1", "rollout.engine=vllm", "model.lora={r: 8, alpha: 16}",
            "rollout.vllm.lora_sync=adapter"]  # fmt: skip
    with pytest.raises(Exception, match="lora_sync: merged"):
        load_config(None, sets)
    load_config(None, [*sets[:3], "rollout.vllm.lora_sync=merged"])  # merged: fine
    load_config(None, [*sets[1:]])  # on-policy: the adapter is synced in this process


def test_trls_max_tool_calling_iterations_is_read_as_max_turns():
    cfg = load_config(None, ["rollout.tools=[python]", "rollout.max_tool_calling_iterations=2"])
    assert cfg.rollout.max_turns == 3  # two calls, then the answering turn
    assert cfg.rollout.tool_spec().max_turns == 3
    with pytest.raises(UserError, match="max_tool_calling_iterations 2 and max_turns 5 disagree"):
        load_config(None, ["rollout.max_tool_calling_iterations=2", "rollout.max_turns=5"])
    with pytest.raises(UserError, match="max_tool_calling_iterations -1: a number of tool calls"):
        load_config(None, ["rollout.max_tool_calling_iterations=-1"])


def test_engine_and_environment_names_are_checked_by_their_registries():
    """A typo in an engine name is refused when the config loads, naming the registered
    engines; an engine registered by the user is accepted (the same registry the engines
    are made from)."""
    from grpo_core.config.engine import ENGINES, ENVIRONMENTS, EngineSpec

    with pytest.raises(
        UserError, match=r"'vlm' is not a rollout engine; expected one of \['hf', 'vllm'\]"
    ):
        load_config(None, ["rollout.engine=vlm"])
    with pytest.raises(UserError, match="not a rollout engine"):
        load_config(None, ["eval.engine=hff"])
    ENGINES.add("mine", "grpo_core.engines:make_hf")
    try:
        cfg = load_config(None, ["rollout.engine=mine"])
        spec = cfg.rollout.engine_spec()
        assert isinstance(spec, EngineSpec) and spec.name == "mine"
    finally:
        ENGINES.remove("mine")
    assert ENVIRONMENTS.names() == ["factory", "functions", "python"]
    cfg = load_config(None, ["rollout.tools=[python]", "rollout.max_turns=3"])
    spec = cfg.rollout.engine_spec()
    # one typed value, the environment's knobs under one set of names; as plain data for the
    # stage keys exactly the dict they always took
    assert spec.tools.max_turns == 3 and spec.settings()["tools"] == spec.tools.as_dict()
    assert EngineSpec.of(spec.settings()) == spec

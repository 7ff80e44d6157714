"""benchmarks/gpu_check.py, the script a GPU machine runs first: every leg's settings are
valid for configs/gpu.yaml (a typo there would cost a GPU session), and its table reads a
real run's MLflow store."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from flows.config import load_config

REPO = Path(__file__).resolve().parents[2]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks/gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("leg", ["vllm-fp32-sync", "vllm-bf16-sleep", "lora-vllm"])
def test_every_leg_is_a_valid_gpu_preset(leg, tmp_path):
    gc = _gpu_check()
    sets = gc.run_overrides(leg, tmp_path, tmp_path / "model", tmp_path / "data")
    cfg = load_config(REPO / "configs/gpu.yaml", sets)
    assert cfg.rollout.engine == "vllm" and cfg.rl.iterations == 2
    if leg == "vllm-fp32-sync":
        assert cfg.rollout.check_sync and cfg.rollout.vllm.dtype == "float32" and not cfg.rl.bf16
    if leg == "vllm-bf16-sleep":
        assert cfg.rollout.vllm.enable_sleep_mode and cfg.rollout.vllm.offload_optimizer
    if leg == "lora-vllm":
        assert cfg.model.lora is not None and cfg.model.lora.r == 16


def test_the_table_reads_a_runs_stage_numbers(tmp_path):
    import mlflow

    gc = _gpu_check()
    uri = f"sqlite:///{tmp_path / 'leg.db'}"
    client = mlflow.MlflowClient(uri)
    exp = client.create_experiment("grpo-gpu")
    for name, metrics in {
        "rl_1 (leg)": {"train/more/peak_memory_gib": 3.5, "train/rollout/tokens_per_s": 900.0,
                       "train/timing/update_s": 2.0},
        "rl_1 it 0-4 (leg)": {"train/more/peak_memory_gib": 99.0},
        "cold_start_sft (leg)": {"peak_memory_gib": 2.5},
    }.items():  # fmt: skip
        run = client.create_run(exp, run_name=name)
        for k, v in metrics.items():
            client.log_metric(run.info.run_id, k, v)
    numbers = gc.stage_numbers(tmp_path / "leg.db")
    assert numbers == {
        "rl_1": {"peak_gib": 3.5, "rollout_tok_s": 900.0, "update_s": 2.0},
        "cold_start_sft": {"peak_gib": 2.5, "rollout_tok_s": None, "update_s": None},
    }
    text = gc.table([{"leg": "leg", "stage": "rl_1", "rc": 0, "wall_s": 12.0, **numbers["rl_1"]}])
    assert "| leg | rl_1 | 0 | 12.0 | 3.50 | 900 | 2.00 |" in text

"""benchmarks/gpu_check.py, the script a GPU machine runs first: every `grpo run` leg's
settings load as a valid config (a typo there would cost a GPU session), the legs it cannot
run say why, and its table reads a real run's MLflow store."""

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


GC = _gpu_check()


@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
@pytest.mark.parametrize("leg", list(GC.LEGS))
def test_every_run_leg_is_a_valid_config(leg, quick, tmp_path):
    sets = GC.run_overrides(leg, tmp_path, quick)
    cfg = load_config(REPO / GC.CONFIG, sets)
    assert cfg.model.source == "demo" and cfg.model.device == "auto"
    assert cfg.output_dir == str(tmp_path / leg) and cfg.run_name == leg
    # the whole recipe runs: held-out evals in rl_1, rejection sampling, re-SFT, rl_2
    assert cfg.rl.iterations == 2 and cfg.rl.eval_every == 1
    assert cfg.rejection_sampling.num_prompts > 0 and cfg.re_sft["max_steps"] > 0
    assert cfg.rl_2["iterations"] >= cfg.rl.async_level
    assert cfg.sft.target_accuracy is None and cfg.sft.min_steps == 0
    expected = {
        "bf16": lambda: cfg.rl.bf16 and cfg.sft.bf16,
        "fp16": lambda: cfg.rl.fp16 and cfg.sft.fp16,
        "lora": lambda: cfg.model.lora.r == 8 and cfg.model.lora.alpha == 16,
        "qlora": lambda: cfg.model.load_in_4bit and cfg.model.lora is not None,
        "grad-ckpt": lambda: cfg.model.gradient_checkpointing,
        "token-budget": lambda: (
            cfg.rl.max_tokens_per_microbatch == 256 and cfg.sft.max_tokens_per_microbatch == 256
        ),
        "async-1": lambda: cfg.rl.async_level == 1,
        "async-2": lambda: cfg.rl.async_level == 2,
        "vllm-fp32-sync": lambda: cfg.rollout.check_sync and cfg.rollout.vllm.dtype == "float32",
        "vllm-bf16-offload": lambda: cfg.rollout.vllm.offload_optimizer and cfg.rl.bf16,
        "lora-vllm-adapter": lambda: cfg.rollout.vllm.lora_sync == "adapter",
    }
    assert expected.get(leg, lambda: True)()
    assert (cfg.rollout.engine == "vllm") == ("vllm" in leg)


def test_legs_that_cannot_run_here_say_why(monkeypatch):
    monkeypatch.setattr(GC, "_gpus", lambda: 0)
    monkeypatch.setattr(GC, "_imports", lambda module: False)
    assert GC.skip_reason("fp16") == "skipped: no CUDA"
    assert GC.skip_reason("vllm-fp32-sync") == "skipped: vllm does not import"
    assert GC.skip_reason("fsdp-2gpu") == "skipped: 0 GPU(s), needs 2"
    assert GC.skip_reason("vs-trl-0.4b") == "skipped: trl does not import"
    assert GC.skip_reason("fp32") is None and GC.skip_reason("fsdp-1gpu") is None
    monkeypatch.setattr(GC, "_gpus", lambda: 1)
    assert GC.skip_reason("qlora") == "skipped: bitsandbytes does not import"


def test_the_plan_lists_every_leg(capsys, tmp_path):
    assert GC.main(["--plan", "--out", str(tmp_path)]) == 0
    legs = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert legs == [*GC.LEGS, *GC.OTHER]


def test_the_table_reads_a_runs_stage_numbers(tmp_path):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'leg.db'}"
    client = mlflow.MlflowClient(uri)
    exp = client.create_experiment("grpo-demo")
    for name, metrics in {
        "rl_1 (leg)": {"train/more/peak_memory_gib": 3.5, "train/rollout/tokens_per_s": 900.0,
                       "train/timing/update_s": 2.0, "train/completions/mean_length": 25.0},
        "rl_1 it 0-4 (leg)": {"train/more/peak_memory_gib": 99.0},
        "cold_start_sft (leg)": {"peak_memory_gib": 2.5},
    }.items():  # fmt: skip
        run = client.create_run(exp, run_name=name)
        for k, v in metrics.items():
            client.log_metric(run.info.run_id, k, v)
        if name.startswith("rl_1 ("):
            client.log_param(run.info.run_id, "prompts_per_iteration", 16)
            client.log_param(run.info.run_id, "num_generations", 4)
    numbers = GC.stage_numbers(tmp_path / "leg.db")
    assert numbers == {
        # 25 tokens x 16 prompts x 4 samples per 2 s update
        "rl_1": {"peak_gib": 3.5, "rollout_tok_s": 900.0, "update_s": 2.0, "update_tok_s": 800.0},
        "cold_start_sft": {"peak_gib": 2.5, "rollout_tok_s": None, "update_s": None},
    }
    rows = [{"leg": "leg", "stage": "rl_1", "rc": 0, "wall_s": 12.0, **numbers["rl_1"]},
            {"leg": "probe-0.4b", "stage": "update", "wall_s": 1.5, "bf16_share": 0.25},
            {"leg": "fp16", "stage": "skipped: no CUDA", "rc": None}]  # fmt: skip
    text = GC.table(rows)
    assert "| leg | rl_1 | 0 | 12.0 | 3.50 | 900 | 800 | - |" in text
    assert "| probe-0.4b | update | - | 1.5 | - | - | - | 25.0% |" in text
    assert "| fp16 | skipped: no CUDA | - | - | - | - | - | - |" in text


def test_all_logs_keeps_the_tail_of_every_log(tmp_path):
    (tmp_path / "a.log").write_text("".join(f"line {i}\n" for i in range(100)))
    (tmp_path / "b.log").write_text("progress 1\rprogress 2\rdone\n")
    text = GC.all_logs(tmp_path, ["a", "b", "c"], lines=3)
    assert "===== a (last 3 lines of a.log) =====\nline 97\nline 98\nline 99" in text
    assert "progress 2\ndone" in text and "===== c" in text and "(no log)" in text

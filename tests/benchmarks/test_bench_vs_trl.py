"""benchmarks/bench_vs_trl.py: its arguments, the overrides both sides get, the table, and
the GRPOConfig it gives TRL (when TRL is installed: the `bench` extra). No timings."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _module(name: str):
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


bench = _module("bench_vs_trl")


def row(side: str, seed: int, wall: float, other: float, acc: float) -> dict:
    return {
        "side": side,
        "seed": seed,
        "wall_s": wall,
        "generation_s": 10.0,
        "score_s": 1.0,
        "update_s": wall - other - 11.0,
        "other_s": other,
        "completion_tokens": 5000,
        "trained_tokens": 5000,
        "peak_rss_mib": 800.0,
        "accuracy": acc,
        "eval_rows": 200,
    }


def test_the_workload_flags_become_config_overrides():
    args = bench.parse_args(
        ["--iterations", "2", "--prompts", "4", "--eval-rows", "10", "--set", "rl.beta=0.0"]
    )
    assert bench.overrides(args, 3) == [
        "seed=3",
        "rl.iterations=2",
        "rl.prompts_per_iteration=4",
        "eval.num_examples=10",
        "rl.beta=0.0",
    ]
    model = bench.parse_args(["--model", "some/dir"])
    assert "model.source=path" in bench.overrides(model, 0)
    assert bench.parse_args([]).seeds == [0]


def test_a_budget_below_one_or_a_missing_config_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--iterations", "0"])
    assert "--iterations must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--config", "no/such.yaml"])
    assert "no/such.yaml: no such file" in capsys.readouterr().err


def test_the_table_gives_the_ratio_and_our_orchestration_share():
    rows = [row("ours", 0, 40.0, 2.0, 0.85), row("trl", 0, 60.0, 0.5, 0.84)]
    rows[0]["eval_s"] = 1.5  # our stage's in-loop evals, part of its other time
    text = bench.table(rows)
    lines = text.splitlines()
    assert lines[0].startswith("| side | seed | wall s |")
    assert lines[2].startswith(
        "| ours | 0 | 40.0 | 10.0 | 27.0 + 1.0 | 2.0 (5.0%; evals 1.5) | 500 |"
    )
    assert "| 0.5 (0.8%; evals 0.0) |" in lines[3]  # TRL: no eval inside train()
    assert lines[3].endswith("| 84.0% (200) | 1.50 |")  # TRL wall / our wall of its seed
    assert "orchestration share 5.0%" in text
    assert "TRL wall / our wall: 1.50x" in text


def test_trl_gets_the_config_rl_knobs_under_its_names(tmp_path):
    pytest.importorskip("trl")
    from flows.config import load_config

    trl_side = _module("_trl_side")
    cfg = load_config(None, ["rl.iterations=3", "rl.prompts_per_iteration=4"])
    args = trl_side.grpo_config(cfg, str(tmp_path))
    assert args.generation_batch_size == 4 * cfg.rl.num_generations
    assert args.per_device_train_batch_size == 32 // cfg.rl.steps_per_generation
    assert args.max_steps == 3 * cfg.rl.steps_per_generation
    assert (args.loss_type, args.beta, args.learning_rate) == (
        cfg.rl.loss_type,
        cfg.rl.beta,
        cfg.rl.learning_rate,
    )
    assert args.gradient_checkpointing is False and args.shuffle_dataset is False
    assert args.reward_weights == list(cfg.rewards.values())

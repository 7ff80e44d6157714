"""Each stage task on its own (``task.fn``: the body without the engine), with real files,
a real tiny model and a real MLflow sqlite store."""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from grpo_core.checkpoint import policy_id
from grpo_core.config import EvalConfig, RejectionConfig, RLConfig, SFTConfig
from grpo_core.demo.task import make_splits
from grpo_core.io import write_jsonl
from tasks import warm
from tasks.evaluate import evaluate_stage
from tasks.rejection import rejection_sampling
from tasks.rollout import rollout
from tasks.score import score
from tasks.sft import sft_stage
from tasks.tracking import Tracking
from tasks.update import update


@pytest.fixture
def data(tmp_path):
    s = make_splits(0, n_sft=32, n_rl=32, n_dev=4, n_eval=8)
    return {
        k: str(write_jsonl(getattr(s, k), tmp_path / f"{k}.jsonl"))
        for k in ("sft", "rl", "dev", "eval")
    }


@pytest.fixture
def tracking(tracking_uri):
    return Tracking.open(tracking_uri, "tests").start_parent("t", {})


def test_sft_task_writes_checkpoint_and_child_run(tiny_checkpoint, data, tmp_path, tracking):
    out = sft_stage.fn(
        "cold_start_sft",
        str(tiny_checkpoint),
        data["sft"],
        str(tmp_path / "sft"),
        SFTConfig(max_steps=12, batch_size=8, eval_every=5),
        tracking,
    )
    assert out["steps"] == 12
    assert policy_id(out["checkpoint"]) != policy_id(tiny_checkpoint)
    run = MlflowClient(tracking.uri).get_run(out["run_id"])
    assert run.data.tags["stage"] == "cold_start_sft"
    assert run.data.tags["mlflow.parentRunId"] == tracking.parent_run_id
    assert run.data.params["learning_rate"] == "0.003"
    assert "loss" in run.data.metrics


def test_rl_iteration_tasks_chain_through_files(tiny_checkpoint, data, tmp_path):
    rl = RLConfig(
        prompts_per_iteration=4, num_generations=4, steps_per_generation=2, max_completion_length=12
    )
    knobs = rl.model_dump()
    warm.clear()
    loads = warm.STATS["loads"]
    roll = rollout.fn(
        "rl_1", 0, str(tiny_checkpoint), data["rl"], str(tmp_path / "r.parquet"), knobs, 0
    )
    sc = score.fn(
        "rl_1",
        0,
        roll["path"],
        str(tmp_path / "s.parquet"),
        {"accuracy": 1.0, "format": 0.1},
        knobs,
    )
    up = update.fn("rl_1", 0, str(tiny_checkpoint), sc["path"], str(tmp_path / "ckpt"), knobs)
    assert pq.read_table(roll["path"]).num_rows == 16
    assert len(up["history"]) == 2 and up["global_step"] == 2
    assert warm.STATS["loads"] == loads + 1  # loaded once, then warm from rollout to update
    # the next rollout asks for the new checkpoint: still no load from disk
    rollout.fn("rl_1", 1, up["checkpoint"], data["rl"], str(tmp_path / "r1.parquet"), knobs, 0)
    assert warm.STATS["loads"] == loads + 1
    state = json.loads((tmp_path / "ckpt" / "checkpoint_info.json").read_text())
    assert state["global_step"] == 2


def test_update_from_a_scored_file_of_another_run_loads_from_disk(tiny_checkpoint, data, tmp_path):
    rl = RLConfig(
        prompts_per_iteration=2, num_generations=2, steps_per_generation=1, max_completion_length=8
    )
    knobs = rl.model_dump()
    roll = rollout.fn(
        "rl_1", 0, str(tiny_checkpoint), data["rl"], str(tmp_path / "r.parquet"), knobs, 0
    )
    sc = score.fn("rl_1", 0, roll["path"], str(tmp_path / "s.parquet"), {"format": 1.0}, knobs)
    warm.clear()
    loads = warm.STATS["loads"]
    up = update.fn("offline", 0, str(tiny_checkpoint), sc["path"], str(tmp_path / "ckpt"), knobs)
    assert warm.STATS["loads"] == loads + 1
    assert (tmp_path / "ckpt" / "trainer_state.pt").exists()
    assert up["history"][0]["learning_rate"] == pytest.approx(rl.learning_rate)


def test_eval_task_writes_the_table(tiny_checkpoint, data, tmp_path):
    out = evaluate_stage.fn(
        "rl_1",
        str(tiny_checkpoint),
        data["eval"],
        EvalConfig(max_completion_length=8),
        str(tmp_path / "eval.parquet"),
    )
    assert 0.0 <= out["accuracy"] <= 1.0
    t = pq.read_table(tmp_path / "eval.parquet")
    assert t.num_rows == 8
    assert {"prompt", "completion", "answer", "correct", "formatted", "length"} <= set(
        t.column_names
    )


def test_rejection_sampling_keeps_only_passing_completions(
    tiny_checkpoint, data, tmp_path, tracking
):
    cfg = RejectionConfig(
        num_prompts=8, num_generations=4, max_completion_length=8, require=[], min_reward=0.0
    )
    out = rejection_sampling.fn(
        str(tiny_checkpoint), data["rl"], str(tmp_path / "rs"), cfg, {"format": 1.0}, tracking, 0
    )
    rows = [json.loads(line) for line in Path(out["path"]).read_text().splitlines()]
    assert 0 < len(rows) <= 8 * 2  # max_per_prompt = 2
    assert all(set(r) >= {"prompt", "completion", "answer"} for r in rows)
    assert not any(k.startswith(("reward", "error_")) for r in rows for k in r)
    strict = RejectionConfig(
        num_prompts=8, num_generations=2, max_completion_length=8, require=["accuracy"]
    )
    with pytest.raises(RuntimeError, match="kept no completion"):
        rejection_sampling.fn(
            str(tiny_checkpoint),
            data["rl"],
            str(tmp_path / "rs2"),
            strict,
            {"accuracy": 1.0},
            tracking,
            0,
        )


@pytest.mark.parametrize(
    "options",
    [
        {"loss_type": "grpo", "beta": 0.04, "kl_estimator": "k1"},
        {"loss_type": "dr_grpo", "advantage_estimator": "dr_grpo", "scale_rewards": "none"},
        {"advantage_estimator": "rloo", "scale_rewards": "none", "epsilon_high": 0.28},
        {"importance_sampling_level": "sequence", "num_iterations": 2},
        {"objective": "cispo", "epsilon_high": 4.0},
        {"clip_ratio_c": 3.0, "delta": 1.5, "top_entropy_quantile": 0.2},
        {"dynamic_sampling": True, "mask_truncated_completions": True},
        {"multi_objective_aggregation": "normalize_then_sum", "overlong_buffer_length": 4},
        {
            "vllm_importance_sampling_correction": True,
            "vllm_importance_sampling_mode": "token_truncate",
        },
    ],
    ids=lambda o: ",".join(o),
)
def test_every_rl_option_runs_through_score_and_update(tiny_checkpoint, data, tmp_path, options):
    rl = RLConfig(
        prompts_per_iteration=4,
        num_generations=4,
        steps_per_generation=2,
        max_completion_length=12,
        temperature=0.7,
        **options,
    )
    knobs = rl.model_dump()
    roll = rollout.fn(
        "rl_1", 0, str(tiny_checkpoint), data["rl"], str(tmp_path / "r.parquet"), knobs, 0
    )
    sc = score.fn(
        "rl_1",
        0,
        roll["path"],
        str(tmp_path / "s.parquet"),
        {"format": 1.0, "tag_count": 0.5},
        knobs,
    )
    scored = pq.read_table(sc["path"]).to_pandas()
    if options.get("overlong_buffer_length"):
        assert "reward_overlong_penalty" in scored.columns
        assert (scored["reward_overlong_penalty"] <= 0).all()
    up = update.fn(
        "rl_1",
        0,
        str(tiny_checkpoint),
        sc["path"],
        str(tmp_path / "ckpt"),
        knobs,
        reference_checkpoint=str(tiny_checkpoint),
    )
    for h in up["history"]:
        assert all(v == v for k, v in h.items() if k != "kl"), h  # no NaN metric
    if options.get("beta"):
        assert "kl" in up["history"][0]
    if options.get("vllm_importance_sampling_correction"):
        # hf engine at the same weights: sampling and trainer log-probs agree to float error
        assert up["history"][0]["sampling/sampling_logp_difference/max"] < 1e-3
    if not options.get("dynamic_sampling"):
        assert len(up["history"]) == 2 * options.get("num_iterations", 1)

"""Stage caching: same inputs -> the recorded result; changed inputs or force -> recompute."""

import os

import pytest

from grpo_core.config import RLConfig, SFTConfig
from grpo_core.demo.task import make_splits
from grpo_core.io import write_jsonl
from tasks import cache
from tasks.rollout import rollout
from tasks.score import score
from tasks.sft import sft_stage
from tasks.tracking import Tracking


@pytest.fixture
def rl_path(tmp_path):
    return str(
        write_jsonl(make_splits(0, n_sft=8, n_rl=16, n_dev=1, n_eval=1).rl, tmp_path / "rl.jsonl")
    )


def test_rollout_and_score_are_reused_until_an_input_changes(tiny_checkpoint, rl_path, tmp_path):
    knobs = RLConfig(
        prompts_per_iteration=2, num_generations=2, steps_per_generation=1, max_completion_length=6
    ).model_dump()
    r_path = str(tmp_path / "r.parquet")
    first = rollout.fn("rl_1", 0, str(tiny_checkpoint), rl_path, r_path, knobs, 0)
    mtime = os.stat(r_path).st_mtime_ns
    again = rollout.fn("rl_1", 0, str(tiny_checkpoint), rl_path, r_path, knobs, 0)
    assert not first["cached"] and again["cached"]
    assert os.stat(r_path).st_mtime_ns == mtime  # not rewritten
    assert again["completions/mean_length"] == first["completions/mean_length"]
    # another iteration or sampling setting is another key
    assert not rollout.fn("rl_1", 1, str(tiny_checkpoint), rl_path, r_path, knobs, 0)["cached"]
    assert rollout.fn("rl_1", 1, str(tiny_checkpoint), rl_path, r_path, knobs, 0)["cached"]
    assert not rollout.fn("rl_1", 1, str(tiny_checkpoint), rl_path, r_path, knobs, 0, force=True)[
        "cached"
    ]

    s_path = str(tmp_path / "s.parquet")
    a = score.fn("rl_1", 0, r_path, s_path, {"format": 1.0}, knobs)
    b = score.fn("rl_1", 0, r_path, s_path, {"format": 1.0}, knobs)
    c = score.fn("rl_1", 0, r_path, s_path, {"format": 0.5, "tag_count": 1.0}, knobs)
    assert (a["cached"], b["cached"], c["cached"]) == (False, True, False)


def test_deleted_output_is_recomputed(tiny_checkpoint, rl_path, tmp_path):
    knobs = RLConfig(
        prompts_per_iteration=2, num_generations=2, steps_per_generation=1, max_completion_length=6
    ).model_dump()
    r_path = tmp_path / "r.parquet"
    rollout.fn("rl_1", 0, str(tiny_checkpoint), rl_path, str(r_path), knobs, 0)
    r_path.unlink()
    out = rollout.fn("rl_1", 0, str(tiny_checkpoint), rl_path, str(r_path), knobs, 0)
    assert not out["cached"] and r_path.exists()


def test_sft_stage_cache_records_a_cached_child_run(tiny_checkpoint, tmp_path, tracking_uri):
    from mlflow.tracking import MlflowClient

    data = str(
        write_jsonl(make_splits(0, n_sft=16, n_rl=1, n_dev=1, n_eval=1).sft, tmp_path / "sft.jsonl")
    )
    tracking = Tracking.open(tracking_uri, "cache").start_parent("p", {})
    cfg = SFTConfig(max_steps=5, batch_size=4)
    out_dir = str(tmp_path / "sft")
    first = sft_stage.fn("cold_start_sft", str(tiny_checkpoint), data, out_dir, cfg, tracking)
    second = sft_stage.fn("cold_start_sft", str(tiny_checkpoint), data, out_dir, cfg, tracking)
    assert (first["cached"], second["cached"]) == (False, True)
    run = MlflowClient(tracking_uri).get_run(second["run_id"])
    assert run.data.tags["cached"] == "true" and run.data.metrics["steps"] == 5
    changed = sft_stage.fn(
        "cold_start_sft",
        str(tiny_checkpoint),
        data,
        out_dir,
        SFTConfig(max_steps=6, batch_size=4),
        tracking,
    )
    assert not changed["cached"] and changed["steps"] == 6


def test_code_version_and_content_hash_are_stable(tiny_checkpoint, rl_path):
    assert cache.code_version() == cache.code_version()
    assert cache.content_hash(rl_path) == cache.content_hash(rl_path)
    assert cache.stage_key("x", {"a": 1}, [rl_path]) != cache.stage_key("x", {"a": 2}, [rl_path])

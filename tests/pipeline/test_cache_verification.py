"""The cache verifies what it reuses (tasks/cache.py, grpo_core/training/checkpoint.py): every output's
sha256 is in its manifest with its size and mtime; equal size and mtime are trusted without
reading the file, anything else is hashed, and an output whose bytes changed is recomputed.
A checkpoint's policy_id is the hash of the weights on disk, never a text file taken on trust.
"""

import logging
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from grpo_core.config.stages import EvalConfig, RLConfig
from grpo_core.contracts.io import write_jsonl
from grpo_core.contracts.rollouts import read_rollouts, read_scored
from grpo_core.demo.task import make_splits
from grpo_core.training import checkpoint
from grpo_core.training.checkpoint import (
    POLICY_ID,
    TRAINER_STATE,
    WEIGHTS,
    load_checkpoint,
    policy_id,
    save_checkpoint,
)
from tasks import cache
from tasks.evaluate import evaluate_checkpoint
from tasks.rollout import rollout
from tasks.score import score

REWARD_FILE = """
def distinct_chars(prompts, completions, **columns):
    return [float(len(set(c))) for c in completions]
"""


@pytest.fixture
def rl_path(tmp_path):
    rows = make_splits(0, n_sft=8, n_rl=16, n_dev=1, n_eval=1).rl
    return str(write_jsonl(rows, tmp_path / "rl.jsonl"))


@pytest.fixture
def eval_path(tmp_path):
    rows = make_splits(0, n_sft=1, n_rl=1, n_dev=1, n_eval=6).eval
    return str(write_jsonl(rows, tmp_path / "eval.jsonl"))


@pytest.fixture
def weights(tmp_path):
    """A reward that varies between completions, so advantages are not all 0."""
    (tmp_path / "varied_reward.py").write_text(REWARD_FILE)
    return {f"{tmp_path / 'varied_reward.py'}:distinct_chars": 1.0}


@pytest.fixture
def trained_checkpoint(tiny_checkpoint, tmp_path):
    """A stage checkpoint: the tiny model with other weights, saved as the pipeline does."""
    model, tokenizer = load_checkpoint(tiny_checkpoint)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=gen))
    return save_checkpoint(model, tokenizer, tmp_path / "checkpoints" / "rl_2")


def _rl() -> RLConfig:
    return RLConfig(
        prompts_per_iteration=4, num_generations=4, steps_per_generation=1, max_completion_length=8
    )


def _rollout(ckpt, rl_path, out):
    return rollout.fn("rl_1", 3, str(ckpt), rl_path, str(out), _rl(), 0)


def test_hand_edited_scored_file_is_scored_again(tiny_checkpoint, rl_path, weights, tmp_path):
    """(a) Negated advantages in a cached scored.parquet are not trained on: score recomputes
    and the file has the right advantages again."""
    r_path, s_path = tmp_path / "rollouts.parquet", tmp_path / "scored.parquet"
    _rollout(tiny_checkpoint, rl_path, r_path)
    first = score.fn("rl_1", 3, str(r_path), str(s_path), weights, _rl())
    right = read_scored(s_path).column("advantage").to_numpy()
    assert np.abs(right).max() > 0  # negating changes the file

    table = pq.read_table(s_path)
    i = table.schema.get_field_index("advantage")
    negated = pa.array(-right, type=pa.float32())
    size = s_path.stat().st_size
    pq.write_table(table.set_column(i, table.schema.field(i), negated), s_path)
    assert (pq.read_table(s_path).column("advantage").to_numpy() == -right).all()
    assert s_path.stat().st_size == size  # same size: only the hash can tell

    again = score.fn("rl_1", 3, str(r_path), str(s_path), weights, _rl())
    assert (first.cached, again.cached) == (False, False)
    assert (read_scored(s_path).column("advantage").to_numpy() == right).all()
    timing = "timing/score_s"
    assert {**again.metrics, timing: 0} == {**first.metrics, timing: 0}
    assert score.fn("rl_1", 3, str(r_path), str(s_path), weights, _rl()).cached


def test_swapped_weights_get_a_new_policy_id_and_a_fresh_eval(
    tiny_checkpoint, trained_checkpoint, eval_path, tmp_path, caplog
):
    """(b) A stage checkpoint whose model.safetensors is replaced by the base model's: its
    policy_id becomes the base model's, and the cached eval is recomputed on those weights."""
    cfg = EvalConfig(max_completion_length=8)
    table = str(tmp_path / "eval" / "rl_2.parquet")
    trained_id = policy_id(trained_checkpoint)
    before = evaluate_checkpoint(str(trained_checkpoint), eval_path, cfg, out_table=table)
    assert evaluate_checkpoint(str(trained_checkpoint), eval_path, cfg, out_table=table).cached

    shutil.copyfile(tiny_checkpoint / WEIGHTS, trained_checkpoint / WEIGHTS)
    with caplog.at_level(logging.WARNING, logger="grpo_core.training.checkpoint"):
        assert policy_id(trained_checkpoint) == policy_id(tiny_checkpoint) != trained_id
    assert "weights changed" in caplog.text
    memo = (trained_checkpoint / POLICY_ID).read_text().splitlines()
    assert memo[0] == policy_id(tiny_checkpoint)  # the memo now records the new weights

    after = evaluate_checkpoint(str(trained_checkpoint), eval_path, cfg, out_table=table)
    fresh = evaluate_checkpoint(str(tiny_checkpoint), eval_path, cfg)  # no cache involved
    assert not after.cached and after.policy_id == policy_id(tiny_checkpoint)
    assert [s["completion"] for s in after.samples] == [s["completion"] for s in fresh.samples]
    assert after.accuracy == fresh.accuracy and after.mean_length == fresh.mean_length
    assert [s["completion"] for s in after.samples] != [s["completion"] for s in before.samples]
    assert pq.read_table(table).column("completion").to_pylist() == [
        s["completion"] for s in fresh.samples
    ]


def test_truncated_rollouts_are_sampled_again(tiny_checkpoint, rl_path, weights, tmp_path, caplog):
    """(c) A truncated rollouts.parquet is recomputed by the rollout task, not handed on."""
    r_path = tmp_path / "rollouts.parquet"
    first = _rollout(tiny_checkpoint, rl_path, r_path)
    rows = read_rollouts(r_path).num_rows
    data = r_path.read_bytes()
    r_path.write_bytes(data[: len(data) // 2])

    with caplog.at_level(logging.WARNING, logger="tasks.cache"):
        again = _rollout(tiny_checkpoint, rl_path, r_path)
    assert (first.cached, again.cached) == (False, False)
    assert "rl_1 iteration 3 rollout: rollouts.parquet changed since it was written" in caplog.text
    assert "recomputing" in caplog.text
    assert read_rollouts(r_path).num_rows == rows
    assert r_path.read_bytes() == data  # same seed, same rows
    scored = score.fn("rl_1", 3, str(r_path), str(tmp_path / "s.parquet"), weights, _rl())
    assert not scored.cached


def test_untouched_outputs_are_reused_without_reading_them(
    tiny_checkpoint, rl_path, eval_path, weights, tmp_path
):
    """(d) Equal size and mtime: reuse without hashing any output; a new mtime over the
    same bytes costs one hash, is reused, and refreshes the stamp."""
    r_path, s_path = tmp_path / "rollouts.parquet", tmp_path / "scored.parquet"
    table = str(tmp_path / "eval.parquet")
    cfg = EvalConfig(max_completion_length=8)

    def run_all():
        return [
            _rollout(tiny_checkpoint, rl_path, r_path),
            score.fn("rl_1", 3, str(r_path), str(s_path), weights, _rl()),
            evaluate_checkpoint(str(tiny_checkpoint), eval_path, cfg, out_table=table),
        ]

    assert not any(out.cached for out in run_all())
    hashed, checks, hits = (
        checkpoint.STATS["files_hashed"],
        cache.STATS["hash_checks"],
        cache.STATS["stamp_hits"],
    )
    assert all(out.cached for out in run_all())
    assert checkpoint.STATS["files_hashed"] == hashed  # no output (nor input) was read
    assert cache.STATS["hash_checks"] == checks
    assert cache.STATS["stamp_hits"] == hits + 3

    st = s_path.stat()
    os.utime(s_path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a touch: same bytes
    assert score.fn("rl_1", 3, str(r_path), str(s_path), weights, _rl()).cached
    assert cache.STATS["hash_checks"] == checks + 1
    assert checkpoint.STATS["files_hashed"] == hashed + 1
    assert score.fn("rl_1", 3, str(r_path), str(s_path), weights, _rl()).cached
    assert cache.STATS["hash_checks"] == checks + 1  # the refreshed stamp matches


def test_checkpoint_outputs_are_verified_by_their_model_files(
    tiny_checkpoint, trained_checkpoint, tmp_path, caplog
):
    """A checkpoint directory output (update, SFT): new weights or config recompute; the
    trainer state, the policy_id memo and the info file are not the model."""
    out = tmp_path / "iter_0000" / "checkpoint"
    key = cache.stage_key("update", {}, [tiny_checkpoint])
    calls = []

    def compute():
        calls.append(1)
        model, tokenizer = load_checkpoint(trained_checkpoint)
        state = {"global_step": len(calls)}
        save_checkpoint(model, tokenizer, out, trainer_state=state, info={"run": len(calls)})
        return {"checkpoint": str(out), "policy_id": policy_id(out)}

    first = cache.cached("rl_1 iteration 0 update", out, key, compute)
    (out / TRAINER_STATE).unlink()  # pruned from older iterations by the RL flow
    (out / "checkpoint_info.json").write_text("{}")
    hashed = checkpoint.STATS["files_hashed"]
    assert cache.cached("rl_1 iteration 0 update", out, key, compute) == {**first, "cached": True}
    assert checkpoint.STATS["files_hashed"] == hashed and len(calls) == 1

    shutil.copyfile(tiny_checkpoint / WEIGHTS, out / WEIGHTS)
    with caplog.at_level(logging.WARNING, logger="tasks.cache"):
        redone = cache.cached("rl_1 iteration 0 update", out, key, compute)
    assert not redone["cached"] and len(calls) == 2
    assert redone["policy_id"] == first["policy_id"] == policy_id(out)
    assert "rl_1 iteration 0 update: checkpoint changed since it was written" in caplog.text

    config = out / "config.json"
    config.write_text(config.read_text() + "\n")  # not the weights, still the model
    assert not cache.cached("rl_1 iteration 0 update", out, key, compute)["cached"]
    assert len(calls) == 3

    # a plain copy put in its place: new mtimes, same bytes -> hashed once, then trusted
    shutil.copytree(out, tmp_path / "copy", copy_function=shutil.copyfile)
    shutil.rmtree(out)
    os.replace(tmp_path / "copy", out)
    checks = cache.STATS["hash_checks"]
    assert cache.cached("rl_1 iteration 0 update", out, key, compute)["cached"]
    assert cache.cached("rl_1 iteration 0 update", out, key, compute)["cached"]
    assert len(calls) == 3 and cache.STATS["hash_checks"] == checks + 1


def test_policy_id_memo_is_trusted_only_while_the_weights_keep_their_stamp(
    tiny_checkpoint, tmp_path
):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)  # copy2: same mtimes, new inode change times
    pid = policy_id(tiny_checkpoint)
    hashed = checkpoint.STATS["files_hashed"]
    assert policy_id(ckpt) == pid and checkpoint.STATS["files_hashed"] == hashed + 1
    assert policy_id(ckpt) == pid and checkpoint.STATS["files_hashed"] == hashed + 1  # memo

    (ckpt / POLICY_ID).write_text("0123456789abcdef\n")  # an id without stamps: not trusted
    assert policy_id(ckpt) == pid
    weights = ckpt / WEIGHTS
    size = weights.stat().st_size
    with open(weights, "r+b") as f:  # one byte of the weights changed in place
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 1]))
    st = weights.stat()
    assert policy_id(ckpt) != pid
    memo = (ckpt / POLICY_ID).read_text().splitlines()
    assert memo == [
        policy_id(ckpt),
        "# tensor-sha256",
        f"{st.st_size} {st.st_mtime_ns} {st.st_ctime_ns} {WEIGHTS}",
    ]

    (ckpt / POLICY_ID).unlink()  # no memo (a model from elsewhere): hashed, none written
    assert policy_id(ckpt) == memo[0] and not (ckpt / POLICY_ID).exists()

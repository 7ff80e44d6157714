import pyarrow.parquet as pq
import pytest

from grpo_core import rewards
from grpo_core.contracts.io import atomic_path, write_parquet
from grpo_core.contracts.rollouts import ROLLOUT_COLUMNS, read_metadata_of, read_rollouts
from grpo_core.demo.task import make_splits
from grpo_core.training.checkpoint import file_sha256
from tasks.rollout import sample_rollouts, select_prompts
from tasks.score import score_file


@pytest.fixture
def rollouts(tiny_checkpoint, tmp_path):
    rows = make_splits(0, n_sft=1, n_rl=4, n_dev=1, n_eval=1).rl
    out = sample_rollouts(
        str(tiny_checkpoint),
        rows,
        str(tmp_path / "rollouts.parquet"),
        num_generations=3,
        temperature=1.0,
        max_completion_length=10,
        iteration=5,
        seed=0,
    )
    return out.path


def test_rollout_parquet_has_the_contract_columns(rollouts):
    t = pq.read_table(rollouts)
    assert set(ROLLOUT_COLUMNS) <= set(t.column_names)
    assert "answer" in t.column_names  # passthrough column
    assert t.num_rows == 12
    d = t.to_pylist()
    for r in d:
        assert len(r["completion_logprobs"]) == len(r["completion_ids"]) == r["completion_length"]
        assert r["finish_reason"] in ("stop", "length")
        assert r["iteration"] == 5
    assert [r["sample_idx"] for r in d[:3]] == [0, 1, 2]
    meta = read_metadata_of(t)
    assert meta["schema_version"] == "2" and meta["engine"] == "hf" and meta["sampling"]["n"] == 3


def test_scoring_writes_a_new_file_and_leaves_rollouts_untouched(rollouts, tmp_path):
    before = file_sha256(rollouts)
    out = score_file(rollouts, str(tmp_path / "scored.parquet"), {"accuracy": 1.0, "format": 0.1})
    assert file_sha256(rollouts) == before
    t = pq.read_table(out.path)
    for col in (
        "reward_accuracy",
        "reward_format",
        "error_accuracy",
        "error_format",
        "reward",
        "advantage",
    ):
        assert col in t.column_names
    assert {"reward", "reward_std", "frac_reward_zero_std", "rewards/accuracy/mean"} <= set(
        out.metrics
    )
    # advantages are zero-mean within each group (one drawn prompt of one iteration)
    df = t.to_pandas()
    assert df.groupby(["iteration", "group_idx"])["advantage"].sum().abs().max() < 1e-4


def test_a_failing_reward_function_is_recorded_not_fatal(rollouts, tmp_path):
    # fails on the rows of one prompt (failing on every row stops the stage:
    # tests/pipeline/test_reward_errors.py)
    first = pq.read_table(rollouts)["answer"][0].as_py()

    @rewards.register("sometimes_fails", replace=True)
    def sometimes_fails(prompts, completions, **kwargs):
        if first in kwargs["answer"]:
            raise RuntimeError("reward service unavailable")
        return [1.0] * len(completions)

    out = score_file(
        rollouts, str(tmp_path / "scored.parquet"), {"sometimes_fails": 1.0, "format": 1.0}
    )
    t = pq.read_table(out.path).to_pandas()
    failed = t["answer"] == first
    assert 0 < failed.sum() < len(t)
    errors = t.loc[failed, "error_sometimes_fails"]
    assert errors.str.contains("RuntimeError: reward service unavailable").all()
    assert t.loc[failed, "reward_sometimes_fails"].isna().all()
    assert (t.loc[~failed, "reward_sometimes_fails"] == 1.0).all()
    assert t["error_sometimes_fails"][~failed].isna().all()
    assert t["reward_format"].notna().all()


def test_missing_column_error_names_file_and_column(tmp_path, rollouts):
    t = pq.read_table(rollouts).drop(["completion_ids"])
    bad = tmp_path / "bad.parquet"
    pq.write_table(t, bad)
    with pytest.raises(ValueError, match=r"bad\.parquet.*completion_ids"):
        read_rollouts(bad)


def test_atomic_write_leaves_previous_file_on_failure(tmp_path, rollouts):
    target = tmp_path / "out.parquet"
    t = pq.read_table(rollouts)
    write_parquet(t, target)
    digest = file_sha256(target)
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_bytes(b"half a file")
        raise RuntimeError("killed mid-write")
    assert file_sha256(target) == digest
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_prompt_selection_is_reproducible_per_iteration():
    a = select_prompts(100, 32, 3, seed=0, stage="rl_1")
    assert a == select_prompts(100, 32, 3, seed=0, stage="rl_1")
    assert len(set(a)) == 32
    first_epoch = [i for it in range(3) for i in select_prompts(96, 32, it, 0, "rl_1")]
    assert sorted(first_epoch) == list(range(96))

"""Reward scoring as Ray tasks: the scored file equals the one-process file row for row,
each task scores whole groups, and a failing reward is recorded per row, not fatal."""

from __future__ import annotations

import os

import pyarrow.parquet as pq
import pytest
from cluster_support import ray_cluster

from cluster import runtime
from cluster.config import ClusterConfig
from cluster.scoring import group_shards

REWARDS = '''
import os


def picky(prompts, completions, answer, **kw):
    """Fails on the prompts with an odd a in "a*2=" (per row, after the batch call failed)."""
    if any(int(a) % 4 == 2 for a in answer):
        raise ValueError(f"odd a, answer {answer[0]}")
    return [float(len(c)) for c in completions]


def where(prompts, completions, **kw):
    return [float(os.getpid())] * len(completions)
'''

ROWS = [{"prompt": f"{a}*2=", "answer": str(2 * a)} for a in range(5)]


@pytest.fixture(scope="module")
def rollouts(tiny_checkpoint, tmp_path_factory):
    from tasks.rollout import sample_rollouts

    out = tmp_path_factory.mktemp("score") / "rollouts.parquet"
    sample_rollouts(
        str(tiny_checkpoint),
        ROWS,
        str(out),
        num_generations=4,
        temperature=1.0,
        max_completion_length=10,
        iteration=0,
        seed=3,
    )
    return out


def _score(rollouts, out, weights, backend):
    from tasks.score import score_file

    runtime.configure(backend)
    try:
        score_file(str(rollouts), str(out), weights, max_completion_length=10)
    finally:
        runtime.configure(ClusterConfig())
    return pq.read_table(out)


def test_group_shards_keep_groups_whole():
    ids = [0, 0, 1, 1, 1, 2, 3, 3]
    assert group_shards(ids, 2) == [(0, 5), (5, 8)]
    assert group_shards(ids, 3) == [(0, 5), (5, 6), (6, 8)]  # 2, 1 and 1 groups
    assert group_shards(ids, 9) == [(0, 2), (2, 5), (5, 6), (6, 8)]


def test_ray_scoring_equals_one_process_in_row_order(ray_head, rollouts, tmp_path):
    fn = tmp_path / "my_rewards.py"
    fn.write_text(REWARDS)
    weights = {"accuracy": 1.0, "format": 0.5, f"{fn}:picky": 0.1}
    local = _score(rollouts, tmp_path / "l.parquet", weights, ClusterConfig())
    ray = _score(rollouts, tmp_path / "r.parquet", weights, ray_cluster(scoring_workers=2))
    assert local.column_names == ray.column_names
    for c in local.column_names:
        assert local.column(c).to_pylist() == ray.column(c).to_pylist(), c
    errors = ray.column(f"error_{fn}:picky").to_pylist()
    groups = ray.column("group_idx").to_pylist()
    assert [e is not None for e in errors] == [g % 2 == 1 for g in groups]
    assert all("ValueError: odd a" in e for e in errors if e)
    assert (
        pq.read_schema(tmp_path / "r.parquet").metadata
        == pq.read_schema(tmp_path / "l.parquet").metadata
    )


def test_each_task_scores_a_contiguous_share_of_whole_groups(ray_head, rollouts, tmp_path):
    fn = tmp_path / "where_rewards.py"
    fn.write_text(REWARDS)
    name = f"{fn}:where"
    table = _score(rollouts, tmp_path / "w.parquet", {name: 1.0}, ray_cluster(scoring_workers=2))
    pids = [int(p) for p in table.column(f"reward_{name}").to_pylist()]
    groups = table.column("group_idx").to_pylist()
    assert os.getpid() not in pids
    first, second = pids[0], pids[-1]
    assert first != second  # two Ray workers
    # groups 0-2 in the first task, 3-4 in the second (5 groups over 2 shards)
    assert pids == [first if g < 3 else second for g in groups]


def test_scoring_that_can_never_start_is_refused(ray_head, rollouts, tmp_path):
    from grpo_core.errors import UserError

    too_big = ClusterConfig(backend="ray", scoring={"workers": 1, "num_cpus": 4})
    with pytest.raises(UserError, match=r"cluster.scoring: 1 worker\(s\) x num_cpus=4 need 4 CPUs"):
        _score(rollouts, tmp_path / "x.parquet", {"accuracy": 1.0}, too_big)
    assert not (tmp_path / "x.parquet").exists()

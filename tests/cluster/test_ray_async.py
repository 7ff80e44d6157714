"""``rl.async_level: 1`` with ``cluster.backend=ray`` (2 rollout replicas, 2 trainer ranks):
the replicas sample iteration i+1 while the trainer group updates on iteration i, each
rollout file is sampled by the policy the schedule names (flows/rl_schedule.py), and the
replicas read those policies' checkpoints (the weight bus is not used while the trainer
group is busy with the next update)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from test_ray_pipeline import RAY, _run

from cluster import rollout_workers
from flows.rl_schedule import sampling_index
from tasks.policies import ref as policy_ref
from tasks.workspace import Workspace

ITERATIONS = 3


@pytest.mark.slow
def test_async_on_ray_follows_the_schedule(ray_head, prefect_harness, tmp_path):
    extra = [
        *RAY,
        f"rl.iterations={ITERATIONS}",
        "rl.eval_every=3",
        "rl.async_level=1",
        "rl.learning_rate=0.003",
        "rewards={accuracy: 1.0, format: 0.1, tag_count: 0.5}",
    ]
    summary = _run(tmp_path, "async", extra)
    assert len(summary["stages"]) == 4
    ws = Workspace(tmp_path / "async" / "demo")
    policies = [policy_ref.policy_id(ws.checkpoint("cold_start_sft"))]
    policies += [policy_ref.policy_id(ws.policy_ref("rl_1", j)) for j in range(ITERATIONS)]
    for it in range(ITERATIONS):
        sampled = set(pq.read_table(ws.rollouts("rl_1", it)).column("policy_id").to_pylist())
        assert sampled == {policies[sampling_index(it, 1)]}, it
    (group,) = rollout_workers.groups()
    # P_1 reached the replicas while the trainer group updated: from its checkpoint (after
    # the stage, the weight bus serves again: rejection sampling takes rl_1's last policy)
    hows = [s["how"] for s in group.weight_syncs if s["policy_id"] == policies[1]]
    assert hows == ["checkpoint"], group.weight_syncs
    # the checkpoints the queued rollouts read were kept until then, and pruned after
    assert not ws.iteration_checkpoint("rl_1", 0).exists()

"""Rollout replicas on a local Ray head: sharded sampling gathers into the rollout file that
one process writes (same columns and row order), each shard with its derived seed; new
weights reach every replica with the probe check; a replica killed mid-call is replaced."""

from __future__ import annotations

import threading
import time

import pyarrow.parquet as pq
import pytest
from cluster_support import ray_cluster

from cluster import rollout_workers, runtime
from cluster.config import ClusterConfig
from grpo_core.contracts.rollouts import ROLLOUT_COLUMNS

ROWS = [{"prompt": f"{a}+{a + 3}=", "answer": str(2 * a + 3)} for a in range(7)]
KNOBS = {"num_generations": 3, "max_completion_length": 12, "iteration": 3, "seed": 11}


def _sample(ckpt, out, *, backend: ClusterConfig, temperature=1.0, rows=ROWS, **kw):
    from tasks.rollout import sample_rollouts

    runtime.configure(backend)
    try:
        sample_rollouts(
            str(ckpt), rows, str(out), temperature=temperature, **{**KNOBS, **kw}, desc="t"
        )
    finally:
        runtime.configure(ClusterConfig())
    return pq.read_table(out)


def _same_rows(a, b, columns=ROLLOUT_COLUMNS):
    assert a.num_rows == b.num_rows
    for c in columns:
        assert a.column(c).to_pylist() == b.column(c).to_pylist(), c


def test_greedy_shards_gather_to_the_local_file(ray_head, tiny_checkpoint, tmp_path):
    local = _sample(tiny_checkpoint, tmp_path / "l.parquet", backend=ClusterConfig(), temperature=0)
    ray = _sample(tiny_checkpoint, tmp_path / "r.parquet", backend=ray_cluster(), temperature=0)
    _same_rows(local, ray, [c for c in ROLLOUT_COLUMNS if c != "completion_logprobs"])
    for x, y in zip(
        local.column("completion_logprobs").to_pylist(),
        ray.column("completion_logprobs").to_pylist(),
        strict=True,
    ):
        assert x == pytest.approx(y, abs=1e-5)  # other batch shapes: float noise only
    assert local.column("answer").to_pylist() == ray.column("answer").to_pylist()
    (group,) = rollout_workers.groups()
    assert len(group.actors) == 2
    pids = {ray_head.get(a.pid.remote()) for a in group.actors}
    assert len(pids) == 2  # two processes


def test_each_shard_samples_with_its_derived_seed(ray_head, tiny_checkpoint, tmp_path):
    """Shard k (contiguous prompts, 4 and 3 here) samples what one process samples for those
    prompts with seed shard_seed(seed, k); shard 0 keeps the seed itself."""
    table = _sample(tiny_checkpoint, tmp_path / "r.parquet", backend=ray_cluster())
    assert rollout_workers.shards(len(ROWS), 2) == [(0, 4), (4, 7)]
    seed = KNOBS["seed"]
    assert rollout_workers.shard_seed(seed, 0) == seed
    expected = []
    for k, (a, b) in enumerate([(0, 4), (4, 7)]):
        part = _sample(
            tiny_checkpoint,
            tmp_path / f"l{k}.parquet",
            backend=ClusterConfig(),
            rows=ROWS[a:b],
            seed=rollout_workers.shard_seed(seed, k),
        ).to_pylist()
        for r in part:
            r["group_idx"] += a
        expected += part
    got = table.to_pylist()
    assert [r["group_idx"] for r in got] == [g for g in range(7) for _ in range(3)]
    for e, g in zip(expected, got, strict=True):
        for c in ("group_idx", "sample_idx", "prompt", "completion_ids", "finish_reason"):
            assert e[c] == g[c], c
        assert e["completion_logprobs"] == pytest.approx(g["completion_logprobs"], abs=1e-5)
    meta = pq.read_schema(tmp_path / "r.parquet").metadata
    assert b'"rollout_shards": 2' in meta[b"grpo_pipeline"]


def test_new_weights_reach_every_replica(ray_head, tiny_checkpoint, tmp_path):
    import torch

    from grpo_core.training.checkpoint import load_checkpoint, policy_id, save_checkpoint

    model, tok = load_checkpoint(tiny_checkpoint)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    moved = tmp_path / "moved"
    save_checkpoint(model, tok, moved)
    before = _sample(tiny_checkpoint, tmp_path / "a.parquet", backend=ray_cluster(), temperature=0)
    (group,) = rollout_workers.groups()
    actors = list(group.actors)
    after = _sample(
        moved, tmp_path / "b.parquet", backend=ray_cluster(), temperature=0, check_sync=True
    )
    assert group.actors == actors  # the same replicas, not new ones
    assert group.synced == [policy_id(moved)] * 2
    assert {ray_head.get(a.current_policy.remote()) for a in actors} == {policy_id(moved)}
    local = _sample(moved, tmp_path / "c.parquet", backend=ClusterConfig(), temperature=0)
    assert after.column("completion_ids").to_pylist() == local.column("completion_ids").to_pylist()
    assert after.column("completion_ids").to_pylist() != before.column("completion_ids").to_pylist()
    assert set(after.column("policy_id").to_pylist()) == {policy_id(moved)}


def _kill_first_replica_while_it_works(ray, start):
    """Run ``start`` in a thread and kill replica 0 as soon as its shard is submitted."""
    box = {}

    def target():
        try:
            box["out"] = start()
        except BaseException as e:  # re-raised by the caller
            box["err"] = e

    thread = threading.Thread(target=target)
    thread.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        groups = rollout_workers.groups()
        if groups and groups[0].inflight:
            ray.kill(groups[0].actors[0])
            break
        time.sleep(0.001)
    else:
        raise AssertionError("the rollout never started")
    thread.join()
    return box


def test_a_killed_replica_is_replaced_and_its_shard_redone(ray_head, tiny_checkpoint, tmp_path):
    kw = {"max_completion_length": 48}
    clean = _sample(tiny_checkpoint, tmp_path / "a.parquet", backend=ray_cluster(), **kw)
    (group,) = rollout_workers.groups()
    replaced = group.replaced
    box = _kill_first_replica_while_it_works(
        ray_head,
        lambda: _sample(tiny_checkpoint, tmp_path / "b.parquet", backend=ray_cluster(), **kw),
    )
    assert "err" not in box, box.get("err")
    assert group.replaced == replaced + 1
    _same_rows(clean, box["out"])  # the fresh replica redid shard 0 with the same seed


def test_a_replica_dying_without_retry_names_worker_and_call(ray_head, tiny_checkpoint, tmp_path):
    from grpo_core.contracts.text import encode_prompt
    from grpo_core.engines.generation import SamplingParams
    from grpo_core.engines.turns import SampleRequest
    from grpo_core.training.checkpoint import load_checkpoint, policy_id
    from tasks.policies import loading

    model, tok = load_checkpoint(tiny_checkpoint)
    prompt_ids = [encode_prompt(tok, r["prompt"]) for r in ROWS]
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=48, seed=5)
    box = _kill_first_replica_while_it_works(
        ray_head,
        lambda: rollout_workers.sample(
            ray_cluster(),
            prompt_ids,
            SampleRequest(
                params,
                load_options=loading.options().load_kwargs(trainer=False),  # as the task
                desc="rl_1 it3 rollout",
            ),
            checkpoint=str(tiny_checkpoint),
            policy_id=policy_id(tiny_checkpoint),
            model=model,
            tokenizer=tok,
            retries=0,
        ),
    )
    err = box.get("err")
    assert isinstance(err, rollout_workers.RolloutWorkerError), box
    assert "rollout replica 0 of 2" in str(err) and "rl_1 it3 rollout" in str(err)


def test_a_group_larger_than_the_cluster_is_refused(ray_head, tiny_checkpoint, tmp_path):
    from grpo_core.errors import UserError

    big = ClusterConfig(backend="ray", rollout={"workers": 3, "num_cpus": 1})
    with pytest.raises(UserError, match=r"cluster.rollout: 3 worker\(s\) x num_cpus=1 need 3 CPUs"):
        _sample(tiny_checkpoint, tmp_path / "x.parquet", backend=big)
    assert not (tmp_path / "x.parquet").exists()

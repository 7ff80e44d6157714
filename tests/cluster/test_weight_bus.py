"""The weight bus (cluster/weight_bus.py): trainer rank 0 broadcasts a new policy to the rollout
replicas over a gloo group of their own. The buckets arrive exactly; on a local Ray, replicas
synced after a 2-rank update (ddp, and fsdp gathering its shards) hold the trainer's weights bit
for bit (the same policy_id, hashed in each replica); ``weight_sync: checkpoint`` reads the
checkpoint instead; a replica found dead before a sync is started again from the checkpoint and
then joins the new bus."""

from __future__ import annotations

import threading

import pytest
import torch
from cluster_support import scored_file

from cluster import rollout_workers, runtime, weight_bus
from cluster.config import ClusterConfig
from flows.config import load_config
from grpo_core.training.distributed import free_port

E = weight_bus.Entry


def test_buckets_cut_at_a_dtype_change_and_at_the_size():
    entries = [E("a", (4,), "float32"), E("b", (2, 2), "float32"), E("c", (3,), "bfloat16"),
               E("d", (100,), "bfloat16"), E("e", (1,), "bfloat16")]  # fmt: skip
    plan = weight_bus.buckets(entries, bucket_bytes=32)
    assert [[e.name for e in b] for b in plan] == [["a", "b"], ["c"], ["d"], ["e"]]
    assert weight_bus.buckets(entries, 1 << 20) == [entries[:2], entries[2:]]


def test_every_member_receives_each_tensor_exactly():
    """Rank 0 and two receivers, each a thread with its own gloo group on one TCPStore; a
    receiver whose loading fails still takes every bucket, so the sender is not held up."""
    g = torch.Generator().manual_seed(0)
    state = {
        "embed.weight": torch.randn(7, 5, generator=g),
        "norm.weight": torch.randn(5, generator=g).to(torch.bfloat16),
        "layers.0.w": torch.randn(3, 4, generator=g).to(torch.bfloat16),
        "lm_head.bias": torch.randn(7, generator=g),
    }
    plan = weight_bus.buckets(weight_bus.describe(state), bucket_bytes=64)
    assert len(plan) == 3  # 140 bytes of float32 fill a bucket; the bfloat16 pair shares one
    port, world, got, errors = free_port(), 3, {}, []

    def member(rank):
        try:
            bus = weight_bus.Bus("127.0.0.1", port, rank, world, "gloo")
            weight_bus._BUS[f"k{rank}"] = bus  # one process here: one key per member
            if rank == 0:
                got[0] = weight_bus.send("k0", iter(state.items()), plan)
            elif rank == 1:
                out = {}
                weight_bus.receive(f"k{rank}", plan, lambda views: out.update(views))
                got[rank] = out
            else:  # fails on the first bucket: still takes the rest, then raises
                seen = []

                def take(views):
                    seen.append(views)
                    if len(seen) == 1:
                        raise KeyError("no such tensor")

                with pytest.raises(KeyError, match="no such tensor"):
                    weight_bus.receive(f"k{rank}", plan, take)
                got[rank] = len(seen)
        except Exception as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    weight_bus._BUS.clear()
    assert not errors, errors
    assert got[0] == sum(v.numel() * v.element_size() for v in state.values())
    assert got[2] == 1  # loaded nothing after its failure, yet the sender finished
    assert got[1].keys() == state.keys()
    for k, v in state.items():
        assert got[1][k].dtype == v.dtype and torch.equal(got[1][k], v), k


def _cluster(strategy: str, weight_sync: str = "broadcast") -> ClusterConfig:
    return ClusterConfig(
        backend="ray",
        rollout={"workers": 2, "num_cpus": 0.5, "weight_sync": weight_sync},
        trainer={"workers": 2, "num_cpus": 0.5, "strategy": strategy},
        scoring={"workers": 1, "num_cpus": 0.0},
    )


def _update_then_sample(cfg, tiny_checkpoint, tmp_path, between=None):
    """One 2-rank update of the tiny policy, then rollouts of the base policy (the replicas
    start on it) and of the updated one (the sync under test). Returns the update."""
    from tasks.rollout import sample_rollouts
    from tasks.update import UpdateRequest, run_update

    runtime.configure(cfg)
    scored = scored_file(tmp_path)
    knobs = ["prompts_per_iteration=3", "steps_per_generation=3", "learning_rate=1e-3"]
    rl = load_config(None, [f"rl.{k}" for k in knobs]).rl
    request = UpdateRequest(
        str(tiny_checkpoint), scored, str(tmp_path / "iter_0"), rl, stage="rl_1"
    )
    res = run_update(request, iteration=0)
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(4)]
    for k, ckpt in enumerate((tiny_checkpoint, res.checkpoint)):
        if k == 1 and between is not None:
            between()
        sample_rollouts(str(ckpt), rows, str(tmp_path / f"r{k}.parquet"), num_generations=2,
                        max_completion_length=4, iteration=k, seed=1, desc="t")  # fmt: skip
    return res


@pytest.fixture
def ray_roles(ray_head):
    from cluster import trainer_group

    yield
    rollout_workers.close_all()
    trainer_group.release()
    runtime.configure(ClusterConfig())


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_replicas_take_the_trainers_weights_over_the_bus(
    ray_roles, ray_head, tiny_checkpoint, tmp_path, strategy
):
    from tasks.policies.trainer import open_trainer

    res = _update_then_sample(_cluster(strategy), tiny_checkpoint, tmp_path)
    (group,) = rollout_workers.groups()
    sync = group.weight_syncs[-1]
    assert sync["how"] == "broadcast" and sync["policy_id"] == res.policy_id, group.weight_syncs
    assert sync["bytes"] > 0 and group.replaced == 0
    ids = ray_head.get([a.weights_id.remote() for a in group.actors])
    assert ids == [res.policy_id] * 2  # bit for bit the trainer's (and the checkpoint's)
    held = open_trainer().held()
    assert held.learner is None and not held.loaded  # the driver loaded no model


@pytest.mark.slow
def test_weight_sync_checkpoint_reads_the_file(ray_roles, ray_head, tiny_checkpoint, tmp_path):
    res = _update_then_sample(_cluster("ddp", "checkpoint"), tiny_checkpoint, tmp_path)
    (group,) = rollout_workers.groups()
    assert [s["how"] for s in group.weight_syncs] == ["checkpoint"]
    assert ray_head.get([a.weights_id.remote() for a in group.actors]) == [res.policy_id] * 2


@pytest.mark.slow
def test_a_dead_replica_is_replaced_before_the_bus_opens(
    ray_roles, ray_head, tiny_checkpoint, tmp_path
):
    def kill_replica_0():
        (group,) = rollout_workers.groups()
        ray_head.kill(group.actors[0])

    res = _update_then_sample(_cluster("ddp"), tiny_checkpoint, tmp_path, between=kill_replica_0)
    (group,) = rollout_workers.groups()
    assert group.replaced == 1 and group.weight_syncs[-1]["how"] == "broadcast"
    assert ray_head.get([a.weights_id.remote() for a in group.actors]) == [res.policy_id] * 2


def test_auto_takes_the_bus_when_both_roles_have_gpus():
    from cluster.weight_sync import wanted

    cpu = _cluster("ddp")
    gpu = cpu.model_copy(update={
        "rollout": cpu.rollout.model_copy(update={"num_gpus": 1}),
        "trainer": cpu.trainer.model_copy(update={"num_gpus": 1}),
    })  # fmt: skip
    assert ClusterConfig().rollout.weight_sync == "auto"
    assert [wanted("auto", c) for c in (cpu, gpu)] == [False, True]
    assert wanted("broadcast", cpu) and not wanted("checkpoint", gpu)

"""Several Ray nodes on one host (``ray.cluster_utils.Cluster``: a head holding no CPU and two
worker nodes, each its own raylet and object store), joined through ``cluster.address`` as a
user joins a real cluster: the placement each role asks for is the one it gets, and the
trainer ranks on two nodes make the one-process update."""

from __future__ import annotations

import os

import pytest
import torch
from cluster_support import scored_file
from safetensors.torch import load_file

from cluster.config import ClusterConfig
from flows.config import load_config
from tasks.update import UpdateRequest

pytest.importorskip("ray")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def nodes():
    """A head with no CPU (the driver's node holds no work) and two worker nodes of 2 CPUs."""
    import ray
    from ray.cluster_utils import Cluster

    from cluster import runtime, trainer_group

    if ray.is_initialized():  # another module's Ray
        runtime.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    workers = [cluster.add_node(num_cpus=2) for _ in range(2)]
    cluster.wait_for_nodes()
    yield cluster, {n.node_id for n in workers}
    trainer_group.release()
    runtime.shutdown()
    runtime.configure(ClusterConfig())
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()


def _cfg(cluster, **roles) -> ClusterConfig:
    return ClusterConfig(backend="ray", address=cluster.address, **roles)


@pytest.mark.parametrize("placement", ["pack", "spread"])
def test_trainer_ranks_are_placed_as_asked(nodes, placement):
    import ray

    from cluster import runtime, trainer_group

    cluster, worker_ids = nodes
    trainer = {"workers": 2, "num_cpus": 1, "placement": placement}
    cfg = _cfg(cluster, trainer=trainer)
    runtime.configure(cfg)
    try:
        group = trainer_group.trainer_group(cfg)
        on = ray.get([a.node_id.remote() for a in group.actors])
    finally:
        trainer_group.release()
    assert set(on) <= worker_ids  # never the head
    assert len(set(on)) == (1 if placement == "pack" else 2)


def test_rollout_replicas_spread_over_the_nodes(nodes, tiny_checkpoint, tmp_path):
    import ray

    from cluster import rollout_workers, runtime
    from tasks.rollout import sample_rollouts

    cluster, worker_ids = nodes
    cfg = _cfg(cluster, rollout={"workers": 2, "num_cpus": 1}, scoring={"num_cpus": 0.5})
    runtime.configure(cfg)
    try:
        rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(4)]
        sample_rollouts(str(tiny_checkpoint), rows, str(tmp_path / "r.parquet"),
                        num_generations=2, max_completion_length=6, iteration=0, seed=0,
                        temperature=1.0, desc="t")  # fmt: skip
        (group,) = rollout_workers.groups()
        on = ray.get([a.node_id.remote() for a in group.actors])
    finally:
        rollout_workers.close_all()
        runtime.configure(ClusterConfig())
    assert set(on) == worker_ids  # one replica per node


def test_trainer_ranks_on_two_nodes_make_the_one_process_update(nodes, tiny_checkpoint, tmp_path):
    """DDP over gloo between two nodes: the checkpoint of the one-process update."""
    import ray

    from cluster import runtime, trainer_group
    from tasks.update import run_update, update_from_file

    cluster, _ = nodes
    scored = scored_file(tmp_path)
    rl = load_config(None, ["rl.prompts_per_iteration=3", "rl.steps_per_generation=3",
                            "rl.gradient_accumulation_steps=1"]).rl  # fmt: skip

    def request(tag):
        return UpdateRequest(str(tiny_checkpoint), scored, str(tmp_path / tag), rl,
                             reference_checkpoint=str(tiny_checkpoint), stage="rl_1")  # fmt: skip

    one = update_from_file(request("one"))
    cfg = _cfg(cluster, trainer={"workers": 2, "num_cpus": 1, "placement": "spread"})
    runtime.configure(cfg)
    try:
        two = run_update(request("two"), iteration=0)
        group = trainer_group.trainer_group(cfg)
        on = ray.get([a.node_id.remote() for a in group.actors])
    finally:
        trainer_group.release()
        runtime.configure(ClusterConfig())
    assert len(set(on)) == 2 and two.global_step == one.global_step
    a = load_file(os.path.join(one.checkpoint, "model.safetensors"))
    b = load_file(os.path.join(two.checkpoint, "model.safetensors"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)


def _demo(tmp_path, name: str, extra: list[str]) -> dict:
    """The demo at the tests' tiny budget on Ray (2 replicas, 2 trainer ranks, 2 scorers)."""
    from test_ray_pipeline import RAY, _tiny_overrides

    from flows.r1 import r1_pipeline

    cfg = load_config(None, [*_tiny_overrides(), *RAY, *extra, f"output_dir={tmp_path / name}",
                             f"tracking.uri=sqlite:///{tmp_path / name}.db"])  # fmt: skip
    return r1_pipeline(cfg)


def test_the_demo_across_two_nodes_ends_as_on_one_node(nodes, prefect_harness, tmp_path):
    """The whole recipe with the trainer ranks and the rollout replicas each spread over the
    two worker nodes ends every stage with the policy, and the held-out table, of the same
    run on a one-node Ray: placement moves work, never a number. (Last in this module: it
    leaves the driver on a Ray of its own.)"""
    import ray

    from cluster import rollout_workers, runtime, trainer_group
    from flows.config import CHECKPOINT_STAGES
    from tasks.policies import ref as policy_ref

    cluster, worker_ids = nodes
    across = _demo(tmp_path, "across", [f"cluster.address={cluster.address}",
                                        "cluster.trainer.placement=spread"])  # fmt: skip
    ranks = ray.get([a.node_id.remote() for a in trainer_group.running().actors])
    (group,) = rollout_workers.groups()
    replicas = ray.get([a.node_id.remote() for a in group.actors])
    assert set(ranks) == set(replicas) == worker_ids  # each role on both nodes
    runtime.shutdown()  # the driver leaves the cluster; the run below starts a local Ray
    one = _demo(tmp_path, "one", [])
    table = {r["stage"]: (r["accuracy"], r["format_rate"]) for r in one["stages"]}
    assert {r["stage"]: (r["accuracy"], r["format_rate"]) for r in across["stages"]} == table
    for stage in CHECKPOINT_STAGES:
        a = policy_ref.policy_id(tmp_path / "across" / "demo" / "checkpoints" / stage)
        b = policy_ref.policy_id(tmp_path / "one" / "demo" / "checkpoints" / stage)
        assert a == b, stage

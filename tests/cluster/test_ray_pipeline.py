"""`grpo run` of the demo at the tests' tiny budget with ``cluster.backend=ray`` (2 rollout
replicas, 2 trainer ranks on gloo, 2 scoring tasks) on a local Ray head: every stage runs,
the rollout and scored files keep their contracts, and held-out accuracy is reported beside the local run's at the
same seed (the samples differ: each shard has its own seed, so the numbers need not match).
The same run with trainer rank 1 killed between two rl_1 updates goes on by itself and ends
with the undisturbed run's weights at every stage."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from cluster import rollout_workers, trainer_group
from flows.config import CHECKPOINT_STAGES, load_config
from grpo_core.contracts.rollouts import ROLLOUT_COLUMNS, SCORED_COLUMNS
from tasks.workspace import Workspace


def _tiny_overrides() -> list[str]:
    path = Path(__file__).parents[1] / "pipeline" / "tests_support.py"
    spec = importlib.util.spec_from_file_location("_pipeline_tests_support", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return list(mod.TINY_OVERRIDES)


REWARDS = ("accuracy", "format")  # the demo's reward functions
RAY = [  # the ray_head fixture's 2 CPUs hold the three roles at once
    "cluster.backend=ray",
    "cluster.rollout={workers: 2, num_cpus: 0.5, weight_sync: broadcast}",
    "cluster.trainer={workers: 2, num_cpus: 0.25}",
    "cluster.scoring={workers: 2, num_cpus: 0.25}",
]


def _run(tmp_path: Path, name: str, extra: list[str]) -> dict:
    from flows.r1 import r1_pipeline

    cfg = load_config(
        None,
        [
            *_tiny_overrides(),
            *extra,
            f"output_dir={tmp_path / name}",
            f"tracking.uri=sqlite:///{tmp_path / name}.db",
        ],
    )
    return r1_pipeline(cfg)


def _stage_metric(tmp_path: Path, name: str, stage: str, key: str) -> float:
    """``key`` of run ``name``'s ``stage`` run in its MLflow store."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / name}.db")
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, f"tags.stage = '{stage}'")  # (its evals' too)
    (value,) = [r.data.metrics[key] for r in runs if key in r.data.metrics]
    return value


def _kill_rank_1_once(record: Path) -> list[int]:
    """SIGKILL trainer rank 1 once ``record`` (an rl_1 iteration's policy record: its update
    is done, the next is to come) exists; the pid killed goes in the list returned."""
    killed: list[int] = []

    def watch():
        deadline = time.monotonic() + 900
        while not record.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        group = trainer_group.running()
        if group is not None and record.exists():
            os.kill(group.pids[1], signal.SIGKILL)
            killed.append(group.pids[1])

    threading.Thread(target=watch, daemon=True).start()
    return killed


@pytest.mark.slow
def test_grpo_run_on_ray_matches_the_contracts(ray_head, prefect_harness, tmp_path):
    from tasks.policies.trainer import open_trainer

    store = tmp_path / "store"  # storage.url: the run folder also mirrored (cluster/storage.py)
    ray_summary = _run(tmp_path, "ray", [*RAY, f"storage.url=file://{store}"])
    # the driver held no policy: the ranks trained, the replicas loaded each new checkpoint
    held = open_trainer().held()
    assert held.stats["loads"] == 0 and held.learner is None and not held.loaded
    (group,) = rollout_workers.groups()
    assert len(group.actors) == 2 and group.replaced == 0
    # the RL update's policy reached the replicas from trainer rank 0 over the weight bus
    hows = [s["how"] for s in group.weight_syncs]
    assert hows.count("broadcast") >= 1 and "restart" not in hows, group.weight_syncs
    # the held-out evals sample on the replicas too (a driver without a GPU holds no engine)
    served = group.served
    # (the final evals reuse these: same weights, data and settings)
    assert {"rl_1 start eval", "rl_1 it1 eval", "rl_2 start eval"} <= set(served), served
    trainers = trainer_group.running()
    assert trainers is not None and len(set(trainers.pids)) == 2  # 2 gloo ranks did the updates
    assert [r["stage"] for r in ray_summary["stages"]] == list(CHECKPOINT_STAGES)

    ws = Workspace(tmp_path / "ray" / "demo")
    for stage, iterations in (("rl_1", 2), ("rl_2", 1)):
        for it in range(iterations):
            rollouts = pq.read_table(ws.rollouts(stage, it))
            assert set(ROLLOUT_COLUMNS) <= set(rollouts.column_names)
            assert rollouts.num_rows == 16
            assert rollouts.column("group_idx").to_pylist() == [
                g for g in range(4) for _ in range(4)
            ]
            assert rollouts.column("sample_idx").to_pylist() == list(range(4)) * 4
            assert set(rollouts.column("iteration").to_pylist()) == {it}
            meta = json.loads(rollouts.schema.metadata[b"grpo_pipeline"])
            assert meta["rollout_shards"] == 2
            scored = pq.read_table(ws.scored(stage, it))
            contract = {c for c in SCORED_COLUMNS if "<fn>" not in c}
            contract |= {f"{kind}_{fn}" for kind in ("reward", "error") for fn in REWARDS}
            assert contract <= set(scored.column_names)
            assert (
                scored.column("completion").to_pylist() == rollouts.column("completion").to_pylist()
            )
    for stage in CHECKPOINT_STAGES:
        assert (ws.checkpoint(stage) / "model.safetensors").exists()
        assert pq.read_table(ws.eval_table(stage)).num_rows == 16
    leftovers = [p for p in (tmp_path / "ray").rglob("*") if ".tmp-" in p.name]
    assert leftovers == []
    mirrored = {p.relative_to(store / "demo").as_posix() for p in store.rglob("*") if p.is_file()}
    assert not [p for p in mirrored if ".tmp-" in p]
    for stage in CHECKPOINT_STAGES:
        assert f"checkpoints/{stage}/model.safetensors" in mirrored
    assert "rl_1/iter_0001/policy.json.stage.json" in mirrored  # the trainer group's update
    # its checkpoint (rank 0 writes every update's, for the replicas): the last, a save point
    assert "rl_1/iter_0001/checkpoint/trainer_state.pt" in mirrored

    killed = _kill_rank_1_once(Workspace(tmp_path / "killed" / "demo").policy_ref("rl_1", 0))
    _run(tmp_path, "killed", [*RAY, f"storage.url=file://{tmp_path / 'store2'}"])
    assert killed and killed[0] not in trainer_group.running().pids  # a new group took over
    for stage in CHECKPOINT_STAGES:  # and the run ended with the undisturbed run's weights
        ours = Workspace(tmp_path / "killed" / "demo").checkpoint(stage) / "policy_id.txt"
        theirs = ws.checkpoint(stage) / "policy_id.txt"
        assert ours.read_text().split()[0] == theirs.read_text().split()[0], stage
    # the recovery shows in MLflow, in the stage it happened in
    restarts = {(name, stage): _stage_metric(tmp_path, name, stage, "recovery/trainer_restarts")
                for name in ("ray", "killed") for stage in ("rl_1", "rl_2")}  # fmt: skip
    assert restarts == {("ray", "rl_1"): 0, ("ray", "rl_2"): 0,
                        ("killed", "rl_1"): 1, ("killed", "rl_2"): 0}  # fmt: skip
    assert _stage_metric(tmp_path, "killed", "rl_1", "recovery/replicas_replaced") == 0
    assert _stage_metric(tmp_path, "killed", "rl_1", "recovery/trainer_seconds_lost") > 0
    assert _stage_metric(tmp_path, "ray", "rl_1", "recovery/trainer_seconds_lost") == 0

    local_summary = _run(tmp_path, "local", [])
    ray_acc = {r["stage"]: r["accuracy"] for r in ray_summary["stages"]}
    local_acc = {r["stage"]: r["accuracy"] for r in local_summary["stages"]}
    print("held-out accuracy, seed 0 (stage: ray 2+2 workers / local):")
    for stage in CHECKPOINT_STAGES:
        print(f"  {stage}: {ray_acc[stage]:.3f} / {local_acc[stage]:.3f}")
    # before any rollout the two runs are the same computation
    assert ray_acc["cold_start_sft"] == local_acc["cold_start_sft"]


@pytest.mark.slow
def test_grpo_run_on_ray_with_fsdp_at_gpu_defaults(ray_head, prefect_harness, tmp_path):
    """The trainer ranks shard the policy (FSDP2) with gradient checkpointing on and AdamW's
    multi-tensor path forced on, as a GPU runs them: every stage completes, and the RL
    stages' trainer state is the sharded optimizer's, gathered and keyed by parameter name."""
    import torch

    gpu = ["model.gradient_checkpointing=true", "rl.optim=adamw_torch_foreach"]
    fsdp = [*RAY[:2], "cluster.trainer={workers: 2, num_cpus: 0.25, strategy: fsdp}", RAY[3]]
    summary = _run(tmp_path, "fsdp", [*fsdp, *gpu])
    assert [r["stage"] for r in summary["stages"]] == list(CHECKPOINT_STAGES)
    trainers = trainer_group.running()
    assert trainers is not None and trainers.cfg.trainer.strategy == "fsdp"
    assert len(set(trainers.pids)) == 2
    ws = Workspace(tmp_path / "fsdp" / "demo")
    for stage in ("rl_1", "rl_2"):
        state = torch.load(ws.checkpoint(stage) / "trainer_state.pt", weights_only=False)
        moments = state["optimizer"]["state"]
        assert moments and all(isinstance(k, str) for k in moments)  # by name: gathered shards
        assert all(torch.isfinite(v["exp_avg"]).all() for v in moments.values())

"""The GRPO update on the trainer group (``cluster.backend: ray``, 2 Ray actors, gloo) writes the
checkpoint that the one-process update writes, keeps its actors (and their models) across
iterations, and a rank killed mid-update gives an error naming the role and the iteration and
no half-written checkpoint."""

from __future__ import annotations

import os

import pytest
import torch
from cluster_support import scored_file
from safetensors.torch import load_file

from cluster.config import ClusterConfig, TrainerSettings
from flows.config import load_config
from tasks.update import UpdateRequest

pytest.importorskip("ray")

OVERRIDES = [
    "rl.prompts_per_iteration=3",
    "rl.steps_per_generation=3",  # 3 groups, one per micro-batch: rank 1 idles in one of two
    "rl.gradient_accumulation_steps=1",
    "rl.num_iterations=2",
    "rl.beta=0.04",
    "rl.learning_rate=1e-3",
]
STEPS = 6  # optimizer steps per update: 3 micro-batches x num_iterations 2


@pytest.fixture(scope="module")
def ray_trainers():
    """A local Ray (2 CPUs) and the process configured for 2 trainer workers of 1 CPU."""
    from cluster import runtime, trainer_group

    cfg = ClusterConfig(
        backend="ray",
        num_cpus=2,
        trainer=TrainerSettings(workers=2, num_cpus=1, dist_backend="gloo"),
    )
    runtime.configure(cfg)
    runtime.ensure_ray(cfg)
    yield cfg
    trainer_group.release()
    runtime.shutdown()
    runtime.configure(ClusterConfig())


def _weights(checkpoint) -> dict:
    return load_file(os.path.join(checkpoint, "model.safetensors"))


def _chain(tmp_path, tag, tiny_checkpoint, scored, rl, run) -> list:
    """Two iterations of a stage: the second from the first's checkpoint and trainer state."""
    out, policy = [], str(tiny_checkpoint)
    for it in range(2):
        request = UpdateRequest(
            policy_path=policy,
            scored_path=scored,
            out_checkpoint=str(tmp_path / tag / f"iter_{it}"),
            rl=rl,
            reference_checkpoint=str(tiny_checkpoint),
            init_checkpoint=str(tiny_checkpoint),
            global_step=it * STEPS,
            total_steps=2 * STEPS,
            stage="rl_1",
        )
        res = run(request, iteration=it)
        out.append(res)
        policy = res.checkpoint
    return out


@pytest.mark.slow
@pytest.mark.parametrize("loss_type,strategy", [("dapo", "ddp"), ("grpo", "ddp"), ("dapo", "fsdp")])
def test_two_trainer_actors_make_the_one_process_update(
    ray_trainers, tiny_checkpoint, tmp_path, loss_type, strategy
):
    """fsdp: the decoder layers sharded over the 2 actors; the group is replaced between the
    two iterations, so the second loads the gathered AdamW state from the first's checkpoint
    into new shards."""
    from cluster import runtime, trainer_group

    trainer = ray_trainers.trainer.model_copy(update={"strategy": strategy})
    cfg = ray_trainers.model_copy(update={"trainer": trainer})
    runtime.configure(cfg)
    try:
        _compare_with_one_process(cfg, tiny_checkpoint, tmp_path, loss_type, strategy)
    finally:
        trainer_group.release()
        runtime.configure(ray_trainers)


def _compare_with_one_process(cfg, tiny_checkpoint, tmp_path, loss_type, strategy):
    from cluster import trainer_group
    from tasks.update import run_update, update_from_file

    scored = scored_file(tmp_path)
    rl = load_config(None, [*OVERRIDES, f"rl.loss_type={loss_type}"]).rl
    local = _chain(
        tmp_path,
        "local",
        tiny_checkpoint,
        scored,
        rl,
        lambda request, iteration: update_from_file(request),
    )
    pids = []

    def on_ray(request, iteration):
        res = run_update(request, iteration=iteration)
        pids.append(trainer_group.trainer_group(cfg).pids)
        if strategy == "fsdp":
            trainer_group.release()  # the next iteration: new actors, state from disk
        return res

    remote = _chain(tmp_path, "ray", tiny_checkpoint, scored, rl, on_ray)
    assert len(set(pids[0])) == 2
    if strategy == "ddp":
        assert pids[0] == pids[1]  # 2 actors, kept for the stage
    else:
        assert not set(pids[0]) & set(pids[1])
    # fsdp: the attention key biases' gradient is rounding noise (softmax ignores a shift of
    # all keys) that AdamW scales up to ~1e-6 steps, which differ with the order of the sums
    atol = 5e-6 if strategy == "fsdp" else 1e-6
    before = _weights(tiny_checkpoint)
    for one, two in zip(local, remote, strict=True):
        assert two.global_step == one.global_step and len(two.history) == STEPS
        a, b = _weights(one.checkpoint), _weights(two.checkpoint)
        assert max(float((a[k] - before[k]).abs().max()) for k in a) > 1e-4  # it trained
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=atol, msg=k)
        for h1, h2 in zip(one.history, two.history, strict=True):
            assert h2["loss"] == pytest.approx(h1["loss"], rel=1e-4, abs=1e-6)
    assert not [p for p in os.listdir(tmp_path / "ray") if p.startswith(".")]


@pytest.mark.slow
def test_a_killed_trainer_actor_names_the_role_and_iteration(
    ray_trainers, tiny_checkpoint, tmp_path
):
    from cluster import trainer_group
    from cluster.trainer_group import TrainerGroupError
    from tasks.update import UpdateRequest, run_update

    scored = scored_file(tmp_path)
    rl = load_config(None, OVERRIDES).rl
    first = trainer_group.trainer_group(ray_trainers).pids

    def die_on_rank_1(step):  # defined here: Ray ships it by value
        import signal

        import torch.distributed as dist

        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    out = tmp_path / "rl_1" / "iter_0004" / "checkpoint"
    request = UpdateRequest(
        policy_path=str(tiny_checkpoint),
        scored_path=scored,
        out_checkpoint=str(out),
        rl=rl,
        reference_checkpoint=str(tiny_checkpoint),
        stage="rl_1",
    )
    with pytest.raises(TrainerGroupError, match=r"rl_1 iteration 4 update: trainer worker rank 1"):
        run_update(request, iteration=4, on_step=die_on_rank_1)
    assert not out.exists()
    assert not out.parent.exists() or os.listdir(out.parent) == []  # nor a temporary one
    res = run_update(request, iteration=4)  # a fresh group takes over
    assert res.global_step == STEPS and (out / "model.safetensors").exists()
    assert set(trainer_group.trainer_group(ray_trainers).pids).isdisjoint(first)


@pytest.mark.slow
def test_a_trainer_rank_lost_between_updates_is_replaced_and_the_stage_ends_the_same(
    ray_trainers, tiny_checkpoint, tmp_path, caplog
):
    """Rank 1's actor killed between two updates (as its node going would): the next update
    starts a new group, whose ranks load the policy it starts from (the first update's
    checkpoint and train state), and ends with the weights of the run nobody killed."""
    import ray

    from cluster import trainer_group
    from tasks.update import run_update

    scored = scored_file(tmp_path)
    rl = load_config(None, OVERRIDES).rl
    pids = []

    def kill_rank_1_after(request, iteration):
        res = run_update(request, iteration=iteration)
        group = trainer_group.trainer_group(ray_trainers)
        pids.append(group.pids)
        if iteration == 0:
            ray.kill(group.actors[1], no_restart=True)
        return res

    alive = _chain(tmp_path, "alive", tiny_checkpoint, scored, rl,
                   lambda request, iteration: run_update(request, iteration=iteration))  # fmt: skip
    with caplog.at_level("WARNING", logger="cluster.executor"):
        lost = _chain(tmp_path, "lost", tiny_checkpoint, scored, rl, kill_rank_1_after)
    assert "rl_1 iteration 1 update: trainer worker rank 1 of 2" in caplog.text
    assert "starting a new trainer group (restart 1 of 1)" in caplog.text
    assert set(pids[0]).isdisjoint(pids[1])  # a new group did the second update
    for one, two in zip(alive, lost, strict=True):
        assert two.global_step == one.global_step
        a, b = _weights(one.checkpoint), _weights(two.checkpoint)
        for k in a:
            assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_a_trainer_rank_that_raises_is_not_retried(ray_trainers, tiny_checkpoint, tmp_path):
    """A rank that raises (a bug, bad input) would raise again: one line, no new group."""
    from cluster import trainer_group
    from cluster.trainer_group import TrainerGroupError
    from tasks.update import UpdateRequest, run_update

    first = trainer_group.trainer_group(ray_trainers)
    request = UpdateRequest(
        policy_path=str(tiny_checkpoint),
        scored_path=str(tmp_path / "missing.parquet"),
        out_checkpoint=str(tmp_path / "out"),
        rl=load_config(None, OVERRIDES).rl,
        stage="rl_1",
    )
    with pytest.raises(TrainerGroupError, match="raised") as e:
        run_update(request, iteration=0)
    assert not e.value.lost
    assert trainer_group.running() is first and first.actors == []  # stopped, not restarted


@pytest.mark.slow
def test_trainer_ranks_pull_their_inputs_from_the_shared_store(
    ray_trainers, tiny_checkpoint, tmp_path
):
    """``storage.url`` (cluster/storage.py): the policy and the scored rollouts exist only in
    the store (a node that never had them); the ranks download them, rank 0 uploads the
    checkpoint it writes, and the update is the one-process update."""
    import shutil

    from cluster import storage, trainer_group
    from tasks.update import UpdateRequest, run_update, update_from_file

    rl = load_config(None, OVERRIDES).rl
    (tmp_path / "src").mkdir()
    scored = scored_file(tmp_path / "src")
    expected = update_from_file(
        UpdateRequest(
            str(tiny_checkpoint),
            scored,
            str(tmp_path / "one"),
            rl,
            reference_checkpoint=str(tiny_checkpoint),
            stage="rl_1",
        )
    )
    run = tmp_path / "node" / "runs" / "demo"
    policy, rollouts = run / "checkpoints" / "base", run / "rl_1" / "iter_0000" / "scored.parquet"
    shutil.copytree(tiny_checkpoint, policy)
    rollouts.parent.mkdir(parents=True)
    shutil.copy(scored, rollouts)
    storage.configure(f"file://{tmp_path / 'store'}/runs/demo", run)
    trainer_group.release()  # the next group's actors get the store in their environment
    try:
        storage.publish(policy, rollouts)
        shutil.rmtree(run)
        out = run / "rl_1" / "iter_0000" / "checkpoint"
        request = UpdateRequest(
            policy_path=str(policy),
            scored_path=str(rollouts),
            out_checkpoint=str(out),
            rl=rl,
            reference_checkpoint=str(policy),
            stage="rl_1",
        )
        res = run_update(request, iteration=0)
        store = storage.active()
        assert store.fs.isfile(store.remote(out / "model.safetensors"))  # published by rank 0
        assert policy.is_dir() and rollouts.is_file()  # pulled by the ranks
    finally:
        trainer_group.release()
        storage.configure(None, run)
    a, b = _weights(expected.checkpoint), _weights(res.checkpoint)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)


def test_a_trainer_group_larger_than_the_local_ray_is_refused_at_once(ray_trainers):
    from cluster import trainer_group
    from cluster.trainer_group import TrainerGroupError

    big = ray_trainers.model_copy(update={"trainer": TrainerSettings(workers=3, num_cpus=1)})
    with pytest.raises(
        TrainerGroupError, match=r"cluster.trainer: 3 worker\(s\) x num_cpus=1 need 3 CPUs"
    ):
        trainer_group.trainer_group(big)


def test_scoring_beside_a_trainer_group_that_holds_every_cpu_is_refused(ray_trainers, tmp_path):
    """The trainer actors keep their CPUs between updates: a scoring task needing one would
    wait forever, so it is refused with the settings to change (it used to hang)."""
    from cluster import runtime, trainer_group
    from grpo_core.errors import UserError

    trainer_group.trainer_group(ray_trainers)
    runtime.configure(ray_trainers)  # scored_file scores in this process; this goes to Ray
    with pytest.raises(UserError, match=r"cluster.scoring: .* other roles hold 2"):
        from cluster.scoring import score_sharded
        from grpo_core.rewards.scoring import ScoreRequest

        score_sharded(ray_trainers, ScoreRequest(["p"], ["c"], {}, {"f": 1.0}, [0], dict))


def test_a_local_ray_counts_every_role():
    from cluster.resources import local_num_cpus

    big = ClusterConfig(
        backend="ray",
        rollout={"workers": 4, "num_cpus": 1},
        trainer={"workers": 2, "num_cpus": 2},
        scoring={"workers": 8, "num_cpus": 0.5},
    )
    assert local_num_cpus(big) == max(os.cpu_count(), 12)
    assert local_num_cpus(big.model_copy(update={"num_cpus": 3})) == 3


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_sft_on_the_trainer_group_is_the_one_process_sft(
    ray_trainers, tiny_checkpoint, tmp_path, strategy
):
    """SFT (a cold start or re-SFT) on the 2 trainer actors: each trains its share of every
    batch, and the checkpoint rank 0 writes equals the one-process run's within fp32
    tolerance, with the same per-step losses (which the driver logs from rank 0's result).
    A batch of 5 rows splits 3 + 2; ``max_tokens_per_microbatch`` makes the ranks run
    different numbers of chunks, which FSDP's ranks must even out."""
    from grpo_core.config.stages import SFTConfig

    cfg = SFTConfig(max_steps=4, batch_size=5, learning_rate=1e-3, max_tokens_per_microbatch=40)
    _sft_parity(ray_trainers, tiny_checkpoint, tmp_path, strategy, cfg, n_rows=20)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_sft_on_the_trainer_group_with_the_demo_settings(
    ray_trainers, tiny_checkpoint, tmp_path, strategy
):
    """The demo's SFT settings (configs/demo.yaml: batch 32, learning rate 3e-3, 20 warmup
    steps, gradients clipped to norm 1) for 30 steps over 3 epochs of 300 rows: past the
    warmup, with clipping active, and through the reshuffles, the ranks' checkpoint is the
    one-process run's within fp32 tolerance, step by step in loss, gradient norm and
    learning rate."""
    from grpo_core.config.stages import SFTConfig

    cfg = SFTConfig(max_steps=30, batch_size=32, learning_rate=3e-3, warmup_steps=20)
    local = _sft_parity(ray_trainers, tiny_checkpoint, tmp_path, strategy, cfg, n_rows=300)
    lrs = [h["learning_rate"] for h in local]
    assert lrs[0] < lrs[10] < lrs[17] < lrs[18] == lrs[-1] == pytest.approx(3e-3)  # warmup, flat
    assert sum(h["grad_norm"] > 1.0 for h in local) >= 5  # clipping acted on several steps


def _sft_parity(ray_trainers, tiny_checkpoint, tmp_path, strategy, cfg, *, n_rows) -> list:
    """Train ``cfg`` on ``n_rows`` 2-digit demo rows in one process and on the 2 trainer
    actors with ``strategy``; assert equal per-step metrics and weights. The one-process
    run's per-step metrics."""
    import json

    from cluster import runtime, trainer_group
    from grpo_core.demo.task import make_splits
    from tasks.policies.trainer import open_trainer
    from tasks.sft import SFTRequest, run_sft

    rows = make_splits(digits=2, n_sft=n_rows, n_rl=1, n_dev=0, n_eval=1, seed=0).sft
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kwargs = dict(stage="cold_start_sft", init_checkpoint=str(tiny_checkpoint),
                  data_path=str(data), cfg=cfg)  # fmt: skip

    runtime.configure(ClusterConfig())
    open_trainer().forget()
    local: list = []  # the one-process run's per-step metrics, as it logs them live
    restored: list = []  # the ranks': handed to the driver with rank 0's result
    one = run_sft(SFTRequest(**kwargs, out_checkpoint=str(tmp_path / "one")),
                  on_step=lambda step, m: local.append(m))  # fmt: skip
    trainer = ray_trainers.trainer.model_copy(update={"strategy": strategy})
    cfg_ray = ray_trainers.model_copy(update={"trainer": trainer})
    runtime.configure(cfg_ray)
    try:
        two = run_sft(SFTRequest(**kwargs, out_checkpoint=str(tmp_path / "two")),
                      on_resume=lambda step, history: restored.extend(history))  # fmt: skip
        pids = trainer_group.trainer_group(cfg_ray).pids
    finally:
        trainer_group.release()
        runtime.configure(ray_trainers)
        open_trainer().forget()
    assert len(set(pids)) == 2 and os.getpid() not in pids  # trained on the actors
    assert two.steps == one.steps == cfg.max_steps and two.history is None
    # a gradient norm sums squares of rounded sums: it drifts first (4e-5 by step 23)
    for key, rel in (("loss", 1e-5), ("grad_norm", 2e-4), ("learning_rate", 1e-12)):
        ours, theirs = [h[key] for h in restored], [h[key] for h in local]
        assert ours == pytest.approx(theirs, rel=rel), key
    a, b = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    before = _weights(tiny_checkpoint)
    assert max(float((a[k] - before[k]).abs().max()) for k in a) > 1e-4  # it trained
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=5e-6, msg=k)
    return local

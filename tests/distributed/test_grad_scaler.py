"""fp16's loss scaler belongs to the stage, not to one generation batch: its scale carries
over to the next ``grpo_update`` call and through a saved trainer state, and a step it skips
(a gradient overflowed) is reported. fp16 itself needs CUDA, so these run the same scaler
code on a CPU ``GradScaler`` without autocast, with a scale large enough to overflow float32
gradients. FSDP refuses fp16 (its scaler would see one rank's shards only)."""

from __future__ import annotations

import pytest
import torch
from ddp_cases import batch

from grpo_core.algorithm.update import grpo_update
from grpo_core.config.loss import LossConfig, UpdateConfig
from grpo_core.training.checkpoint import load_checkpoint, save_checkpoint
from grpo_core.training.train_state import TrainState

CFG = UpdateConfig(loss=LossConfig(loss_type="dapo"), steps_per_generation=4)
HUGE = 2.0**126  # scaled gradients overflow float32 (max ~2**128) at first


def _optimization(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def test_an_overflowing_scale_skips_steps_and_carries_over(tiny_checkpoint):
    model, tok = load_checkpoint(tiny_checkpoint)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt, sched = _optimization(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=HUGE)
    first = grpo_update(model, opt, sched, batch(6, tok.pad_token_id), CFG, scaler=scaler)
    skipped = [h["grad_scaler/skipped"] for h in first]
    scales = [h["grad_scaler/scale"] for h in first]
    assert skipped[0] == 1.0 and scales[0] == HUGE / 2  # overflowed: no step, scale halved
    if all(skipped):
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # the next generation batch goes on from the lowered scale, not from a fresh scaler's
    second = grpo_update(model, opt, sched, batch(6, tok.pad_token_id), CFG, scaler=scaler)
    assert second[0]["grad_scaler/scale"] <= scales[-1] < HUGE
    # ... until the scale fits: then steps run and the weights move
    for _ in range(40):
        history = grpo_update(model, opt, sched, batch(6, tok.pad_token_id), CFG, scaler=scaler)
        if history[-1]["grad_scaler/skipped"] == 0.0:
            break
    assert history[-1]["grad_scaler/skipped"] == 0.0
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_the_scale_survives_a_saved_trainer_state(tiny_checkpoint, tmp_path):
    model, tok = load_checkpoint(tiny_checkpoint)
    opt, sched = _optimization(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=HUGE)
    history = grpo_update(model, opt, sched, batch(6, tok.pad_token_id), CFG, scaler=scaler)
    train = TrainState({"stage": "rl_1"}, opt, sched, len(history), {}, scaler)
    save_checkpoint(model, tok, tmp_path / "ck", trainer_state=train.state_dict())

    fresh, _ = load_checkpoint(tmp_path / "ck")
    resumed = TrainState.resume(
        fresh, tmp_path / "ck", None, key={"stage": "rl_1"}, global_step=len(history),
        build=_optimization,
    )  # fmt: skip
    assert resumed.scaler is not None
    assert resumed.scaler.get_scale() == scaler.get_scale() < HUGE
    assert resumed.scaler.state_dict() == scaler.state_dict()


def test_fsdp_refuses_fp16():
    from grpo_core.training.fsdp import ShardedDataParallel

    with pytest.raises(ValueError, match="rl.fp16 with cluster.trainer.strategy: fsdp"):
        ShardedDataParallel().prepare(UpdateConfig(fp16=True))

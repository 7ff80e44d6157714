"""``torchrun --nproc-per-node 2 -m flows.ddp_update`` on a scored file and a checkpoint writes
the checkpoint that the one-process update (``tasks.update.update_from_file``) writes, with
replicas (ddp) and with the decoder layers sharded (fsdp)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from ddp_cases import scored_file
from safetensors.torch import load_file

from flows.config import load_config

OVERRIDES = [
    "rl.prompts_per_iteration=3",
    "rl.steps_per_generation=3",  # 3 groups -> one per micro-batch: rank 1 idles in one of two
    "rl.gradient_accumulation_steps=1",
    "rl.num_iterations=2",
    "rl.beta=0.04",
    "rl.loss_type=dapo",
    "rl.learning_rate=1e-3",
]


def _torchrun(policy, scored, out, sets: list[str], strategy: str = "ddp") -> dict:
    """``torchrun --nproc-per-node 2 -m flows.ddp_update``; its summary line."""
    args = ["--policy", str(policy), "--scored", str(scored), "--out", str(out)]
    args += ["--strategy", strategy]
    for o in sets:
        args += ["--set", o]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "flows.ddp_update", *args],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _weights(checkpoint) -> dict:
    return load_file(os.path.join(checkpoint, "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_torchrun_two_ranks_write_the_one_process_checkpoint(tiny_checkpoint, tmp_path, strategy):
    from grpo_core.training.checkpoint import load_trainer_state
    from tasks.update import UpdateRequest, update_from_file

    scored = scored_file(tmp_path)
    rl = load_config(None, OVERRIDES).rl
    one = update_from_file(UpdateRequest(
        str(tiny_checkpoint), scored, str(tmp_path / "one"), rl,
        reference_checkpoint=str(tiny_checkpoint),
    ))  # fmt: skip
    summary = _torchrun(tiny_checkpoint, scored, tmp_path / "two", OVERRIDES, strategy)
    assert summary["world_size"] == 2 and summary["steps"] == len(one.history) == 6
    assert summary["loss"] == pytest.approx(one.history[-1]["loss"], rel=1e-4, abs=1e-6)
    a, b = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    assert a.keys() == b.keys()
    # fsdp: the attention key biases get a gradient that is rounding noise (softmax ignores a
    # shift of all keys), which AdamW's normalisation turns into steps of ~1e-6 that differ
    # with the order of the sums; every other weight agrees within 1.2e-7 (seen here)
    atol = 5e-6 if strategy == "fsdp" else 1e-6
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=atol, msg=k)
    state = load_trainer_state(tmp_path / "two")
    assert state["global_step"] == one.global_step
    moments = state["optimizer"]["state"]
    if strategy == "fsdp":  # the whole AdamW state, gathered, keyed by parameter name
        full = load_trainer_state(tmp_path / "one")["optimizer"]["state"]
        assert len(moments) == len(full) and all(isinstance(k, str) for k in moments)
        assert sorted(v["exp_avg"].numel() for v in moments.values()) == sorted(
            v["exp_avg"].numel() for v in full.values()
        )
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".") or "tmp" in p]


@pytest.mark.slow
def test_torchrun_ranks_load_the_policy_as_the_model_section_says(tiny_checkpoint, tmp_path):
    """``model.lora`` and ``model.gradient_checkpointing`` reach the ranks: they train the
    LoRA policy with checkpointing on (the summary describes the model they trained), and
    write the one-process LoRA update's weights."""
    from cluster import process
    from tasks.policies.trainer import open_trainer
    from tasks.update import UpdateRequest, update_from_file

    model_sets = ["model.gradient_checkpointing=true", "model.lora={r: 4, alpha: 8}"]
    scored = scored_file(tmp_path)
    cfg = load_config(None, [*OVERRIDES, *model_sets])
    before = process.STATE.model
    process.load_policies_with(cfg.model)
    try:
        open_trainer().forget()
        one = update_from_file(UpdateRequest(
            str(tiny_checkpoint), scored, str(tmp_path / "one"), cfg.rl,
            reference_checkpoint=str(tiny_checkpoint),
        ))  # fmt: skip
        assert one.global_step == 6
    finally:
        process.load_policies_with(before)
        open_trainer().forget()
    summary = _torchrun(tiny_checkpoint, scored, tmp_path / "two", [*OVERRIDES, *model_sets])
    assert summary["model"] == {"dtype": "float32", "lora": True, "gradient_checkpointing": True}
    info = json.loads((tmp_path / "two" / "checkpoint_info.json").read_text())
    assert info.get("lora_base_policy_id")  # a LoRA policy's checkpoint (merged, with its base)
    a, b = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)

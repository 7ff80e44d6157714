"""The whole R1 recipe on a real pretrained chat model (SmolLM2-135M-Instruct imported from
its GGUF), with LoRA and with full fine-tuning, at a CPU-sized budget; the final checkpoint
loads with ``from_pretrained`` (and its adapter with ``PeftModel``) and generates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from cluster import process
from flows.config import CHECKPOINT_STAGES, load_config
from grpo_core.training.checkpoint import policy_id
from grpo_core.training.lora import saved_base
from tasks.policies.trainer import open_trainer
from tasks.workspace import Workspace


def _overrides(model_dir, files, tmp_path, tracking_uri, lora: bool) -> list[str]:
    return [
        "model.source=path",
        f"model.path={model_dir}",
        f"model.lora={'{r: 8, alpha: 16, target_modules: [q_proj, v_proj]}' if lora else 'null'}",
        "data.source=files",
        f"data.sft_path={files['sft']}",
        f"data.rl_path={files['rl']}",
        f"data.eval_path={files['eval']}",
        "sft.max_steps=3",
        "sft.batch_size=2",
        "sft.target_accuracy=null",
        "sft.learning_rate=1e-4",
        "rl.iterations=2",
        "rl.prompts_per_iteration=2",
        "rl.num_generations=2",
        "rl.steps_per_generation=1",
        "rl.max_completion_length=16",
        "rl.eval_every=100",
        "rl.beta=0.04",
        "rl.learning_rate=1e-5",
        "rejection_sampling.num_prompts=2",
        "rejection_sampling.num_generations=2",
        "rejection_sampling.require=[]",
        "rejection_sampling.max_completion_length=16",
        "re_sft={max_steps: 2, batch_size: 2, learning_rate: 1.0e-5, target_accuracy: null}",
        "rl_2={iterations: 1}",
        "eval.num_examples=2",
        "eval.max_completion_length=16",
        f"output_dir={tmp_path / 'runs'}",
        f"tracking.uri={tracking_uri}",
    ]


def _generates(model, tok) -> str:
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt")
    ids = getattr(ids, "input_ids", ids)
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_r1_recipe_on_smollm2(
    lora, smollm2_dir, arithmetic_files, prefect_harness, tmp_path, tracking_uri
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flows.r1 import r1_pipeline

    cfg = load_config(None, _overrides(smollm2_dir, arithmetic_files, tmp_path, tracking_uri, lora))
    try:
        summary = r1_pipeline(cfg)
    finally:
        process.load_policies_with(type(cfg.model)())
        open_trainer().forget()
    assert [r["stage"] for r in summary["stages"]] == list(CHECKPOINT_STAGES)
    ws = Workspace.create(cfg.output_dir, cfg.run_name)
    final = ws.checkpoint("rl_2")
    tok = AutoTokenizer.from_pretrained(final)
    merged = AutoModelForCausalLM.from_pretrained(final).eval()
    text = _generates(merged, tok)
    assert isinstance(text, str)
    client = MlflowClient(tracking_uri)
    registered = {
        a.path for a in client.list_artifacts(summary["parent_run_id"], "final_checkpoint")
    }
    assert "final_checkpoint/model.safetensors" in registered
    if not lora:
        assert not (final / "adapter").exists()
        return
    # every stage's checkpoint: merged weights plus the adapter on the stage's initial weights
    for stage in CHECKPOINT_STAGES:
        ckpt = ws.checkpoint(stage)
        assert (ckpt / "adapter" / "adapter_model.safetensors").exists(), stage
    assert "final_checkpoint/adapter" in registered
    (version,) = client.search_model_versions(f"run_id = '{summary['parent_run_id']}'")
    assert version.tags["adapter"] == "adapter/"
    info = json.loads((final / "checkpoint_info.json").read_text())
    assert info["lora_base_policy_id"] == policy_id(ws.checkpoint("re_sft"))  # rl_2's start
    # recorded relative to the checkpoint (a moved run folder still finds it): resolve it
    assert not Path(info["lora_base"]).is_absolute()
    base_dir, _ = saved_base(final)
    assert Path(base_dir) == ws.checkpoint("re_sft")
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    adapted = PeftModel.from_pretrained(base, final / "adapter").eval()
    ids = tok("What is 2 + 3?", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, merged(ids).logits, atol=1e-4, rtol=1e-4)
    _generates(adapted, tok)

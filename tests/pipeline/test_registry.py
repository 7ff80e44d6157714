"""The model registry registers the model, not the trainer state: a real MLflow sqlite store,
a real checkpoint written by ``save_checkpoint`` with optimizer state, policy id and info."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from flows.model_registry import register_final_checkpoint
from grpo_core.training.checkpoint import (
    POLICY_ID,
    TRAINER_STATE,
    load_checkpoint,
    policy_id,
    save_checkpoint,
)


@pytest.fixture
def final_checkpoint(tiny_model, tmp_path) -> Path:
    """What an RL update writes: model + tokenizer + trainer state + policy id + info."""
    model, tok = tiny_model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[3, 4, 5]]), labels=torch.tensor([[3, 4, 5]])).loss.backward()
    opt.step()  # the optimizer now holds exp_avg / exp_avg_sq for every parameter
    state = {"optimizer": opt.state_dict(), "global_step": 1, "rng": torch.get_rng_state()}
    out = save_checkpoint(
        model, tok, tmp_path / "rl_2", trainer_state=state, info={"global_step": 1}
    )
    assert {TRAINER_STATE, POLICY_ID, "checkpoint_info.json"} <= set(os.listdir(out))
    return out


def _parent_run(tracking_uri: str) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = client.create_experiment("registry-test")
    return client.create_run(exp, run_name="pipeline").info.run_id


def test_registered_model_holds_what_from_pretrained_needs_and_no_trainer_state(
    tracking_uri, final_checkpoint, tmp_path
):
    import mlflow
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parent = _parent_run(tracking_uri)
    version = register_final_checkpoint(
        tracking_uri, parent, final_checkpoint, {"rl_2": {"accuracy": 0.5}}
    )
    assert version.tags["policy_id"] == policy_id(final_checkpoint)

    client = MlflowClient(tracking_uri, registry_uri=tracking_uri)
    source = client.get_model_version_download_uri(version.name, version.version)
    local = Path(
        mlflow.artifacts.download_artifacts(
            artifact_uri=source, dst_path=str(tmp_path / "download"), tracking_uri=tracking_uri
        )
    )
    registered = sorted(p.name for p in local.iterdir())
    assert TRAINER_STATE not in registered
    assert registered == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    logged = [a.path for a in client.list_artifacts(parent, "final_checkpoint")]
    assert sorted(logged) == [f"final_checkpoint/{name}" for name in registered]

    tok = AutoTokenizer.from_pretrained(local)
    loaded = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32)
    saved, saved_tok = load_checkpoint(final_checkpoint)
    assert tok.get_vocab() == saved_tok.get_vocab()
    assert tok.chat_template == saved_tok.chat_template
    for name, tensor in saved.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_a_directory_without_safetensors_weights_is_refused(tracking_uri, tmp_path):
    parent = _parent_run(tracking_uri)
    ckpt = tmp_path / "bin_only"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        register_final_checkpoint(tracking_uri, parent, ckpt, {})

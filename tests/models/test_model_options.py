"""model.dtype / attn_implementation / gradient_checkpointing applied where policies load;
model.path as a directory or a cached hub id; the load options in the stage cache keys."""

from __future__ import annotations

import pytest
import torch

from cluster import process
from grpo_core.config.stages import ModelConfig
from grpo_core.errors import UserError
from grpo_core.training.checkpoint import load_checkpoint, resolve_model_path
from tasks.policies import loading
from tasks.policies.trainer import open_trainer


def test_dtype_attn_and_checkpointing_applied(tiny_checkpoint):
    model, _ = load_checkpoint(
        tiny_checkpoint, dtype="bfloat16", attn_implementation="eager", gradient_checkpointing=True
    )
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config._attn_implementation == "eager"
    assert model.is_gradient_checkpointing
    model, _ = load_checkpoint(tiny_checkpoint, attn_implementation="sdpa")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.config._attn_implementation == "sdpa"
    assert not model.is_gradient_checkpointing


def test_warm_policy_honours_configured_options(tiny_checkpoint):
    try:
        process.load_policies_with(ModelConfig(dtype="bfloat16", attn_implementation="eager"))
        w = open_trainer().handle(tiny_checkpoint)
        assert next(w.model.parameters()).dtype == torch.bfloat16
        assert w.model.config._attn_implementation == "eager"
        assert loading.options_key()["dtype"] == "bfloat16"
    finally:
        process.load_policies_with(ModelConfig())
        open_trainer().forget()
    assert loading.options_key() is None  # defaults leave the cache keys as they were


def test_gradient_checkpointing_same_gradients(tiny_checkpoint):
    ids = torch.tensor([[3, 5, 7, 9, 11, 4]])
    grads = []
    for gc in (False, True):
        model, _ = load_checkpoint(tiny_checkpoint, gradient_checkpointing=gc)
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1])


def test_model_path_directory_and_hub_id(tmp_path, tiny_checkpoint, monkeypatch):
    assert resolve_model_path(str(tiny_checkpoint)) == tiny_checkpoint.resolve()
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    snap = cache / "models--someone--tiny" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (cache / "models--someone--tiny" / "refs").mkdir()
    (cache / "models--someone--tiny" / "refs" / "main").write_text("a" * 40)
    (snap / "config.json").write_text("{}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    assert resolve_model_path("someone/tiny") == snap


def test_model_path_missing_names_both_places(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(UserError) as e:
        resolve_model_path("nobody/no-such-model")
    msg = str(e.value)
    assert "'nobody/no-such-model'" in msg and "no such directory" in msg
    assert str(tmp_path / "hub") in msg and "Hugging Face cache" in msg


def test_qlora_needs_a_gpu(tiny_checkpoint):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(UserError, match="load_in_4bit.*CUDA GPU"):
        load_checkpoint(tiny_checkpoint, load_in_4bit=True)


def test_device_placement(tiny_checkpoint):
    """model.device: auto follows CUDA's presence; a named CUDA device without one is refused
    with the key and the way out."""
    model, _ = load_checkpoint(tiny_checkpoint)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert model.device.type == expected
    assert load_checkpoint(tiny_checkpoint, device="cpu")[0].device.type == "cpu"
    with pytest.raises(ValueError, match="expected auto, cpu, cuda or cuda:N, got 'gpu'"):
        ModelConfig(device="gpu")
    assert ModelConfig(device="cuda:1").device == "cuda:1"
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="model.device: 'cuda'.*no CUDA device"):
            load_checkpoint(tiny_checkpoint, device="cuda")
        process.load_policies_with(ModelConfig(device="cuda"))
        try:
            with pytest.raises(UserError, match="model.device"):
                open_trainer().handle(tiny_checkpoint)
        finally:
            process.load_policies_with(ModelConfig())


def test_config_validation():
    with pytest.raises(ValueError, match="load_in_4bit trains through LoRA"):
        ModelConfig(load_in_4bit=True)
    with pytest.raises(ValueError):
        ModelConfig(dtype="float64")
    cfg = ModelConfig(lora={"r": 4, "target_modules": ["q_proj", "v_proj"]})
    assert cfg.lora.alpha == 32 and cfg.lora.save_merged
    with pytest.raises(ValueError, match="save_merged: false is not supported"):
        ModelConfig(lora={"save_merged": False})


def test_import_gguf_rejects_other_files(tmp_path):
    from grpo_core.training.gguf import import_gguf

    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04not a gguf")
    with pytest.raises(UserError, match="not a GGUF file"):
        import_gguf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()

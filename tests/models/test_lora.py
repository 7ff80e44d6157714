"""LoRA through peft: the reference is the base with the adapter disabled (same modules),
the merged copy a checkpoint saves equals the adapter model, the adapter reloads on its
base, and the warm policy continues the adapter from disk as from memory."""

from __future__ import annotations

import json

import pytest
import torch

from cluster import process
from grpo_core.algorithm.update import build_batch, completion_logprobs
from grpo_core.config.stages import LoraConfig, ModelConfig
from grpo_core.training import lora
from grpo_core.training.checkpoint import load_checkpoint, model_files, policy_id, save_checkpoint
from tasks.policies.trainer import open_trainer

pytest.importorskip("peft")

CFG = LoraConfig(r=4, alpha=8, target_modules="all-linear")


def _trained_adapter(ckpt):
    """An adapter with non-zero B (a plain fresh adapter is the identity)."""
    model, tok = load_checkpoint(ckpt)
    peft_model = lora.attach_adapter(model, CFG)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return peft_model, tok


def _batch(tok):
    return build_batch(
        [[3, 5, 7], [4, 6]], [[8, 9, 10, 11], [12, 13]], [1.0, -1.0], tok.pad_token_id
    )


def test_only_adapter_trainable_and_fresh_adapter_is_identity(tiny_checkpoint):
    base, tok = load_checkpoint(tiny_checkpoint)
    fresh = lora.attach_adapter(load_checkpoint(tiny_checkpoint)[0], CFG)
    trainable = [n for n, p in fresh.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    b = _batch(tok)
    torch.testing.assert_close(completion_logprobs(fresh, b)[0], completion_logprobs(base, b)[0])
    again = lora.attach_adapter(load_checkpoint(tiny_checkpoint)[0], CFG)  # seeded draw
    for (n, p), (_, q) in zip(fresh.named_parameters(), again.named_parameters(), strict=True):
        assert torch.equal(p, q), n


def test_adapter_disabled_reference_equals_base_logprobs(tiny_checkpoint):
    base, tok = load_checkpoint(tiny_checkpoint)
    peft_model, _ = _trained_adapter(tiny_checkpoint)
    b = _batch(tok)
    ref = lora.reference_of(peft_model)
    peft_model.train()
    ref.eval()  # the policy's mode is not the reference's to change
    assert peft_model.training
    base_lp = completion_logprobs(base, b)[0]
    assert torch.equal(completion_logprobs(ref, b)[0], base_lp)
    assert not torch.allclose(completion_logprobs(peft_model, b)[0], base_lp)  # adapter on
    n_params = sum(p.numel() for p in peft_model.parameters())
    assert n_params < 1.5 * sum(p.numel() for p in base.parameters())  # no second copy


def test_merged_copy_equals_adapter_model(tmp_path, tiny_checkpoint):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    peft_model, tok = _trained_adapter(tiny_checkpoint)
    peft_model.eval()
    out = save_checkpoint(peft_model, tok, tmp_path / "ckpt")
    assert (out / "adapter" / "adapter_config.json").exists()
    assert (out / "adapter" / "adapter_model.safetensors").exists()
    names = {p.relative_to(out).as_posix() for p in model_files(out)}
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"} <= names
    b = _batch(tok)
    want = completion_logprobs(peft_model, b)[0]
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(completion_logprobs(merged, b)[0], want, atol=1e-5, rtol=0)
    reloaded = PeftModel.from_pretrained(load_checkpoint(tiny_checkpoint)[0], out / "adapter")
    torch.testing.assert_close(completion_logprobs(reloaded.eval(), b)[0], want, atol=1e-6, rtol=0)
    # merging in memory gives the saved merged weights bit for bit
    in_memory = lora.merge_in_place(peft_model).state_dict()
    for k, v in merged.state_dict().items():
        assert torch.equal(in_memory[k], v), k


def test_sync_sends_merged_weights_under_base_names(tiny_checkpoint):
    peft_model, _ = _trained_adapter(tiny_checkpoint)
    state = lora.merged_state_dict(peft_model)
    base, _ = load_checkpoint(tiny_checkpoint)
    assert set(state) == set(base.state_dict())
    base.load_state_dict(state, strict=True)


def test_warm_lora_policy_continues_from_disk_as_from_memory(tmp_path, tiny_checkpoint):
    open_trainer().forget()
    try:
        process.load_policies_with(ModelConfig(lora=CFG.model_dump()))
        w = open_trainer().learner_at(tiny_checkpoint, lora_base=tiny_checkpoint)
        assert lora.is_peft(w.model)
        assert w.lora_base_id == policy_id(tiny_checkpoint)
        ref = open_trainer().reference(w, tiny_checkpoint)
        assert isinstance(ref, lora.AdapterDisabled)  # no model loaded for the reference
        with torch.no_grad():
            for name, p in w.model.named_parameters():
                if "lora_B" in name:
                    p.add_(0.01)
        ckpt = save_checkpoint(w.model, w.tokenizer, tmp_path / "it0", info=w.lora_info())
        w.trained(ckpt, policy_id(ckpt))
        info = json.loads((ckpt / "checkpoint_info.json").read_text())
        assert info["lora_base_policy_id"] == policy_id(tiny_checkpoint)
        again = open_trainer().learner_at(ckpt, lora_base=tiny_checkpoint)
        assert again is w  # warm: the same adapter goes on training
        open_trainer().forget()
        loaded = open_trainer().learner_at(ckpt, lora_base=tiny_checkpoint)  # from disk
        mine = dict(w.model.named_parameters())
        for name, p in loaded.model.named_parameters():
            assert torch.equal(p, mine[name]), name
            assert p.requires_grad == ("lora_" in name)
        # the next stage starts from this checkpoint: merged weights, a fresh adapter
        loaded.trained(ckpt, policy_id(ckpt))
        nxt = open_trainer().learner_at(ckpt, lora_base=ckpt)
        assert nxt.lora_base_id == policy_id(ckpt)
        merged = load_checkpoint(ckpt)[0].state_dict()
        for k, v in nxt.model.get_base_model().state_dict().items():
            if "lora_" not in k and "base_layer" not in k:
                assert torch.equal(v, merged[k]), k
    finally:
        process.load_policies_with(ModelConfig())
        open_trainer().forget()


def test_adapter_on_another_base_is_refused(tmp_path, tiny_checkpoint):
    from grpo_core.errors import UserError

    open_trainer().forget()
    try:
        process.load_policies_with(ModelConfig(lora=CFG.model_dump()))
        model, tok = load_checkpoint(tiny_checkpoint)
        with torch.no_grad():
            next(model.parameters()).add_(0.1)
        other = save_checkpoint(model, tok, tmp_path / "plain")
        with pytest.raises(UserError, match="no adapter/ folder"):
            open_trainer().learner_at(other, lora_base=tiny_checkpoint)
    finally:
        process.load_policies_with(ModelConfig())
        open_trainer().forget()


def test_engine_sync_gets_merged_weights(tiny_checkpoint):
    """What a vLLM engine receives after an update: the merged weights, base model names
    (here an HF engine over a separate model stands in as the receiver)."""
    from grpo_core.engines import get_engine, sync_weights

    peft_model, tok = _trained_adapter(tiny_checkpoint)
    receiver, _ = load_checkpoint(tiny_checkpoint)
    engine = get_engine("hf", model=receiver, tokenizer=tok)
    sync_weights(engine, peft_model)
    b = _batch(tok)
    peft_model.eval()
    torch.testing.assert_close(
        completion_logprobs(receiver.eval(), b)[0],
        completion_logprobs(peft_model, b)[0],
        atol=1e-5,
        rtol=0,
    )


def test_reference_decoder_and_head_called_separately(tiny_checkpoint):
    """A caller that runs the decoder and the LM head itself (log-probs from hidden states)
    gets the base model's hidden states from the reference, the adapter's from the policy."""
    base, _ = load_checkpoint(tiny_checkpoint)
    peft_model, _ = _trained_adapter(tiny_checkpoint)
    ref = lora.reference_of(peft_model)
    ids = torch.tensor([[3, 5, 7, 9]])
    with torch.no_grad():
        want = base.get_decoder()(input_ids=ids).last_hidden_state
        got = ref.get_decoder()(input_ids=ids).last_hidden_state
        policy = peft_model.get_decoder()(input_ids=ids).last_hidden_state
    assert torch.equal(got, want)
    assert not torch.allclose(policy, want)
    assert type(ref.get_output_embeddings()) is torch.nn.Linear  # no LoRA in the head
    import inspect

    assert "input_ids" in inspect.signature(ref.get_base_model().forward).parameters

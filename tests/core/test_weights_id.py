"""A policy's id is the same computed from its weights in memory and from the files a
checkpoint holds; the background writer leaves the previous state when a write fails."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_core.training import checkpoint as ckpt
from grpo_core.training.checkpoint import POLICY_ID, load_checkpoint, policy_id, save_checkpoint
from grpo_core.training.checkpoint_writer import CheckpointWriter
from grpo_core.training.weights_id import files_id, savable_state_dict, state_dict_id


@pytest.mark.parametrize("tie", [True, False])
def test_id_in_memory_equals_id_of_the_saved_files(tmp_path, tie, tiny_llama):
    model = tiny_llama(tie)
    state = savable_state_dict(model)
    assert ("lm_head.weight" in state) is not tie  # the tied copy is not a checkpoint tensor
    out = save_checkpoint(model, _Tok(), tmp_path / "c")
    assert policy_id(out) == state_dict_id(state)
    # shards or one file: the same tensors, the same id
    model.save_pretrained(tmp_path / "sharded", state_dict=dict(state), max_shard_size="4KB")
    shards = ckpt.weight_files(tmp_path / "sharded")
    assert len(shards) > 1 and files_id(shards) == state_dict_id(state)
    # loaded back, the model's tensors hash the same; one changed value changes the id
    back = AutoModelForCausalLM.from_pretrained(out)
    assert state_dict_id(savable_state_dict(back)) == policy_id(out)
    with torch.no_grad():
        back.model.norm.weight[0] += 1e-3
    assert state_dict_id(savable_state_dict(back)) != policy_id(out)


def test_bf16_weights_hash_by_their_bytes(tmp_path, tiny_llama):
    model = tiny_llama(True).to(torch.bfloat16)
    out = save_checkpoint(model, _Tok(), tmp_path / "c")
    assert policy_id(out) == state_dict_id(savable_state_dict(model))


def test_a_memo_of_another_kind_is_not_trusted(tiny_checkpoint, tmp_path):
    model, tok = load_checkpoint(tiny_checkpoint)
    out = save_checkpoint(model, tok, tmp_path / "c")
    right = policy_id(out)
    memo = out / POLICY_ID
    lines = memo.read_text().splitlines()
    memo.write_text("\n".join(["0123456789abcdef", *lines[2:]]) + "\n")  # an older memo
    assert policy_id(out) == right


def test_a_failed_background_write_leaves_no_checkpoint_and_says_so(tiny_checkpoint, tmp_path):
    model, tok = load_checkpoint(tiny_checkpoint)
    state = savable_state_dict(model)
    writer = CheckpointWriter()
    writer.submit(tmp_path / "bad", model, tok, weights=state, trainer_state=None, info=None,
                  expected_id="not-the-id")  # fmt: skip
    with pytest.raises(RuntimeError, match="not kept"):
        writer.drain()
    assert not (tmp_path / "bad").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".bad")]


def test_the_writer_copies_the_state_before_training_goes_on(tiny_checkpoint, tmp_path):
    model, tok = load_checkpoint(tiny_checkpoint)
    state = savable_state_dict(model)
    pid = state_dict_id(state)
    gate = threading.Event()
    writer = CheckpointWriter()
    writer.submit(tmp_path / "c", model, tok, weights=state, trainer_state={"w": state},
                  info=None, expected_id=pid, on_done=lambda _: gate.set())  # fmt: skip
    with torch.no_grad():  # the next optimizer step, while the thread writes
        for p in model.parameters():
            p.add_(1.0)
    writer.drain()
    assert gate.is_set() and policy_id(tmp_path / "c") == pid
    assert not writer.pending


class _Tok:
    """The tokenizer half of a checkpoint, for models made here without one."""

    def save_pretrained(self, path):
        return None

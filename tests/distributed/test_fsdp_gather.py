"""An FSDP2 checkpoint's gather (grpo_core/training/fsdp.py: ``checkpoint_state``) brings the full
weights and AdamW state to rank 0's CPU one tensor at a time: the other ranks' memory rises by
about one tensor, not by the model and its optimizer state (2 gloo ranks on CPU, where a
rank's device memory is its RSS). Every parameter is sharded (the model's root is an FSDP2
unit), so each rank holds half the weights."""

from __future__ import annotations

import sys

import pytest
import torch
from ddp_cases import gather_memory

from grpo_core.training.distributed import spawn

MIB = 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_only_rank_0_holds_the_gathered_state(tmp_path):
    from grpo_core.demo.model import save_base_model

    # 6 layers of 4.2M float32 parameters: ~100 MB of weights, ~200 MB of AdamW moments
    ckpt = save_base_model(
        tmp_path / "model",
        hidden_size=512,
        num_hidden_layers=6,
        num_attention_heads=8,
        intermediate_size=2048,
    )
    spawn(gather_memory, 2, str(ckpt), str(tmp_path))
    rank0, rank1 = (torch.load(tmp_path / f"gather{r}.pt") for r in range(2))
    full = rank0["weights"]
    assert full > 90 * MIB and rank0["moments"] > 0
    assert rank1["weights"] == 0 and rank1["moments"] == 0  # only rank 0 writes the checkpoint
    one_layer = full / 6
    print(f"peak RSS rise: rank 0 {rank0['rose'] / MIB:.0f} MiB, rank 1 {rank1['rose'] / MIB:.0f} "
          f"MiB; weights {full / MIB:.0f} MiB, one layer {one_layer / MIB:.0f} MiB")  # fmt: skip
    assert rank0["rose"] > 2 * full  # the weights and moments did arrive there
    # seen: 6-15 MiB with replicated embeddings and head, 18-35 MiB with the model as the
    # root unit; the bug this guards against put the whole 96 MiB (and the moments) there
    assert rank1["rose"] < 2 * one_layer + 16 * MIB
    # the root is an FSDP unit too: embeddings, norm and head sharded, each rank holds half
    assert rank0["plain"] == rank1["plain"] == []
    for r in (rank0, rank1):
        assert r["local"] == pytest.approx(full / 2, rel=0.01)

"""FSDP2 (decoder layers sharded over 2 gloo ranks on CPU, grpo_core/training/fsdp.py) makes the update
of one process: same weights within fp32 tolerance after one iteration of several optimizer
steps, same metrics, for every loss_type, with a reference model and a token budget, with
ranks that have no rows in a micro-batch, and with zero-advantage rows skipped."""

from __future__ import annotations

import math

import pytest
import torch
from ddp_cases import MODES, cases, run_all_sharded, run_case, spawn_all

from grpo_core.training.checkpoint import load_checkpoint
from grpo_core.training.fsdp import decoder_layers

WORLD = 2
METRICS = ("loss", "policy_loss", "kl", "entropy", "entropy/trained_rows", "clip_ratio/region_mean")
METRICS += ("grad_norm",)


@pytest.fixture(scope="module")
def sharded_results(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    return spawn_all(run_all_sharded, WORLD, str(tiny_checkpoint), out, modes=MODES)


# gpu-defaults: gradient checkpointing (a layer's forward runs again in backward) and the
# optimizers' multi-tensor path (CUDA's default; it refuses a list mixing DTensor shards and
# plain tensors, so grpo_core/training/optim.py groups them by kind)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(cases()))
def test_sharded_ranks_make_the_update_of_one_process(tiny_checkpoint, sharded_results, name, mode):
    weights, history = run_case(name, str(tiny_checkpoint), mode=mode, skipped_entropy=False)
    before = load_checkpoint(tiny_checkpoint)[0].state_dict()
    rank0, rank1 = (r[name, mode] for r in sharded_results)
    moved = max(float((weights[k] - before[k]).abs().max()) for k in weights)
    assert moved > 1e-4  # the update really changed the weights
    assert set(rank0[0]) == set(weights)
    for k in weights:
        assert torch.equal(rank0[0][k], rank1[0][k]), k  # gathered: the same on every rank
        torch.testing.assert_close(rank0[0][k], weights[k], rtol=1e-5, atol=1e-6, msg=k)
    assert rank0[1] == rank1[1]
    assert len(rank0[1]) == len(history)
    for one, par in zip(history, rank0[1], strict=True):
        for key in METRICS:
            if key in one:
                assert math.isclose(par[key], one[key], rel_tol=1e-4, abs_tol=1e-6), key


def test_decoder_layers_are_the_models_blocks(tiny_model):
    model, _ = tiny_model
    layers = decoder_layers(model)
    assert [type(m).__name__ for m in layers] == ["Qwen2DecoderLayer"] * 2


def test_a_model_without_known_blocks_is_refused():
    with pytest.raises(ValueError, match="no decoder layers to shard"):
        decoder_layers(torch.nn.Linear(2, 2))


def test_layers_gathered_in_bf16_keep_float32_shards_and_state(tiny_checkpoint, tmp_path):
    """``cluster.trainer.fsdp_param_dtype: bfloat16`` (FSDP2's MixedPrecisionPolicy): the
    layers run in bf16 (half the all-gather bytes), the shards, AdamW moments and gradient
    reduction stay float32, and the losses follow the one-process bf16-autocast update's."""
    from ddp_cases import auto_decisions, bf16_update, run_bf16_sharded

    from grpo_core.training.checkpoint import load_checkpoint
    from grpo_core.training.distributed import spawn

    one = bf16_update(str(tiny_checkpoint))
    spawn(run_bf16_sharded, WORLD, str(tiny_checkpoint), str(tmp_path))
    ranks = [torch.load(tmp_path / f"bf16-rank{r}.pt") for r in range(WORLD)]
    for r in ranks:
        assert r["ran_in"] == ["torch.bfloat16"]
        assert r["shards"] == r["moments"] == ["torch.float32"]
        assert r["losses"] == pytest.approx(one["losses"], rel=2e-2)
    assert ranks[0]["losses"] == ranks[1]["losses"]
    # the auto rules see the bf16 compute, not the float32 shards (issue 41): a float32 hf
    # file is not the trainer's numbers, so old log-probs are recomputed and the correction on
    for r in ranks:
        assert r["auto"] == {"compute_dtype": "bfloat16", "correction": True,
                             "old_logprobs": "recompute"}  # fmt: skip
    model, _ = load_checkpoint(str(tiny_checkpoint))
    assert auto_decisions(model) == {"compute_dtype": "float32", "correction": False,
                                     "old_logprobs": "sampler"}  # fmt: skip

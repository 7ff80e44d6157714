"""Training at size: bf16 autocast with float32 master weights and log-probs, fp16's and 8-bit
AdamW's requirements, the optimizer over trainable parameters only, SFT with a token budget,
and the peak memory each stage reports."""

import copy
import json

import pytest
import torch

from grpo_core.algorithm.update import build_batch, completion_logprobs, grpo_update
from grpo_core.config.loss import LossConfig, UpdateConfig
from grpo_core.config.stages import RLConfig, SFTConfig
from grpo_core.logprobs.precision import Precision
from grpo_core.training.memory import PeakMemory
from grpo_core.training.optim import build_optimizer

PROMPTS = [[3, 12, 13, 4]] * 4
COMPLETIONS = [[5, 12, 6, 7, 2], [5, 13, 2], [5, 6, 7, 8, 12, 2], [5, 2]]


def _batch():
    return build_batch(PROMPTS, COMPLETIONS, [1.0, -1.0, 0.5, -0.5], 0, group_ids=[0, 0, 1, 1])


def _update(model, **kw):
    model = copy.deepcopy(model)
    opt = build_optimizer(model, "adamw_torch", lr=1e-3)
    cfg = UpdateConfig(loss=LossConfig(loss_type="bnpo"), steps_per_generation=2, **kw)
    return model, grpo_update(model, opt, None, _batch(), cfg)


def test_bf16_autocast_keeps_float32_weights_and_logprobs(tiny_model):
    model, _ = tiny_model
    with Precision.for_model(model, bf16=True).autocast():
        logp, ent = completion_logprobs(model, _batch(), with_entropy=True)
    assert logp.dtype == ent.dtype == torch.float32
    ref, _ = completion_logprobs(model, _batch())
    torch.testing.assert_close(logp, ref, rtol=0.05, atol=0.05)  # bf16 decoder, close
    trained, hist = _update(model, bf16=True, max_tokens_per_microbatch=16)
    _, hist32 = _update(model)
    assert all(p.dtype == torch.float32 for p in trained.parameters())
    assert len(hist) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in hist)
    assert hist[0]["entropy"] == pytest.approx(hist32[0]["entropy"], rel=0.05)


def test_fp16_needs_cuda_and_master_weights_must_be_float32(tiny_model):
    model, _ = tiny_model
    with pytest.raises(ValueError, match=r"rl.fp16 needs a CUDA device .*use rl.bf16"):
        _update(model, fp16=True)
    with pytest.raises(ValueError, match=r"float32 master weights.*model.dtype: float32"):
        _update(copy.deepcopy(model).bfloat16(), bf16=True)
    with pytest.raises(ValueError, match="both true"):
        RLConfig(bf16=True, fp16=True)
    with pytest.raises(ValueError, match="both true"):
        SFTConfig(bf16=True, fp16=True)


def test_rl_section_reaches_the_update_config():
    cfg = RLConfig(max_tokens_per_microbatch=4096, bf16=True, lm_head="logits").update_config()
    assert (cfg.max_tokens_per_microbatch, cfg.bf16, cfg.fp16, cfg.lm_head) == (
        4096,
        True,
        False,
        "logits",
    )


def test_optimizer_choice(tiny_model):
    model, _ = tiny_model
    with pytest.raises(ValueError, match=r"adamw_bnb_8bit' needs a CUDA device.*adamw_torch"):
        build_optimizer(model, "adamw_bnb_8bit", lr=1e-3, section="sft")
    with pytest.raises(ValueError, match="optim must be one of"):
        build_optimizer(model, "sgd", lr=1e-3)
    frozen = copy.deepcopy(model)
    for name, p in frozen.named_parameters():
        p.requires_grad_("layers.1" in name)
    opt = build_optimizer(frozen, "adamw_torch", lr=1e-3)
    trainable = {id(p) for p in frozen.parameters() if p.requires_grad}
    assert {id(p) for g in opt.param_groups for p in g["params"]} == trainable


def test_peak_memory_sees_an_allocation_of_the_stage():
    with PeakMemory() as mem:
        x = torch.ones(2**26)  # 256 MiB
        x += 1
    assert mem.gib >= 0.25


def test_sft_stage_with_budget_bf16_reports_peak_memory(tiny_checkpoint, tmp_path):
    from grpo_core.demo.task import make_splits
    from tasks.policies.trainer import open_trainer
    from tasks.sft import SFTRequest, train_stage

    rows = make_splits(digits=2, n_sft=16, n_rl=1, n_dev=0, n_eval=1, seed=0).sft
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = SFTConfig(max_steps=3, batch_size=8, bf16=True, max_tokens_per_microbatch=64)
    open_trainer().forget()
    out = train_stage(
        SFTRequest("sft", str(tiny_checkpoint), str(data), str(tmp_path / "out"), cfg)
    )
    assert out.steps == 3 and out.peak_memory_gib > 0
    assert torch.isfinite(torch.tensor(out.final_loss))
    open_trainer().forget()

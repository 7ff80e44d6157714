"""The GRPO update's inputs cross to the model's device in one place (issue 40).

The batch comes from Parquet on the host (``build_batch``: ids, masks, advantages, the
sampler's log-probs); ``grpo_update`` moves it once, with ``UpdateBatch.to``, and makes every
derived tensor (old log-probs, importance weights, row indices, normalisers) where the batch
then is. Each case below builds the update's inputs the way one path builds them and checks
every tensor that reaches the model's forward and the loss is on the model's device. On a CPU
every device is the CPU (the cases still check the crossing happens once); on a CUDA machine
the ``cuda`` cases run the same paths on the GPU, where a tensor left behind crashes.
"""

from __future__ import annotations

import pytest
import torch

from grpo_core.algorithm import micro_batch as micro_batch_module
from grpo_core.algorithm.batch import build_batch
from grpo_core.algorithm.update import grpo_update, model_device
from grpo_core.config.loss import EngineCorrection, LossConfig, UpdateConfig
from grpo_core.contracts.batch import UpdateBatch

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ),
]

PROMPTS = [[3, 12, 13, 4]] * 8
COMPLETIONS = [
    [5, 12, 6, 7, 13, 8, 2],
    [5, 13, 6, 7, 12, 8, 2],
    [5, 12, 12, 6, 2],
    [5, 6, 7, 8, 2],
    [5, 12, 6, 2],
    [5, 13, 6, 7, 12, 8, 12, 6, 2],
    [5, 6, 2],
    [5, 7, 8, 12, 13, 2],
]
# groups 1 and 3 have zero advantages: skip_zero_advantage's live-row path runs
ADV = [1.0, -1.0, 0.0, 0.0, 1.2, -1.2, 0.0, 0.0]

CASES = {
    "recomputed old log-probs (live rows)": dict(steps_per_generation=2),
    "recomputed, several passes": dict(num_iterations=2),
    "sampler log-probs": dict(steps_per_generation=2, old_logprobs="sampler"),
    "engine importance weights": dict(
        steps_per_generation=2, engine_correction=EngineCorrection(mode="token_truncate")
    ),
    "async stale rows (AReaL)": dict(
        steps_per_generation=2,
        engine_correction=EngineCorrection(mode="sequence_mask"),
        bf16=True,
    ),
    "reference model (beta > 0)": dict(loss=LossConfig(beta=0.04), steps_per_generation=2),
    "token budget": dict(steps_per_generation=2, max_tokens_per_microbatch=24),
    "top-entropy mask": dict(steps_per_generation=2, top_entropy_quantile=0.5),
}


def _model(device: str, *, lora: bool = False):
    from grpo_core.demo.model import build_model, build_tokenizer

    torch.manual_seed(0)
    tok = build_tokenizer()
    model = build_model(tok, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64)  # fmt: skip
    if lora:
        from grpo_core.config.stages import LoraConfig
        from grpo_core.training.lora import attach_adapter

        model = attach_adapter(model, LoraConfig(r=4, alpha=8, target_modules="all-linear"))
    return model.to(device), tok


def _host_batch(pad_id: int) -> UpdateBatch:
    """As the update task reads a scored file: every tensor on the host."""
    sampling = [[-1.5 + 0.01 * j for j in range(len(c))] for c in COMPLETIONS]
    return build_batch(PROMPTS, COMPLETIONS, ADV, pad_id, group_ids=[0, 0, 1, 1, 2, 2, 3, 3],
                       sampling_logprobs=sampling)  # fmt: skip


def _watch(model, monkeypatch) -> list[str]:
    """Every tensor the model's forward and the loss get that is not on the model's device,
    and every ``UpdateBatch.to`` call."""
    device = model_device(model)
    seen: list[str] = []

    def check(where: str, values) -> None:
        for v in values:
            if isinstance(v, torch.Tensor) and v.device != device:
                seen.append(f"{where}: {tuple(v.shape)} on {v.device}")

    def pre_hook(module, args, kwargs):
        check(type(module).__name__, [*args, *kwargs.values()])

    handles = [
        m.register_forward_pre_hook(pre_hook, with_kwargs=True)
        for m in model.modules()
        if type(m).__name__.endswith(("ForCausalLM", "Model"))
    ]
    real_loss = micro_batch_module.policy_loss

    def loss(*args, **kwargs):
        check("policy_loss", [*args, *kwargs.values()])
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(micro_batch_module, "policy_loss", loss)
    real_to = UpdateBatch.to

    def to(self, device):
        seen.append(f"UpdateBatch.to({device})")
        return real_to(self, device)

    monkeypatch.setattr(UpdateBatch, "to", to)
    return seen, handles


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_every_tensor_meets_the_model_on_its_device(case, device, monkeypatch):
    model, tok = _model(device)
    ref = None
    knobs = dict(CASES[case])
    if knobs.get("loss") is not None and knobs["loss"].beta > 0:
        ref, _ = _model(device)
    cfg = UpdateConfig(**knobs)
    seen, handles = _watch(model, monkeypatch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    try:
        hist = grpo_update(model, opt, None, _host_batch(tok.pad_token_id), cfg, ref_model=ref)
    finally:
        for h in handles:
            h.remove()
    crossings = [s for s in seen if s.startswith("UpdateBatch.to")]
    assert crossings == [f"UpdateBatch.to({model_device(model)})"], seen
    assert [s for s in seen if not s.startswith("UpdateBatch.to")] == []
    assert hist and all(torch.isfinite(torch.tensor(h["loss"])) for h in hist)


@pytest.mark.parametrize("device", DEVICES)
def test_lora_update_meets_the_model_on_its_device(device, monkeypatch):
    pytest.importorskip("peft")
    from grpo_core.training.lora import reference_of

    model, tok = _model(device, lora=True)
    cfg = UpdateConfig(loss=LossConfig(beta=0.04), steps_per_generation=2, bf16=True)
    seen, handles = _watch(model, monkeypatch)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    try:
        hist = grpo_update(
            model, opt, None, _host_batch(tok.pad_token_id), cfg, ref_model=reference_of(model)
        )
    finally:
        for h in handles:
            h.remove()
    assert [s for s in seen if not s.startswith("UpdateBatch.to")] == []
    assert len(hist) == 2


def test_batch_to_moves_every_tensor_once():
    batch = _host_batch(0)
    assert batch.to("cpu") is batch  # already there: no copy
    meta = batch.to("meta")
    tensors = [meta.input_ids, meta.attention_mask, meta.completion_ids, meta.completion_mask,
               meta.advantages, meta.group_ids, meta.sampling_logp]  # fmt: skip
    assert all(t.device.type == "meta" for t in tensors)
    assert meta.prompt_width == batch.prompt_width

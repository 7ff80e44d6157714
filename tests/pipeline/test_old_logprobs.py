"""rl.old_logprobs: the hf sampler's stored log-probs stand in for the old log-prob pass when
they are the same numbers (same policy, float32, unprocessed distribution), and the update then
gives the recompute path's weights; anything that may differ recomputes."""

from __future__ import annotations

import pytest
import torch

from grpo_core.logprobs.old import old_logprobs_source

SAFE_META = {
    "engine": "hf",
    "dtype": "float32",
    "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0},
}


def _source(mode="auto", meta=SAFE_META, **kw):
    args = dict(
        file_meta=meta,
        policy_ids={"p"},
        policy_id="p",
        temperature=1.0,
        model_dtype="float32",
    )
    return old_logprobs_source(mode, **{**args, **kw})[0]


def test_auto_takes_the_sampler_only_when_nothing_differs():
    assert _source() == "sampler"
    assert _source("recompute") == "recompute"
    sampling = SAFE_META["sampling"]
    differing = [
        {"meta": {**SAFE_META, "engine": "vllm"}},
        {"meta": {k: v for k, v in SAFE_META.items() if k != "dtype"}},  # older rollout file
        {"meta": {**SAFE_META, "dtype": "bfloat16"}},
        {"meta": {**SAFE_META, "sampling": {**sampling, "top_k": 8}}},
        {"meta": {**SAFE_META, "sampling": {**sampling, "repetition_penalty": 1.1}}},
        {"meta": {**SAFE_META, "sampling": {**sampling, "temperature": 0.7}}},
        {"meta": {}},
        {"policy_ids": {"p", "q"}},
        {"policy_id": "q"},
        {"model_dtype": "bfloat16"},
        {"bf16": True},
        {"fp16": True},
        {"quantized": True},
        {"disable_dropout": False},
        {"engine_correction": True},
    ]
    for kw in differing:
        assert _source(**kw) == "recompute", kw
    assert _source("sampler", model_dtype="bfloat16") == "sampler"  # as asked
    with pytest.raises(ValueError, match="ratio would be 1"):
        _source("sampler", engine_correction=True)
    with pytest.raises(ValueError, match="old_logprobs must be one of"):
        _source("sometimes")


def test_config_refuses_sampler_with_the_engine_correction():
    from grpo_core.config.stages import RLConfig

    assert RLConfig().old_logprobs == "auto"
    with pytest.raises(ValueError, match="rl.old_logprobs=sampler with rl.vllm_importance"):
        RLConfig(old_logprobs="sampler", vllm_importance_sampling_correction=True)


def parity_reward(prompts, completions, **_):
    return [float(len(c) % 2) for c in completions]


@pytest.fixture
def count_recomputes(monkeypatch):
    """Counts the no-grad log-prob passes of grpo_update (the real function still runs)."""
    import grpo_core.algorithm.update as update_mod

    calls = []
    real = update_mod.batched_logprobs

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(update_mod, "batched_logprobs", counted)
    return calls


def _rollout_and_score(checkpoint, tmp_path) -> str:
    from tasks.policies.trainer import open_trainer
    from tasks.rollout import sample_rollouts
    from tasks.score import score_file

    open_trainer().forget()
    rows = [{"prompt": f"{a}+{a + 1}="} for a in range(4)]
    rollouts = tmp_path / "rollouts.parquet"
    sample_rollouts(
        str(checkpoint),
        rows,
        str(rollouts),
        num_generations=4,
        temperature=1.0,
        max_completion_length=12,
        iteration=0,
        seed=3,
    )
    scored = tmp_path / "scored.parquet"
    score_file(str(rollouts), str(scored), {f"{__file__}:parity_reward": 1.0})
    return str(scored)


def _update(checkpoint, scored, out, **knobs):
    from grpo_core.config.stages import RLConfig
    from grpo_core.training.checkpoint import load_checkpoint
    from tasks.policies.trainer import open_trainer
    from tasks.update import UpdateRequest, update_from_file

    rl = RLConfig(
        prompts_per_iteration=4,
        num_generations=4,
        steps_per_generation=2,
        learning_rate=1e-2,
        max_completion_length=12,
        **knobs,
    )
    open_trainer().forget()  # each path starts from the checkpoint on disk
    up = update_from_file(UpdateRequest(str(checkpoint), scored, str(out), rl, total_steps=2))
    assert len(up.history) == 2
    return load_checkpoint(out)[0].state_dict()


def test_sampler_old_logprobs_give_the_recompute_paths_weights(
    tiny_checkpoint, tmp_path, count_recomputes
):
    """Two optimizer steps on one generation batch (old log-probs needed): ``auto`` skips
    the no-grad pass and ends at the recompute path's weights within float32 tolerance;
    a bf16 update under ``auto`` still recomputes."""
    scored = _rollout_and_score(tiny_checkpoint, tmp_path)
    auto = _update(tiny_checkpoint, scored, tmp_path / "auto")
    assert count_recomputes == []  # the sampler's log-probs were used
    again = _update(tiny_checkpoint, scored, tmp_path / "recompute", old_logprobs="recompute")
    assert count_recomputes == [1]
    moved = max(float((auto[k] - v).abs().max()) for k, v in _initial(tiny_checkpoint).items())
    assert moved > 1e-3  # the update did change the weights
    for k, v in again.items():
        # Adam normalises each step: 1e-5 is 0.1% of one step at this learning rate
        torch.testing.assert_close(auto[k], v, rtol=1e-5, atol=1e-5)
    _update(tiny_checkpoint, scored, tmp_path / "bf16", bf16=True)
    assert count_recomputes == [1, 1]


def _initial(checkpoint):
    from grpo_core.training.checkpoint import load_checkpoint

    return load_checkpoint(checkpoint)[0].state_dict()


def _correction(setting="auto", meta=SAFE_META, **kw):
    from grpo_core.logprobs.old import engine_correction_choice

    return engine_correction_choice(setting, file_meta=meta, model_dtype="float32", **kw)


def test_the_engine_correction_is_on_by_default_where_engine_and_trainer_differ():
    on, why = _correction()
    assert not on and "hf engine" in why  # the demo: the trainer's own float32 module sampled
    vllm_bf16 = {**SAFE_META, "engine": "vllm", "dtype": "bfloat16"}
    for case in (
        {"meta": vllm_bf16},  # configs/gpu.yaml
        {"meta": {**SAFE_META, "engine": "vllm"}},
        {"bf16": True},
        {"quantized": True},
    ):
        on, why = _correction(**case)
        assert on and why.startswith("auto: "), case
    # a filtered distribution would make the ratios collapse; sampler old log-probs make them 1
    top_k = {**vllm_bf16, "sampling": {**SAFE_META["sampling"], "top_k": 8}}
    on, why = _correction(meta=top_k)
    assert not on and "collapse" in why
    assert not _correction(meta=vllm_bf16, old_logprobs="sampler")[0]
    # an explicit setting is taken as set
    assert _correction(False, meta=vllm_bf16) == (
        False,
        "rl.vllm_importance_sampling_correction=False",
    )
    assert _correction(True)[0]


def test_sampler_old_logprobs_are_used_with_one_optimizer_step(tiny_model):
    """TRL's default layout (one optimizer step per generation batch, num_iterations 1) with
    old_logprobs='sampler': the ratio is against the sampler's log-probs, not 1 (issue 41)."""
    import copy

    from grpo_core.algorithm.update import build_batch, grpo_update
    from grpo_core.config.loss import LossConfig, UpdateConfig

    model, tok = tiny_model
    prompts = [[3, 12, 13, 4]] * 4
    comps = [[5, 12, 6, 2], [5, 13, 6, 7, 2], [5, 6, 2], [5, 7, 8, 2]]
    adv = [1.0, -1.0, 0.5, -0.5]
    results = []
    for shift in (0.0, -0.5):  # the sampler saw these tokens as likelier / less likely
        m = copy.deepcopy(model)
        samp = [[-1.0 + shift] * len(c) for c in comps]
        batch = build_batch(prompts, comps, adv, tok.pad_token_id, group_ids=[0, 0, 1, 1],
                            sampling_logprobs=samp)  # fmt: skip
        cfg = UpdateConfig(loss=LossConfig(epsilon=0.2), old_logprobs="sampler")
        hist = grpo_update(m, torch.optim.SGD(m.parameters(), lr=0.1), None, batch, cfg)
        assert len(hist) == 1
        results.append((hist[0]["clip_ratio/region_mean"], m.lm_head.weight.detach().clone()))
    # ratios far from 1 are clipped, and the two sampler views give different updates
    assert results[0][0] > 0 or results[1][0] > 0
    assert not torch.equal(results[0][1], results[1][1])

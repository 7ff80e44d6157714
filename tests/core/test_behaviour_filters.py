"""The behaviour weight under a processed sampling distribution (issue 51, item 9): rows
sampled with ``top_p``/``top_k`` are weighed against the policy's own softmax, not the
filtered one, so a row the updated policy sampled weighs exactly 1 (ESS 1) and a stale row
weighs ``pi_prox / pi_stale``, the filter's kept mass left out. Before the fix a fresh row
weighed the kept mass (about 0.91 at top_p 0.9, 0.41 at top_k 8 on this model) and the ESS
still read 1."""

from __future__ import annotations

import copy

import pytest
import torch

from grpo_core.algorithm.importance import behaviour_weights
from grpo_core.algorithm.scored_batch import ScoredRows
from grpo_core.algorithm.update import grpo_update
from grpo_core.config.loss import BehaviourWeight, LossConfig, UpdateConfig
from grpo_core.contracts.rollouts import POLICY_LOGPROBS, rollout_table, scored_table
from grpo_core.engines.generation import SamplingParams, generate
from grpo_core.logprobs.batch import batched_logprobs
from grpo_core.logprobs.old import behaviour_logprobs_gap

ROWS = [{"prompt": f"{a}+{a + 1}="} for a in range(4)]
FILTERS = [{"top_p": 0.9}, {"top_k": 8}]


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    """The policy being updated and an older one (the sampler of stale rows)."""
    from grpo_core.training.checkpoint import load_checkpoint

    model, tok = load_checkpoint(tiny_checkpoint)
    stale = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    return model, stale, tok


def _rows(sampler, tok, decode="dynamic", **filters) -> ScoredRows:
    """``sampler``'s rollouts of ROWS through the Parquet contract, as the update reads them."""
    ids = [tok(r["prompt"])["input_ids"] for r in ROWS]
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=3, **filters)
    samples = generate(sampler, ids, params, pad_token_id=tok.pad_token_id,
                       eos_token_ids=tok.eos_token_id, progress=False, decode=decode)  # fmt: skip
    table = rollout_table(ROWS, ids, samples, tok, policy_id="p", iteration=0,
                          metadata={"engine": "hf", "sampling": params.__dict__})  # fmt: skip
    n = table.num_rows
    scored = scored_table(table, {}, {}, [0.0] * n, [1.0, -1.0] * (n // 2))
    return ScoredRows.of_table(scored)


def _weights(model, rows: ScoredRows, pad_id: int):
    batch = rows.batch(pad_id, mask_truncated=False, sampling_logprobs=True)
    model.train()
    prox = batched_logprobs(model, batch, temperature=1.0)  # [N, T] the trainer's
    w, metrics = behaviour_weights(prox, batch.sampling_logp, batch.completion_mask,
                                   mode="token_truncate", cap=5.0)  # fmt: skip
    return w, metrics, batch


@pytest.mark.parametrize("decode", ["dynamic", "static"])
@pytest.mark.parametrize("filters", FILTERS, ids=["top_p0.9", "top_k8"])
def test_fresh_rows_weigh_one_and_stale_rows_their_policy_ratio(models, filters, decode):
    model, stale, tok = models
    fresh = _rows(model, tok, decode, **filters)
    w, metrics, batch = _weights(model, fresh, tok.pad_token_id)
    on = batch.completion_mask.bool()
    torch.testing.assert_close(w[on], torch.ones_like(w[on]), rtol=0, atol=1e-5)
    assert metrics["sampling/behaviour_weight/ess"] == pytest.approx(1.0, abs=1e-9)
    assert POLICY_LOGPROBS in fresh.table.column_names
    # the processed log-probs are still the file's completion_logprobs: above the policy's
    sampled = torch.tensor(sum(rows_logprobs(fresh, "completion_logprobs"), []))
    own = torch.tensor(sum(rows_logprobs(fresh, POLICY_LOGPROBS), []))
    assert bool((sampled >= own - 1e-6).all()) and bool((sampled > own + 1e-3).any())

    old = _rows(stale, tok, decode, **filters)
    w, metrics, batch = _weights(model, old, tok.pad_token_id)
    stale.train()
    mu = batched_logprobs(stale, batch, temperature=1.0)  # the stale policy's own softmax
    model.train()
    prox = batched_logprobs(model, batch, temperature=1.0)
    on = batch.completion_mask.bool()
    want = torch.exp(prox - mu).clamp(max=5.0)
    torch.testing.assert_close(w[on], want[on], rtol=1e-4, atol=1e-5)
    assert 0.9 < metrics["sampling/behaviour_weight/mean"] < 1.1  # no kept mass in it
    assert metrics["sampling/behaviour_weight/ess"] < 0.999  # staleness shows


def rows_logprobs(rows: ScoredRows, column: str) -> list[list[float]]:
    return rows.table.column(column).to_pylist()


def test_the_logged_ess_of_fresh_top_k_rows_is_one(models):
    """Through ``grpo_update``: the step's logged behaviour weight metrics."""
    model, _, tok = models
    m = copy.deepcopy(model)
    batch = _rows(m, tok, top_k=8).batch(tok.pad_token_id, mask_truncated=False,
                                          sampling_logprobs=True)  # fmt: skip
    cfg = UpdateConfig(loss=LossConfig(), behaviour_weight=BehaviourWeight(mode="token_mask"))
    (step,) = grpo_update(m, torch.optim.SGD(m.parameters(), lr=0.0), None, batch, cfg)
    assert step["sampling/behaviour_weight/mean"] == pytest.approx(1.0, abs=1e-5)
    assert step["sampling/behaviour_weight/min"] == pytest.approx(1.0, abs=1e-5)
    assert step["sampling/behaviour_weight/ess"] == pytest.approx(1.0, abs=1e-9)


def test_an_unprocessed_distribution_writes_no_new_column(models):
    """top_p=1, top_k=0 (the demo's): the file and its log-probs are as before."""
    model, _, tok = models
    rows = _rows(model, tok)
    assert POLICY_LOGPROBS not in rows.table.column_names
    batch = rows.batch(tok.pad_token_id, mask_truncated=False, sampling_logprobs=True)
    want = rows_logprobs(rows, "completion_logprobs")
    for i, lp in enumerate(want):
        assert batch.sampling_logp[i, : len(lp)].tolist() == torch.tensor(lp).tolist()


def test_a_file_without_the_policy_logprobs_is_named():
    """vLLM's rows or an older file under top_p: read as before, and the gap is said."""
    meta = {"engine": "vllm", "sampling": {"temperature": 1.0, "top_p": 0.9, "top_k": 0}}
    why = behaviour_logprobs_gap(meta, policy_logprobs=False)
    assert why is not None and "top_p" in why and "kept mass" in why
    assert behaviour_logprobs_gap(meta, policy_logprobs=True) is None
    neutral = {"engine": "vllm", "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0}}
    assert behaviour_logprobs_gap(neutral, policy_logprobs=False) is None


def test_the_engine_correction_is_not_turned_off_when_the_policy_logprobs_are_there():
    """``auto`` with bf16 rows: off under top_k with only the processed log-probs (its ratio
    would collapse), on when the file has the policy's own."""
    from grpo_core.logprobs.old import engine_correction_choice

    meta = {"engine": "hf", "dtype": "bfloat16", "sampling": {"temperature": 1.0, "top_k": 8}}
    on, why = engine_correction_choice("auto", file_meta=meta, model_dtype="float32")
    assert not on and "processed" in why
    on, _ = engine_correction_choice("auto", file_meta=meta, model_dtype="float32",
                                     policy_logprobs=True)  # fmt: skip
    assert on

"""N data-parallel ranks (gloo, CPU) make the update of one process: same weights within fp32
tolerance after one iteration of several optimizer steps, same reported metrics, for every
loss_type, with a reference model and a token budget, and with uneven shards."""

from __future__ import annotations

import math

import pytest
import torch
from ddp_cases import batch, cases, run_all, run_case, spawn_all

from grpo_core.algorithm.update import grpo_update
from grpo_core.config.loss import UpdateConfig
from grpo_core.training.checkpoint import load_checkpoint
from grpo_core.training.distributed import DataParallel, process_group

WORLD = 2
METRICS = ("loss", "policy_loss", "kl", "entropy", "entropy/trained_rows", "clip_ratio/region_mean")
METRICS += ("grad_norm",)
ENGINE_METRICS = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)


@pytest.fixture(scope="module")
def parallel_results(tiny_checkpoint, tmp_path_factory):
    return spawn_all(run_all, WORLD, str(tiny_checkpoint), tmp_path_factory.mktemp("ddp"))


@pytest.mark.parametrize("name", list(cases()))
def test_two_ranks_make_the_update_of_one_process(tiny_checkpoint, parallel_results, name):
    weights, history = run_case(name, str(tiny_checkpoint))
    before = load_checkpoint(tiny_checkpoint)[0].state_dict()
    assert len(history) >= 1
    rank0, rank1 = (r[name, "plain"] for r in parallel_results)
    moved = max(float((weights[k] - before[k]).abs().max()) for k in weights)
    assert moved > 1e-4  # the update really changed the weights
    for k in weights:
        # replicas stay identical; and equal to the one-process weights within fp32 tolerance
        assert torch.equal(rank0[0][k], rank1[0][k]), k
        torch.testing.assert_close(rank0[0][k], weights[k], rtol=1e-5, atol=1e-6, msg=k)
    assert rank0[1] == rank1[1]  # every rank reports the same metrics
    assert len(rank0[1]) == len(history)
    for one, par in zip(history, rank0[1], strict=True):
        assert "entropy" in par  # TRL's headline curve, on replicas too (issue 41)
        for key in METRICS + ENGINE_METRICS:
            if key in one:
                assert math.isclose(par[key], one[key], rel_tol=1e-4, abs_tol=1e-6), key


def test_top_entropy_mask_is_refused_with_data_parallel(tiny_checkpoint):
    model, tok = load_checkpoint(tiny_checkpoint)
    cfg = UpdateConfig(top_entropy_quantile=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        grpo_update(model, opt, None, batch(2, tok.pad_token_id), cfg, data_parallel=DataParallel())


def test_process_group_names_the_missing_launcher_variables(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(RuntimeError, match="torchrun"), process_group("gloo"):
        pass


def test_the_ess_over_ranks_is_the_whole_batchs_not_a_mean(tmp_path):
    """Two ranks, one with equal weights (ESS 1.0) and one with spread ones: the logged ESS
    is Kish's over all tokens of the batch, not the mean of the ranks' values."""
    import json

    from ddp_cases import ess_over_ranks

    from grpo_core.algorithm.importance import effective_sample_share
    from grpo_core.training.distributed import spawn

    spawn(ess_over_ranks, 2, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    whole = effective_sample_share(torch.tensor(ranks[0]["w"] + ranks[1]["w"]))
    mean = sum(r["local"]["sampling/behaviour_weight/ess"] for r in ranks) / 2
    assert ranks[0]["ess"] == ranks[1]["ess"] == pytest.approx(whole, rel=1e-9)
    assert abs(whole - mean) > 0.05  # what the old mean would have logged differs

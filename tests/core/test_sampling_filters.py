"""grpo_core.sampling_filters: DAPO filters and the entropy mask."""

import pytest
import torch

from grpo_core.sampling_filters import (
    DynamicSamplingBuffer,
    dynamic_sampling_mask,
    mask_truncated_completions,
    overlong_penalty,
    top_entropy_mask,
)


def test_mask_truncated_completions():
    mask = torch.ones(3, 2)
    out = mask_truncated_completions(mask, torch.tensor([False, True, False]))
    torch.testing.assert_close(out, torch.tensor([[1.0, 1], [0, 0], [1, 1]]))


def test_overlong_penalty_hand():
    # L_max = 10, L_cache = 4: free up to 6; 8 -> (6 - 8) / 4 = -0.5; 10 -> -1; 11 -> -1
    out = overlong_penalty(torch.tensor([3, 6, 7, 8, 10, 11]), 10, 4)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    with pytest.raises(ValueError):
        overlong_penalty(torch.tensor([1]), 10, 0)


def test_dynamic_sampling_mask_drops_equal_groups():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, float("nan"), 1.0])
    g = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    # group 0 all 1, group 2 all 0, group 3 has one valid reward: dropped
    assert dynamic_sampling_mask(r, g).tolist() == [False, False, True, True] + [False] * 4


def test_dynamic_sampling_buffer_fills_then_stops():
    buf = DynamicSamplingBuffer(target_groups=2, max_rounds=5)
    idx = buf.add(torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    assert idx.tolist() == [2, 3] and not buf.full
    idx = buf.add(torch.tensor([0.0, 1.0, 1.0, 0.0]), torch.tensor([5, 5, 6, 6]))
    assert idx.tolist() == [0, 1] and buf.full  # group 6 is informative but the batch is full
    assert buf.metrics()["dynamic_sampling/rounds"] == 2.0
    assert buf.metrics()["dynamic_sampling/kept_group_frac"] == pytest.approx(2 / 4)


def test_top_entropy_mask_hand():
    # completion entropies [1, 2, 3, 4] (the 9 is padding); top 50% -> threshold quantile(.5)=2.5
    ent = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, 0.5]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    out = top_entropy_mask(ent, mask, 0.5)
    assert out.tolist() == [[False, False, False], [True, True, False]]
    assert top_entropy_mask(ent, mask, 1.0).tolist() == mask.bool().tolist()
    assert not top_entropy_mask(ent, torch.zeros_like(mask), 0.5).any()

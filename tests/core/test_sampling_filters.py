"""grpo_core.algorithm.sampling_filters: DAPO filters and the entropy mask."""

import pytest
import torch

from grpo_core.algorithm.sampling_filters import (
    dynamic_sampling_mask,
    mask_truncated_completions,
    top_entropy_mask,
)


def test_mask_truncated_completions():
    mask = torch.ones(3, 2)
    out = mask_truncated_completions(mask, torch.tensor([False, True, False]))
    torch.testing.assert_close(out, torch.tensor([[1.0, 1], [0, 0], [1, 1]]))


def test_dynamic_sampling_mask_drops_groups_without_advantage():
    adv = torch.tensor([0.0, 0.0, 0.7, -0.7, 0.0, 0.0, 0.0, 1.0])
    g = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    # groups 0 and 2 carry no advantage; group 3 has one row that does
    assert (
        dynamic_sampling_mask(adv, g).tolist()
        == [False, False, True, True] + [False] * 2 + [True] * 2
    )
    with pytest.raises(ValueError):
        dynamic_sampling_mask(adv, g[:3])


def test_top_entropy_mask_hand():
    # completion entropies [1, 2, 3, 4] (the 9 is padding); top 50% -> threshold quantile(.5)=2.5
    ent = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, 0.5]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    out = top_entropy_mask(ent, mask, 0.5)
    assert out.tolist() == [[False, False, False], [True, True, False]]
    assert top_entropy_mask(ent, mask, 1.0).tolist() == mask.bool().tolist()
    assert not top_entropy_mask(ent, torch.zeros_like(mask), 0.5).any()

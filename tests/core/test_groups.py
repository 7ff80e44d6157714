"""How groups are formed and when a group carries no signal (regressions of issue 10).

- "zero variance" is decided once (``advantages.zero_std``, TRL's ``isclose(std, 0)``): eight
  equal rewards of 1.1 (accuracy 1.0 + format 0.1 at weight 0.1) leave a float64 std of ~1e-16
  after the mean, which ``std > 0`` took for a signal;
- a group is one drawn prompt of one iteration (``group_idx``), not one prompt text;
- a batch whose groups are not contiguous cannot be split into optimizer steps.
"""

import pyarrow as pa
import pytest
import torch

from grpo_core.algorithm import advantages as A
from grpo_core.algorithm.sampling_filters import dynamic_sampling_mask
from grpo_core.algorithm.update import build_batch
from grpo_core.contracts.rollouts import group_ids, rollout_table
from grpo_core.engines.generation import Sample

F64 = torch.float64


def _accuracy_and_format(correct: list[float]) -> torch.Tensor:
    """Rows of (accuracy, format=1) for the demo's two reward functions."""
    return torch.tensor([[c, 1.0] for c in correct], dtype=F64)  # [N, 2]


def test_all_correct_group_of_eight_is_zero_variance():
    rpf = _accuracy_and_format([1.0] * 8 + [1.0, 0.0] * 4)  # group 0: eight rewards of 1.1
    gids = torch.tensor([0] * 8 + [1] * 8)
    w = torch.tensor([1.0, 0.1], dtype=F64)
    total = A.weighted_reward_sum(rpf, w)  # [16]
    assert A.group_moments(total, gids).std[0] != 0  # the float residue that fooled `std > 0`

    adv = A.compute_multi(rpf, gids, weights=w)
    assert (adv[:8] == 0).all()
    assert A.group_stats(total, gids)["frac_reward_zero_std"] == pytest.approx(0.5)
    assert dynamic_sampling_mask(adv, gids).tolist() == [False] * 8 + [True] * 8


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_equal_rewards_give_exactly_zero_advantage(name):
    r = torch.tensor([1.1] * 8 + [0.3, 0.7] * 4, dtype=F64)
    gids = torch.tensor([0] * 8 + [1] * 8)
    opts = {} if name == "grpo" else {"scale_rewards": "none"}
    adv = A.compute(name, r, gids, **opts)
    assert (adv[:8] == 0).all() and (adv[8:] != 0).all()


def test_gdpo_group_with_tied_sums_keeps_its_signal():
    # f1 = [2, 0], f2 = [0, 1] at weights [1, 2]: both weighted sums are 2, yet GDPO normalises
    # each function within the group first, so the advantages are +-0.707, not 0.
    rpf = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 1.0]], dtype=F64)
    gids = torch.tensor([0, 0, 1, 1])
    w = torch.tensor([1.0, 2.0], dtype=F64)
    adv = A.compute_multi(rpf, gids, weights=w, aggregation="normalize_then_sum")
    assert (adv[:2] != 0).all() and (adv[2:] == 0).all()
    assert A.informative_groups(rpf, gids, w, "normalize_then_sum").tolist() == [
        True,
        True,
        False,
        False,
    ]
    assert dynamic_sampling_mask(adv, gids).tolist() == [True, True, False, False]


def test_unscorable_rows_are_left_out_of_reward_metrics():
    # row 3: every reward function gave None
    rpf = torch.tensor(
        [[1.0, 1.0], [0.0, 1.0], [1.0, 0.0], [float("nan")] * 2], dtype=torch.float64
    )
    gids = torch.tensor([0, 0, 0, 0])
    w = torch.tensor([1.0, 0.1], dtype=F64)
    total = A.weighted_reward_sum(rpf, w)
    stats = A.group_stats(total, gids)
    assert stats["reward"] == pytest.approx((1.1 + 0.1 + 1.0) / 3)
    assert A.compute_multi(rpf, gids, weights=w)[3] == 0


def _samples(n_prompts: int, n: int) -> list[Sample]:
    return [
        Sample(
            prompt_index=p,
            sample_index=s,
            completion_ids=[5, 6],
            logprobs=[-1.0, -1.0],
            finish_reason="stop",
        )
        for p in range(n_prompts)
        for s in range(n)
    ]


class _Tok:
    """Just what rollout_table needs of a tokenizer."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(str, ids))

    def get_vocab(self, with_added_tokens=False):  # for the file's tokenizer fingerprint
        return {str(i): i for i in range(10)}


def test_same_prompt_drawn_twice_makes_two_groups():
    rows = [{"prompt": "1+1=", "answer": "2"}] * 2  # wrap-around or a duplicated data row
    table = rollout_table(
        rows, [[1, 2], [1, 2]], _samples(2, 4), _Tok(), policy_id="p", iteration=0
    )
    assert table.column("group_idx").to_pylist() == [0] * 4 + [1] * 4
    gids = group_ids(table)
    assert gids == [0] * 4 + [1] * 4
    batch = build_batch(
        table.column("prompt_ids").to_pylist(),
        table.column("completion_ids").to_pylist(),
        [1.0, -1.0] * 4,
        pad_id=0,
        group_ids=gids,
    )
    assert [s.tolist() for s in batch.step_slices(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_files_without_group_idx_with_a_repeated_prompt_are_refused():
    table = pa.table(
        {
            "iteration": [0] * 4,
            "prompt_id": ["a"] * 4,
            "sample_idx": [0, 1, 0, 1],
        }
    )
    with pytest.raises(ValueError, match="group_idx"):
        group_ids(table)
    ok = pa.table({"iteration": [0, 0, 1, 1], "prompt_id": ["a"] * 4, "sample_idx": [0, 1] * 2})
    assert group_ids(ok) == [0, 0, 1, 1]


def test_step_slices_refuse_interleaved_groups():
    batch = build_batch(
        [[1]] * 4, [[2]] * 4, [1.0, 1.0, -1.0, -1.0], pad_id=0, group_ids=[0, 1, 0, 1]
    )
    with pytest.raises(ValueError, match="contiguous"):
        batch.step_slices(2)

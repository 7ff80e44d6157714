"""Scoring and dynamic sampling on real Parquet files (regressions of issue 10).

Rewards come from columns of the rollout file through user reward functions, so each case
states its rewards exactly.
"""

import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpo_core.config.stages import RLConfig
from tasks.score import score_file
from tasks.update import UpdateRequest, update_from_file

HERE = __file__


def column_r1(prompts, completions, r1, **_):
    return list(r1)


def column_r2(prompts, completions, r2, **_):
    return list(r2)


def _rollouts(path, groups: list[list[tuple]]) -> str:
    """One row per (r1, r2, length) of each group; every row is a valid rollout."""
    rows = []
    for g, group in enumerate(groups):
        for s, (r1, r2, n) in enumerate(group):
            rows.append(
                {
                    "prompt_id": f"p{g}",
                    "group_idx": g,
                    "sample_idx": s,
                    "prompt": f"{g}+{g}=",
                    "prompt_text": f"{g}+{g}=",
                    "completion": "x" * n,
                    "prompt_ids": [3, 4, 5],
                    "completion_ids": [6 + (s + k) % 4 for k in range(n)],
                    "completion_logprobs": [-1.0] * n,
                    "completion_length": n,
                    "finish_reason": "stop",
                    "policy_id": "p",
                    "iteration": 0,
                    "r1": r1,
                    "r2": r2,
                }
            )
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _weights(w1, w2):
    return {f"{HERE}:column_r1": w1, f"{HERE}:column_r2": w2}


def test_dynamic_sampling_keeps_gdpo_groups_whose_sums_tie(tiny_checkpoint, tmp_path):
    groups = [
        [(2.0, 0.0, 4), (0.0, 1.0, 5)],  # weighted sums 2 and 2, but GDPO's advantages +-0.7
        [(1.0, 1.0, 4), (1.0, 1.0, 5)],  # nothing varies: dropped
        [(1.0, 0.0, 4), (0.0, 0.0, 5)],  # varies
    ]
    rl = RLConfig(
        prompts_per_iteration=3,
        num_generations=2,
        steps_per_generation=1,
        dynamic_sampling=True,
        multi_objective_aggregation="normalize_then_sum",
    )
    scored = tmp_path / "scored.parquet"
    out = score_file(
        _rollouts(tmp_path / "r.parquet", groups),
        str(scored),
        _weights(1.0, 2.0),
        multi_objective_aggregation="normalize_then_sum",
    )
    adv = pq.read_table(scored).column("advantage").to_pylist()
    assert adv[0] != 0 and adv[2:4] == [0.0, 0.0] and adv[4] != 0
    assert out.metrics["frac_reward_zero_std"] == pytest.approx(1 / 3)
    up = update_from_file(
        UpdateRequest(str(tiny_checkpoint), str(scored), str(tmp_path / "ckpt"), rl)
    )
    assert up.history[0]["dynamic_sampling/kept_frac"] == pytest.approx(4 / 6)


def test_all_correct_group_of_non_dyadic_rewards_is_dropped(tiny_checkpoint, tmp_path):
    # accuracy 1.0 + format 0.1: eight rewards of 1.1 in group 0
    groups = [[(1.0, 1.0, 4)] * 8, [(1.0, 1.0, 4), (0.0, 1.0, 5)] * 4]
    rl = RLConfig(
        prompts_per_iteration=2, num_generations=8, steps_per_generation=1, dynamic_sampling=True
    )
    scored = tmp_path / "scored.parquet"
    out = score_file(_rollouts(tmp_path / "r.parquet", groups), str(scored), _weights(1.0, 0.1))
    assert out.metrics["frac_reward_zero_std"] == pytest.approx(0.5)
    up = update_from_file(
        UpdateRequest(str(tiny_checkpoint), str(scored), str(tmp_path / "ckpt"), rl)
    )
    assert up.history[0]["dynamic_sampling/kept_frac"] == pytest.approx(0.5)


def test_unscorable_rows_stay_null_and_out_of_the_reward_metrics(tmp_path):
    groups = [[(1.0, 1.0, 4), (None, None, 4), (0.0, 1.0, 4)]]
    scored = tmp_path / "scored.parquet"
    out = score_file(_rollouts(tmp_path / "r.parquet", groups), str(scored), _weights(1.0, 0.1))
    t = pq.read_table(scored)
    assert t.column("reward").to_pylist() == pytest.approx([1.1, None, 0.1])
    assert t.column("advantage").to_pylist()[1] == 0.0
    assert out.metrics["reward"] == pytest.approx(0.6)  # mean of 1.1 and 0.1; the None row left out
    assert out.metrics["reward_std"] == pytest.approx(math.sqrt(0.5))


def test_overlong_penalty_is_a_reward_column_with_its_own_weight(tmp_path):
    # L_max = 8, L_cache = 4: lengths 4 -> 0, 6 -> -0.5, 8 -> -1
    groups = [[(1.0, 0.0, 4), (1.0, 0.0, 6), (1.0, 0.0, 8)]]
    scored = tmp_path / "scored.parquet"
    score_file(
        _rollouts(tmp_path / "r.parquet", groups),
        str(scored),
        _weights(1.0, 0.5),
        overlong_buffer_length=4,
        overlong_penalty_factor=0.2,
        max_completion_length=8,
    )
    t = pq.read_table(scored)
    assert t.column("reward_overlong_penalty").to_pylist() == [0.0, -0.5, -1.0]
    assert t.column("reward").to_pylist() == pytest.approx([1.0, 0.9, 0.8])
    with pytest.raises(ValueError, match="overlong_penalty"):
        score_file(
            str(tmp_path / "r.parquet"),
            str(tmp_path / "s2.parquet"),
            {"overlong_penalty": 1.0},
            overlong_buffer_length=4,
            max_completion_length=8,
        )


def test_a_file_without_group_idx_is_grouped_by_prompt(tmp_path):
    # written before schema 2, or by another tool: no prompt repeats, so prompt_id groups
    path = _rollouts(tmp_path / "r.parquet", [[(1.0, 0.0, 4), (0.0, 0.0, 4)]] * 2)
    old = pq.read_table(path).drop(["group_idx"]).to_pylist()
    for i, row in enumerate(old):
        row["prompt_id"] = f"p{i // 2}"
    pq.write_table(pa.Table.from_pylist(old), tmp_path / "old.parquet")
    out = score_file(str(tmp_path / "old.parquet"), str(tmp_path / "s.parquet"), _weights(1, 0))
    assert out.metrics["frac_reward_zero_std"] == 0.0

"""A scored file with a NaN advantage is refused before the update, naming the row (issue 41):
one NaN would make every weight NaN in the first optimizer step."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpo_core.algorithm.scored_batch import ScoredRows, _check_finite


def test_nan_advantage_is_refused_with_the_file_and_row(tmp_path):
    with pytest.raises(ValueError, match=r"scored\.parquet: row 2: advantage is nan"):
        _check_finite([0.5, -0.5, float("nan")], tmp_path / "scored.parquet")
    with pytest.raises(ValueError, match="row 0: advantage is inf"):
        _check_finite([float("inf")], "f.parquet")
    _check_finite([0.0, 1.0], "f.parquet")


def test_a_real_scored_file_with_a_nan_is_refused_on_read(tmp_path):
    from test_score_filters import _rollouts, _weights

    from tasks.score import score_file

    good = tmp_path / "good.parquet"
    groups = [[(1.0, 0.0, 4), (0.0, 0.0, 5)], [(1.0, 0.0, 4), (1.0, 0.0, 6)]]
    score_file(_rollouts(tmp_path / "r.parquet", groups), str(good), _weights(1.0, 0.0))
    path = tmp_path / "scored.parquet"
    table = pq.read_table(good)
    adv = table.column("advantage").to_pylist()
    adv[1] = float("nan")
    idx = table.schema.get_field_index("advantage")
    bad = table.set_column(
        idx, table.schema.field(idx), pa.array(adv, table.schema.field(idx).type)
    )
    pq.write_table(bad, path)
    with pytest.raises(ValueError, match="row 1: advantage is nan"):
        ScoredRows.read(str(path))
    assert len(ScoredRows.read(str(good)).keep) == len(adv)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e30, -1e30])
def test_build_batch_refuses_what_would_wreck_the_step(bad):
    """The notebook path (``build_batch`` then ``grpo_update``) checks advantages as the
    file path does: NaN makes every weight NaN; 1e30 overflows the gradient norm, and the
    step left the weights unchanged with loss 0 and no warning."""
    from grpo_core.algorithm.batch import build_batch

    with pytest.raises(ValueError, match=r"build_batch: row 1: advantage is .*within \+-1e\+08"):
        build_batch([[1, 2], [1, 2]], [[3], [4]], [0.5, bad], pad_id=0)
    build_batch([[1, 2], [1, 2]], [[3], [4]], [0.5, -1e6], pad_id=0)


def test_a_scored_file_with_advantages_times_1e30_is_refused(tmp_path):
    from test_score_filters import _rollouts, _weights

    from tasks.score import score_file

    good = tmp_path / "good.parquet"
    groups = [[(1.0, 0.0, 4), (0.0, 0.0, 5)]]
    score_file(_rollouts(tmp_path / "r.parquet", groups), str(good), _weights(1.0, 0.0))
    table = pq.read_table(good)
    idx = table.schema.get_field_index("advantage")
    adv = [a * 1e30 for a in table.column("advantage").to_pylist()]
    field = table.schema.field(idx)
    pq.write_table(table.set_column(idx, field, pa.array(adv, field.type)), tmp_path / "x.parquet")
    with pytest.raises(ValueError, match=r"x\.parquet: row 0: advantage is .*re-score"):
        ScoredRows.read(str(tmp_path / "x.parquet"))

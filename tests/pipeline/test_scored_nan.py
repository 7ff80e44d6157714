"""A scored file with a NaN advantage is refused before the update, naming the row (issue 41):
one NaN would make every weight NaN in the first optimizer step."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpo_core.contracts.scored_batch import ScoredRows, _check_finite


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

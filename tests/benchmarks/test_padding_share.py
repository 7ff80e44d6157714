"""benchmarks/bench_padding.py counts the update's token grid as the update forms it: one
micro-batch's rows x (longest prompt + longest completion), padding columns trimmed, and the
trained rows (non-zero advantage) apart. Hand-counted on a real scored file."""

from __future__ import annotations

from benchmarks.bench_padding import grid_counts, measure
from grpo_core.config.stages import RLConfig
from tasks.score import score_file
from tests.pipeline.test_score_filters import _rollouts, _weights


def test_the_grid_is_counted_as_the_update_forms_it(tmp_path):
    # group 0: rewards 1, 0 (trained), lengths 4, 5; group 1: rewards 1, 1 (advantage 0),
    # lengths 4, 6; every prompt 3 tokens
    groups = [[(1.0, 0.0, 4), (0.0, 0.0, 5)], [(1.0, 0.0, 4), (1.0, 0.0, 6)]]
    stage = tmp_path / "run" / "rl_1" / "iter_0000"
    stage.mkdir(parents=True)
    score_file(_rollouts(tmp_path / "r.parquet", groups), str(stage / "scored.parquet"),
               _weights(1.0, 0.0))  # fmt: skip
    rl = RLConfig(prompts_per_iteration=2, num_generations=2, steps_per_generation=1)
    got = grid_counts(stage / "scored.parquet", rl)
    # one micro-batch: 4 rows x (3 + 6) cells, 3 x 4 + 4 + 5 + 4 + 6 real
    # trained: group 0's 2 rows x (3 + 5), 3 x 2 + 4 + 5 real
    assert got == {"grid": 36, "real": 31, "trained_grid": 16, "trained_real": 15}
    ((name, n, share, trained),) = measure(tmp_path / "run", rl, rl)
    assert (name, n) == ("rl_1", 1) and abs(share - 5 / 36) < 1e-12
    assert abs(trained - 1 / 16) < 1e-12
    # two micro-batches of one group each: 2 x 8 + 2 x 9 cells
    two = grid_counts(stage / "scored.parquet", rl.model_copy(update={"steps_per_generation": 2}))
    assert two["grid"] == 34 and two["real"] == 31

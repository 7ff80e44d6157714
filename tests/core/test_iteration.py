"""One GRPO iteration as plain calls (grpo_core/algorithm/iteration.py), as a notebook runs it, and
the same iteration through the stage tasks' files: the tasks add caching, Parquet and the
executor, not algorithm, so both give the same scores and the same new weights."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from grpo_core.algorithm import iteration
from grpo_core.algorithm.scored_batch import ScoredRows
from grpo_core.config.stages import RLConfig
from grpo_core.contracts.io import write_parquet
from grpo_core.demo.task import make_splits
from grpo_core.engines.hf import HFEngine
from grpo_core.training.checkpoint import load_checkpoint, policy_id
from grpo_core.training.train_state import TrainState
from grpo_core.training.weights_id import savable_state_dict, state_dict_id
from tasks.policies.trainer import open_trainer
from tasks.score import score_file
from tasks.update import UpdateRequest, update_from_file

RL = RLConfig(num_generations=4, max_completion_length=24, steps_per_generation=2,
              learning_rate=1e-2, temperature=1.0)  # fmt: skip
WEIGHTS = {"accuracy": 1.0, "tag_count": 1.0}  # a random model writes some tags


def _notebook(checkpoint, rows):
    """The example of grpo_core/algorithm/iteration.py's docstring."""
    model, tok = load_checkpoint(checkpoint)
    engine = HFEngine(model=model, tokenizer=tok)
    start = policy_id(checkpoint)
    params = RL.sampling.params(RL.num_generations, seed=0)
    rollouts = iteration.sample(engine, tok, rows, params, policy_id=start, progress=False)
    scored = iteration.score(rollouts, WEIGHTS, RL.scoring)
    train = TrainState.fresh(model, RL, seed=0)
    rows_ = ScoredRows.of_table(scored.table)
    update = iteration.update(model, train, rows_, RL, policy_id=start, pad_id=tok.pad_token_id)
    return model, rollouts, scored, update, train


def test_an_iteration_runs_as_plain_calls_and_as_the_stage_tasks(tiny_checkpoint, tmp_path):
    rows = make_splits(0, n_sft=0, n_rl=6, n_dev=0, n_eval=0).rl
    model, rollouts, scored, update, train = _notebook(tiny_checkpoint, rows)
    assert rollouts.num_rows == len(rows) * RL.num_generations
    assert set(scored.table.column_names) >= {"reward", "advantage", "reward_tag_count"}
    assert len(update.history) == train.global_step == update.global_step > 0
    assert train.model is model
    after = state_dict_id(savable_state_dict(model))
    assert after != policy_id(tiny_checkpoint)  # the policy moved

    roll_path, scored_path = tmp_path / "rollouts.parquet", tmp_path / "scored.parquet"
    write_parquet(rollouts, roll_path)
    out = score_file(str(roll_path), str(scored_path), WEIGHTS, RL.scoring)
    on_disk = pq.read_table(scored_path)
    for col in ("reward", "advantage", "reward_accuracy", "reward_tag_count"):
        assert on_disk.column(col).to_pylist() == scored.table.column(col).to_pylist()
    assert out.metrics["reward"] == pytest.approx(scored.metrics["reward"])
    try:
        open_trainer().forget()
        res = update_from_file(
            UpdateRequest(str(tiny_checkpoint), str(scored_path), str(tmp_path / "ck"), RL)
        )
        assert res.policy_id == after  # bit for bit the notebook's weights
        assert [h["loss"] for h in res.history] == [h["loss"] for h in update.history]
    finally:
        open_trainer().forget()

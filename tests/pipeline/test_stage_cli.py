"""Each stage as a CLI command on files: rollout -> score (a new reward mix) -> update -> eval,
through the real Prefect engine (``grpo <stage>`` runs a stage flow)."""

import json

import pyarrow.parquet as pq
import pytest

from grpo_core.contracts.io import write_jsonl
from grpo_core.demo.task import make_splits
from grpo_core.training.checkpoint import file_sha256, policy_id

RL = [
    "rl.prompts_per_iteration=4",
    "rl.num_generations=4",
    "rl.steps_per_generation=2",
    "rl.max_completion_length=8",
    "eval.max_completion_length=8",
]


@pytest.mark.slow
def test_stage_commands_chain_through_files(prefect_harness, tiny_checkpoint, tmp_path, capsys):
    from flows.cli import main

    s = make_splits(0, n_sft=4, n_rl=16, n_dev=1, n_eval=8)
    rl = str(write_jsonl(s.rl, tmp_path / "rl.jsonl"))
    ev = str(write_jsonl(s.eval, tmp_path / "eval.jsonl"))
    sets = [a for o in [*RL, f"output_dir={tmp_path / 'runs'}"] for a in ("--set", o)]

    def grpo(*args):
        assert main([*args, *sets]) == 0
        return json.loads(capsys.readouterr().out)  # the command prints its result as JSON

    rollouts = tmp_path / "r.parquet"
    assert grpo(
        "rollout", "--policy", str(tiny_checkpoint), "--data", rl, "--out", str(rollouts)
    ) == str(rollouts)
    before = file_sha256(rollouts)
    scored = grpo(
        "score", "--rollouts", str(rollouts), "--set", "rewards={format: 1.0, tag_count: 0.5}"
    )
    assert file_sha256(rollouts) == before  # the rollout file is never rewritten
    cols = pq.read_table(scored["path"]).column_names
    assert {"reward_format", "reward_tag_count", "reward", "advantage"} <= set(cols)
    upd = grpo(
        "update",
        "--scored",
        scored["path"],
        "--policy",
        str(tiny_checkpoint),
        "--out",
        str(tmp_path / "u"),
    )
    assert upd["steps"] == 2 and policy_id(upd["checkpoint"]) != policy_id(tiny_checkpoint)
    res = grpo("eval", "--checkpoint", upd["checkpoint"], "--data", ev)
    assert res["num_examples"] == 8 and 0.0 <= res["accuracy"] <= 1.0
    assert pq.read_table(res["table"]).num_rows == 8


def test_bad_config_is_a_clear_cli_error(capsys):
    from flows.cli import main

    assert main(["score", "--rollouts", "x.parquet", "--set", "rl.loss_type=ppo"]) == 2
    assert "loss_type" in capsys.readouterr().err

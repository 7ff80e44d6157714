"""The whole R1 flow with a tiny budget through the real Prefect engine and a real MLflow
sqlite store (cleanrl-style smoke test of the real entry point)."""

import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient
from tests_support import TINY_OVERRIDES as TINY

from flows.config import CHECKPOINT_STAGES as STAGES
from flows.config import STAGE_NAMES, load_config
from grpo_core.contracts.rollouts import ROLLOUT_COLUMNS
from tasks.tracking.charts import pipeline_stage_key
from tasks.workspace import Workspace


@pytest.mark.slow
def test_whole_pipeline_runs_and_tracks_every_stage(prefect_harness, tmp_path, tracking_uri):
    from flows.r1 import r1_pipeline

    cfg = load_config(
        None, [*TINY, f"output_dir={tmp_path / 'runs'}", f"tracking.uri={tracking_uri}"]
    )
    summary = r1_pipeline(cfg)

    assert [r["stage"] for r in summary["stages"]] == list(STAGES)
    client = MlflowClient(tracking_uri)
    parent = client.get_run(summary["parent_run_id"])
    for index, stage in enumerate(STAGES):
        for m in ("accuracy", "format_rate", "mean_length", "wall_time_s"):
            assert pipeline_stage_key(index, stage, m) in parent.data.metrics
    children = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    by_stage = {r.data.tags["stage"]: r for r in children}
    assert set(by_stage) == set(STAGE_NAMES)
    rl1 = by_stage["rl_1"]
    for m in (  # TRL's names, grouped for the UI (tasks/tracking/charts.py)
        "train/reward",
        "train/reward_std",
        "train/more/frac_reward_zero_std",
        "train/entropy",
        "train/clip_ratio/low_mean",
        "train/clip_ratio/high_mean",
        "train/completions/mean_length",
        "train/rewards/accuracy/mean",
        "train/loss",
        "train/more/learning_rate",
        "eval/accuracy",
    ):
        assert m in rl1.data.metrics, m
    # one point per iteration (2 optimizer steps each), the held-out eval from step 0
    assert [h.step for h in client.get_metric_history(rl1.info.run_id, "train/loss")] == [1, 2]
    evals = client.get_metric_history(rl1.info.run_id, "eval/accuracy")
    assert sorted(h.step for h in evals) == [0, 1, 2]
    assert rl1.data.params["loss_type"] == "bnpo"  # the demo preset

    # tags for MLflow's compare view and search_runs filters
    assert parent.data.tags["config_hash"] and parent.data.tags["policy_id"]
    assert all(r.data.tags.get("config_hash") for r in children)
    for stage in (*STAGES, "rejection_sampling"):
        assert by_stage[stage].data.tags["policy_id"], stage
    assert parent.data.tags["policy_id"] == by_stage["rl_2"].data.tags["policy_id"]
    assert by_stage["rl_1"].data.tags["config_hash"] != by_stage["rl_2"].data.tags["config_hash"]
    # one nested run per RL iteration group (eval_every=1 here: one iteration each)
    groups = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{rl1.info.run_id}'"
    )
    assert sorted(g.data.tags["iterations"] for g in groups) == ["0-0", "1-1"]
    for g in groups:
        assert g.data.tags["stage"] == "rl_1" and g.data.tags["cached"] == "false"
        assert {"eval/accuracy", "train/reward", "train/by_step/loss"} <= set(g.data.metrics)
        assert g.data.tags["config_hash"] == rl1.data.tags["config_hash"]
    same_settings = client.search_runs(
        [parent.info.experiment_id], f"tags.config_hash = '{rl1.data.tags['config_hash']}'"
    )
    assert {r.info.run_id for r in same_settings} == {rl1.info.run_id} | {
        g.info.run_id for g in groups
    }
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"config.yaml", "summary.json"} <= artifacts
    assert any(
        a.path.startswith("eval_tables")
        for a in client.list_artifacts(by_stage["final_evaluation"].info.run_id)
    )

    ws = Workspace(tmp_path / "runs" / "demo")
    for it in range(2):
        rollouts = pq.read_table(ws.rollouts("rl_1", it))
        assert set(ROLLOUT_COLUMNS) <= set(rollouts.column_names)
        assert rollouts.num_rows == 16
        scored = pq.read_table(ws.scored("rl_1", it))
        assert {"reward", "advantage", "reward_accuracy", "reward_format"} <= set(
            scored.column_names
        )
    for stage in STAGES:
        assert (ws.checkpoint(stage) / "model.safetensors").exists()
        assert pq.read_table(ws.eval_table(stage)).num_rows == 16

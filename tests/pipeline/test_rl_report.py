"""An RL stage's MLflow chart keys, completion tables and Prefect artifact, from real Parquet
files (the pipeline tests check them end to end; these pin the rules)."""

from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.parquet as pq

from flows.rl_report import StageReport, rollout_sample
from tasks.results import EvalOutcome
from tasks.tracking.charts import chart_key, chart_metrics, iteration_means, pipeline_stage_key


def test_chart_keys_put_the_story_first():
    """MLflow sorts sections by key prefix: eval/ first, then the headline train/ curves, the
    grouped TRL names below them, and nothing in the trailing catch-all."""
    names = ["grad_norm", "reward", "clip_ratio/low_mean", "eval/accuracy", "loss", "timing/x_s"]
    keys = chart_metrics({n: 1.0 for n in names})
    assert list(keys)[:2] == ["train/reward", "train/loss"]  # headline first, as logged
    assert set(keys) == {
        "train/more/grad_norm",
        "train/reward",
        "train/clip_ratio/low_mean",
        "eval/accuracy",
        "train/loss",
        "train/timing/x_s",
    }
    sections = sorted({k.rpartition("/")[0] for k in keys})
    assert sections[:2] == ["eval", "train"]
    assert all("/" in k for k in keys)
    assert chart_key("system/cpu") == "system/cpu"
    assert pipeline_stage_key(1, "rl_1", "accuracy") == "stages/2_rl_1/accuracy"


def test_an_iteration_is_one_point():
    history = [
        {"loss": 1.0, "learning_rate": 1e-3, "peak_memory_gib": 2.0},
        {"loss": 3.0, "learning_rate": 2e-3, "peak_memory_gib": 1.0, "kl": 0.5},
    ]
    assert iteration_means(history) == {
        "loss": 2.0,
        "learning_rate": 2e-3,
        "peak_memory_gib": 2.0,
        "kl": 0.5,
    }


def test_completion_table_samples_across_groups_answer_first(tmp_path):
    rows = [
        {
            "prompt_id": f"p{g}",
            "prompt_text": f"q{g}",
            "completion": f"<think>..</think><answer>{g * 10 + i}</answer>",
            "answer": str(g * 10),
            "reward": float(i == 0),
            "advantage": 1.0 - i,
            "reward_accuracy": float(i == 0),
            "finish_reason": "stop",
            "completion_length": 9,
        }
        for g in range(10)
        for i in range(4)
    ]
    path = tmp_path / "scored.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    sample = rollout_sample(str(path), n=8)
    assert len(sample) == 8
    assert list(sample[0])[:6] == [
        "reward",
        "advantage",
        "answer",
        "model_answer",
        "completion",
        "prompt",
    ]
    groups = [s["prompt"] for s in sample]
    assert len(set(groups)) == 4 and groups[-1] != "q1"  # spread over the file, not its start
    assert [s["reward"] for s in sample[:2]] == [1.0, 0.0]  # a group's best and worst
    assert sample[0]["model_answer"] == sample[0]["answer"]


def _eval_table(path, correct: list[float]) -> str:
    rows = [
        {"prompt": f"<|user|>{i}+1|?", "sample_idx": 0, "completion": f"<answer>{i}</answer>"}
        | {"answer": str(i + 1), "correct": c}
        for i, c in enumerate(correct)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_stage_artifact_tells_first_to_last_and_the_problems_that_changed(tmp_path):
    report = StageReport("rl_1")
    start = _eval_table(tmp_path / "start.parquet", [0.0, 1.0, 0.0, 0.0])
    end = _eval_table(tmp_path / "end.parquet", [1.0, 0.0, 0.0, 1.0])
    out = EvalOutcome(0.25, 1.0, 5.0, 4.0, 1.0, start, "x")
    report.evaluated(0, out)
    for it, reward in enumerate([0.1, 0.4, 0.7]):
        point = {"train/reward": reward, "train/loss": 0.5, "train/timing/update_s": 2.0}
        report.iteration(it, point, cached=it == 0)
    report.evaluated(3, EvalOutcome(0.5, 1.0, 5.0, 4.0, 1.0, end, "y"))
    md = report.markdown("http://h/#/experiments/1/runs/r?workflowType=machine_learning", "r", 9.0)
    assert "held-out accuracy **25.0% -> 50.0%** (after 0 -> 3 iterations)" in md
    assert "reward **0.100 -> 0.700**" in md and "3 iterations (1 reused from cache)" in md
    table = md.split("| iteration |")[1].split("\n\n")[0].splitlines()[2:]
    assert [row.split("|")[3].strip() for row in table] == ["-", "-", "50.0%"]
    assert "Solved now, not at the first eval: 2" in md
    assert "Lost since the first eval: 1" in md and "Still failing: 1" in md
    assert re.search(r"\| &lt;\\\|user\\\|&gt;1\+1\\\|\? \| 2 \| 1 \|", md), md  # escaped

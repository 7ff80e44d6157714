"""The tool demo preset (configs/demo-tools.yaml) at a tiny budget through the real Prefect
engine, MLflow store and code sandbox: every stage samples through the turn loop, the
rollout files keep the episodes, the UIs get the trajectory and the tool metrics, a rerun
reuses everything, and a tool rollout is re-scored without running the tool again."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient
from tests_support import TOOL_TINY_OVERRIDES as TINY

from flows.config import load_config
from grpo_core.sandbox import SandboxUnavailable, detect_isolation
from tasks.score import score_file

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo-tools.yaml"

try:
    detect_isolation()
    ISOLATED = True
except SandboxUnavailable:
    ISOLATED = False


@pytest.mark.slow
@pytest.mark.skipif(not ISOLATED, reason="no sandbox isolation on this machine")
def test_the_tool_demo_runs_records_episodes_and_rescores_without_the_tool(
    prefect_harness, tmp_path, tracking_uri
):
    from flows.r1 import r1_pipeline

    cfg = load_config(
        str(CONFIG), [*TINY, f"output_dir={tmp_path / 'runs'}", f"tracking.uri={tracking_uri}"]
    )
    summary = r1_pipeline(cfg)
    run = tmp_path / "runs" / "demo-tools"

    scored = pq.read_table(run / "rl_1" / "iter_0001" / "scored.parquet")
    for col in ("loss_mask", "turns", "tool_calls", "tool_errors", "tool_time_s"):
        assert col in scored.column_names, col
    rows = scored.to_pylist()
    for r in rows:
        assert len(r["loss_mask"]) == len(r["completion_ids"])
        tool = [t for t in r["turns"] if t["role"] == "tool"]
        assert r["tool_calls"] == len(tool)
        for t in tool:  # the tool's tokens: no loss
            assert set(r["loss_mask"][t["start"] : t["end"]]) == {0}
    assert sum(r["tool_calls"] for r in rows) > 0  # the cold start calls the tool

    eval_table = pq.read_table(run / "rl_1" / "iter_0001" / "eval.parquet")
    assert "turns" in eval_table.column_names  # the held-out eval uses the tool too

    client = MlflowClient(tracking_uri)
    parent = client.get_run(summary["parent_run_id"])
    children = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    rl1 = next(r for r in children if r.data.tags.get("stage") == "rl_1")
    for m in ("tools/calls_per_completion", "tools/error_rate", "tools/token_share"):
        assert f"train/{m}" in rl1.data.metrics, m
    samples = client.download_artifacts(rl1.info.run_id, "samples")
    assert any("trajectory" in Path(samples, f).read_text() for f in os.listdir(samples))

    files = sorted(run.glob("**/*.parquet"))
    stamps = {f: f.stat().st_mtime_ns for f in files}
    again = r1_pipeline(cfg)  # every stage, tool rollouts included, reused: nothing rewritten
    assert {f: f.stat().st_mtime_ns for f in files} == stamps
    assert [s["accuracy"] for s in again["stages"]] == [s["accuracy"] for s in summary["stages"]]

    # re-scored with no sandbox anywhere: nothing runs the tool again
    env = {"PATH": "/nonexistent", "GRPO_SANDBOX_ISOLATION": "bwrap"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        out = score_file(
            str(run / "rl_1" / "iter_0001" / "rollouts.parquet"),
            str(tmp_path / "rescored.parquet"),
            {"accuracy": 1.0, "format": 0.1},
        )
    rescored = pq.read_table(out.path)
    assert rescored.column("reward").to_pylist() == scored.column("reward").to_pylist()


@pytest.mark.slow
@pytest.mark.skipif(not ISOLATED, reason="no sandbox isolation on this machine")
def test_an_environment_that_reads_its_row_runs_through_every_eval(
    prefect_harness, tmp_path, tracking_uri, monkeypatch
):
    """A user's environment that needs the data row to start an episode: the rollouts, the
    held-out evals of every stage and the final eval all hand it the row (it logs each
    start's row; without one it raised, and every eval crashed)."""
    from flows.r1 import r1_pipeline

    log = tmp_path / "rows.log"
    monkeypatch.setenv("GRPO_TEST_ROW_LOG", str(log))
    env = "rollout.tools=[tests.tools.test_tool_answers:make_row_python]"
    cfg = load_config(str(CONFIG), [*TINY, env, f"output_dir={tmp_path / 'runs'}",
                                    f"tracking.uri={tracking_uri}"])  # fmt: skip
    summary = r1_pipeline(cfg)
    assert len(summary["stages"]) == 4
    started = log.read_text().split()
    tables = sorted((tmp_path / "runs").glob("**/eval*.parquet"))
    assert len(tables) >= 3  # rl_1's and rl_2's evals; the final eval reuses them
    answers = {str(r["answer"]) for f in tables for r in pq.read_table(f).to_pylist()}
    assert "None" not in started  # every episode got its row
    assert answers <= set(started)  # the evals' episodes among them


@pytest.mark.slow
def test_function_tools_run_through_the_pipeline_with_the_templates_declarations(
    prefect_harness, tmp_path, tracking_uri
):
    """``rollout.functions: [calculator]`` on a model whose chat template has a tools section
    (a tiny Qwen2 with tests/tools/test_json_tools.py's Hermes-style template): preflight
    passes, every split's rows get the ``tools`` column, every prompt the model sees declares
    the calculator, the cold start trains on conversations (the calculator's answers as tool
    messages, out of the loss), every stage samples in JSON-call mode (no stop string: turns
    end at end-of-turn), and a rollout file is re-scored from the file alone."""
    import json

    from flows import preflight
    from flows.r1 import r1_pipeline
    from tests.tools.test_json_tools import TINY_RUN, run_on_files

    rows = [
        {
            "prompt": [{"role": "user", "content": f"What is {a}+{b}?"}],
            "answer": str(a + b),
            "completion": [  # the cold start's episodes as chat messages, tool answer included
                {
                    "role": "assistant",
                    "content": f'<tool_call>{{"name": "calculator", '
                    f'"arguments": {{"expression": "{a}+{b}"}}}}</tool_call>',
                },
                {"role": "tool", "name": "calculator", "content": str(a + b)},
                {"role": "assistant", "content": f"<answer>{a + b}</answer>"},
            ],
        }  # fmt: skip
        for a in range(10, 30)
        for b in range(3, 6)
    ]
    data = run_on_files(tmp_path, {"sft": rows[:24], "rl": rows[24:48], "eval": rows[48:56]})
    overrides = [
        *data, "rollout.functions=[calculator]",
        *TINY_RUN,
        f"output_dir={tmp_path / 'runs'}", f"tracking.uri={tracking_uri}",
    ]  # fmt: skip
    cfg = load_config(None, overrides)
    preflight.check_run(cfg)
    summary = r1_pipeline(cfg)
    assert len(summary["stages"]) == 4
    run = tmp_path / "runs" / cfg.run_name
    rollouts = pq.read_table(run / "rl_1" / "iter_0000" / "rollouts.parquet").to_pylist()
    assert all("<tools>" in r["prompt_text"] and "calculator" in r["prompt_text"] for r in rollouts)
    assert all(json.loads(r["tools"])[0]["function"]["name"] == "calculator" for r in rollouts)
    assert all("turns" in r for r in rollouts)
    out = score_file(str(run / "rl_1" / "iter_0000" / "rollouts.parquet"),
                     str(tmp_path / "rescored.parquet"), {"format": 1.0})  # fmt: skip
    assert pq.read_table(out.path).num_rows == len(rollouts)

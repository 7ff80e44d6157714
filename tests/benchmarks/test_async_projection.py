"""benchmarks/async_projection.py: the async schedule's replay of measured stage times, and its
reading of a real MLflow store (a sqlite file written here with the pipeline's run names, tags
and metric keys)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "async_projection.py"


def _module():
    spec = importlib.util.spec_from_file_location("async_projection", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass resolves annotations through it
    spec.loader.exec_module(mod)
    return mod


def test_level_0_is_todays_loop_and_level_1_overlaps_it():
    ap = _module()
    gen, train = [1.0, 2.0, 3.0], [2.0, 2.0, 1.0]
    on_policy = ap.project(gen, train, level=0, evals=4.0)
    assert on_policy.seconds == pytest.approx(sum(gen) + sum(train) + 4.0)
    assert on_policy.engine_idle == pytest.approx(sum(train) / 15.0)
    # equal halves: one step off the policy hides all but one of them
    ones = [1.0] * 10
    assert ap.project(ones, ones, level=1).seconds == pytest.approx(11.0)
    assert ap.project(ones, ones, level=0).seconds == pytest.approx(20.0)
    # a weight transfer per iteration lengthens the trainer's side
    assert ap.project(ones, ones, level=1, sync=0.5).seconds == pytest.approx(16.0)
    # the engine cannot run further ahead than its schedule lets it: level 2 waits for less
    slow_train = [1.0] * 3 + [5.0] * 3
    assert (
        ap.project([1.0] * 6, slow_train, level=2).seconds
        <= ap.project([1.0] * 6, slow_train, level=1).seconds
    )
    with pytest.raises(ValueError, match="2 generation times but 1 update"):
        ap.project([1.0, 1.0], [1.0], level=1)


def test_reads_the_stage_runs_of_a_real_mlflow_store(tmp_path, capsys):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    exp = client.create_experiment("grpo-demo")
    parent = client.create_run(exp, run_name="demo").info.run_id
    for name, scale in (("rl_1 (demo)", 1.0), ("rl_1 it 0-4 (demo)", 100.0)):
        tags = {"stage": "rl_1", "mlflow.parentRunId": parent}
        run = client.create_run(exp, run_name=name, tags=tags).info.run_id
        for step in range(1, 5):
            client.log_metric(run, "train/timing/rollout_s", 1.0 * scale, step=step)
            client.log_metric(run, "train/timing/score_s", 0.25 * scale, step=step)
            client.log_metric(run, "train/timing/update_s", 1.25 * scale, step=step)
        client.log_metric(run, "train/timing/eval_s", 2.0 * scale, step=0)
    ap = _module()
    timings = ap.stage_timings(uri)
    assert set(timings) == {"rl_1"}  # the eval block's run is not the stage's
    assert timings["rl_1"]["update_s"] == {1: 1.25, 2: 1.25, 3: 1.25, 4: 1.25}
    assert ap.stage_timings(uri, run_name="other") == {}
    assert ap.main(["--tracking-uri", uri, "--levels", "0", "1"]) == 0
    out = capsys.readouterr().out
    assert "PROJECTION" in out
    # on-policy 4 x (1.25 + 1.25) + 2 = 12; one step off 1.25 + 4 x 1.25 + 2 = 8.25
    assert "| rl_1 | 4 | 0 | 5.0 | 5.0 | 2.0 | 12.0 | 1.00x |" in out
    assert "| rl_1 | 4 | 1 | 5.0 | 5.0 | 2.0 | 8.2 | 1.45x |" in out

"""A run whose rewards all failed is not a success; known errors raised mid-run are one line.

- a reward function failing on every row (or on ``rl.rewards_max_error_rate`` of them)
  stops scoring with its first error and writes nothing; one failing on some rows is
  recorded and scoring goes on (tests/pipeline/test_contracts.py)
- through the real ``grpo score`` / ``grpo run`` (Prefect engine): exit 2, the message is
  the last line, no traceback anywhere, no scored file, no registered model
- a ``path/file.py:fn`` reward logs to a real sqlite MLflow store under a safe metric name
- disk full, read-only folders and a read-only MLflow database are one line too
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from tests_support import TINY_OVERRIDES

from benchmarks.preflight_inputs import _parquet, _rollout_rows
from grpo_core.errors import UserError
from grpo_core.rewards import ScoreResult, Scores
from grpo_core.rewards.base import RewardUnavailable

ROOT = Path(__file__).resolve().parents[2]
FAILING = (
    "def fn(prompts, completions, **kw):\n    return [float(kw['solution'][0])] * len(prompts)\n"
)


@pytest.fixture
def rollouts(tmp_path):
    return _parquet(tmp_path / "rollouts.parquet", _rollout_rows())  # 2 groups x 4, 'answer'


def _spec(tmp_path, body=FAILING, name="rw.py") -> str:
    (tmp_path / name).write_text(body)
    return f"{tmp_path / name}:fn"


def test_a_reward_failing_on_every_row_stops_scoring_with_its_first_error(rollouts, tmp_path):
    from tasks.score import score_file

    out = tmp_path / "scored.parquet"
    spec = _spec(tmp_path)
    with pytest.raises(UserError) as e:
        score_file(rollouts, str(out), {spec: 1.0, "format": 0.1}, label="rl_1 iteration 0")
    assert str(e.value) == (
        f"reward {spec!r} failed on all 8 rows of rl_1 iteration 0: KeyError: 'solution' "
        "(first row 0)"
    )
    assert not out.exists()


def test_a_reward_returning_nan_everywhere_stops_like_a_failing_one(rollouts, tmp_path):
    from tasks.score import score_file

    out = tmp_path / "scored.parquet"
    spec = _spec(
        tmp_path, "def fn(prompts, completions, **kw):\n    return [float('nan')] * len(prompts)\n"
    )
    with pytest.raises(UserError, match=r"failed on all 8 rows .*returned NaN"):
        score_file(rollouts, str(out), {spec: 1.0, "format": 0.1}, label="rl_1 iteration 0")
    assert not out.exists()


def test_the_error_rate_limit_is_configurable(rollouts, tmp_path):
    from grpo_core.config.stages import RLConfig
    from tasks.score import score

    half = "def fn(prompts, completions, answer, **kw):\n    return [1.0 / (a == '1') for a in answer]\n"
    spec = _spec(tmp_path, half)  # ZeroDivisionError on group 1 (answer '2'): rows 4..7
    with pytest.raises(
        UserError,
        match=r"failed on 4 of 8 rows \(50%.*=0.5\) of rl_1 iteration 3: "
        r"ZeroDivisionError.* \(first row 4\)",
    ):
        score.fn(
            "rl_1",
            3,
            rollouts,
            str(tmp_path / "a.parquet"),
            {spec: 1.0},
            RLConfig(rewards_max_error_rate=0.5),
        )
    assert not (tmp_path / "a.parquet").exists()
    res = score.fn("rl_1", 3, rollouts, str(tmp_path / "b.parquet"), {spec: 1.0}, RLConfig())
    assert res.metrics[f"rewards/{spec}/error_rate"] == 0.5  # recorded, not fatal


def test_scores_reported_with_an_error_are_not_failures():
    from grpo_core.algorithm.iteration import check_reward_failures

    timeouts = Scores([0.0, 0.0], errors=["TimeoutError: 5 s", "TimeoutError: 5 s"])
    result = ScoreResult({"code": list(timeouts)}, {"code": timeouts.errors}, [0.0, 0.0])
    check_reward_failures(result, 1.0, "x")  # scored 0.0 (a timeout): a result, not a failure
    result = ScoreResult({"code": [None, None]}, {"code": ["E: x", None]}, [None, None])
    check_reward_failures(result, 1.0, "x")  # one of two rows failed
    with pytest.raises(UserError, match="1 of 2 rows"):
        check_reward_failures(result, 0.5, "x")


def _env(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.pop("GRPO_DEBUG", None)
    env.update(PYTHONPATH=str(ROOT), PREFECT_HOME=str(tmp_path / "prefect-home"))
    return env


@pytest.mark.slow
def test_grpo_score_stops_with_one_line_and_no_prefect_traceback(rollouts, tmp_path):
    """The error is raised inside a Prefect task: the engine's own failure lines stay (one
    line each, no traceback) and the CLI's message is the last line."""
    spec = _spec(tmp_path)
    out = tmp_path / "scored.parquet"
    cmd = [sys.executable, "-m", "flows.cli", "score", "--rollouts", rollouts, "--out", str(out)]
    cmd += ["--set", f"rewards={{'{spec}': 1.0}}", "--set", f"output_dir={tmp_path / 'runs'}"]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=300
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert last == (
        f"grpo: error: reward {spec!r} failed on all 8 rows of {rollouts}: KeyError: 'solution' "
        "(first row 0)"
    )
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not out.exists()


def test_rejection_sampling_that_keeps_nothing_says_what_to_change(tiny_checkpoint, tmp_path):
    from grpo_core.config.stages import RejectionConfig
    from grpo_core.contracts.io import write_jsonl
    from grpo_core.demo.task import make_splits
    from tasks.rejection import _sample_and_filter
    from tasks.rollout import HF_ENGINE

    rl = write_jsonl(make_splits(0, n_sft=1, n_rl=4, n_dev=1, n_eval=1).rl, tmp_path / "rl.jsonl")
    cfg = RejectionConfig(
        num_prompts=2, num_generations=2, max_completion_length=4, min_reward=1e9, require=[]
    )
    with pytest.raises(UserError) as e:
        _sample_and_filter(
            str(tiny_checkpoint), str(rl), str(tmp_path / "rs"), cfg, {"format": 1.0}, 0, HF_ENGINE
        )
    msg = str(e.value)
    assert msg.startswith("rejection sampling kept no completion of 4")
    assert "rejection_sampling.min_reward (1e+09)" in msg and "rl.iterations" in msg
    assert "\n" not in msg


def test_path_spec_reward_logs_to_a_real_sqlite_store(tmp_path):
    from mlflow.exceptions import MlflowException

    from tasks.tracking.keys import safe_key
    from tasks.tracking.stages import Tracking

    spec = f"{tmp_path}/my rewards+v2.py:fn"  # absolute, with a space and a '+'
    result = ScoreResult({spec: [1.0, 0.0]}, {spec: [None, None]}, [1.0, 0.0], {spec: 1.0})
    metrics = result.metrics()
    assert f"rewards/{spec}/mean" in metrics
    tracking = Tracking.open(f"sqlite:///{tmp_path / 'mlflow.db'}", "t").start_parent("p", {})
    run = tracking.start_child("rl_1")
    with pytest.raises(MlflowException):  # what MLflow does with the raw name
        tracking.client.log_metric(run, f"rewards/{spec}/mean", 1.0)
    tracking.log_metrics(run, metrics, step=1)
    tracking.log_params(run, {"rewards": {spec: 1.0}})
    data = tracking.client.get_run(run).data
    key = safe_key(f"rewards/{spec}/mean")
    assert key == f"rewards/{str(tmp_path).lstrip('/')}/my rewards_v2.py:fn/mean"
    assert data.metrics[key] == 0.5
    assert f"rewards.{spec}" in data.params.values()  # the full spec stays, as a parameter
    assert data.params[safe_key(f"rewards.{spec}")] == "1.0"
    for name in ("rewards/accuracy/mean", "rl_1/eval/accuracy", "clip_ratio/low_mean"):
        assert safe_key(name) == name  # valid names are left alone
    assert safe_key("a/../b//c/./d") == "a/__/b/c/d"
    assert len(safe_key("x/" * 300)) <= 250


def test_known_errors_are_one_line_and_bugs_are_not_known():
    from flows.errors import user_message

    full = user_message(OSError(errno.ENOSPC, "No space left on device", "/r/scored.parquet"))
    assert full.startswith("/r/scored.parquet: No space left on device; free some space")
    ro = user_message(OSError(errno.EROFS, "Read-only file system", "/r/x"))
    assert ro.startswith("/r/x: Read-only file system; make it writable")
    try:  # how MLflow's sqlite store reports a read-only database: wrapped twice
        try:
            raise sqlite3.OperationalError("attempt to write a readonly database")
        except sqlite3.OperationalError as e:
            raise RuntimeError(
                "(sqlite3.OperationalError) attempt to write a readonly database\n[SQL: INSERT ...]"
            ) from e
    except RuntimeError as e:
        assert user_message(e).startswith("the MLflow database is read-only")
    assert user_message(UserError("a\n  b")) == "a; b"
    assert user_message(RewardUnavailable("code sandbox: no bwrap\nFix: install it")) == (
        "code sandbox: no bwrap; Fix: install it"
    )
    assert user_message(KeyError("x")) is None
    assert user_message(RuntimeError("bug")) is None


def test_cli_prints_disk_full_as_one_line(monkeypatch, capsys):
    import flows.cli as cli

    def disk_full(args):
        raise OSError(errno.ENOSPC, "No space left on device", "/runs/demo/scored.parquet")

    monkeypatch.setattr(cli, "cmd_stage", disk_full)
    assert cli.main(["score", "--rollouts", "r.parquet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "grpo: error: /runs/demo/scored.parquet: No space left on device; free some space or set "
        "output_dir to a folder on another disk"
    ]

    def bug(args):
        raise KeyError("a bug keeps its traceback")

    monkeypatch.setattr(cli, "cmd_stage", bug)
    with pytest.raises(KeyError):
        cli.main(["score", "--rollouts", "r.parquet"])


def test_prefect_engine_records_of_known_errors_lose_their_traceback():
    from flows import errors

    errors.quiet_prefect_tracebacks()
    for name in errors.PREFECT_RUN_LOGGERS:
        log = logging.getLogger(name)
        assert errors._FILTER in log.filters  # the flow and task engines log on these
    records = []
    for exc in (UserError("bad row"), KeyError("bug")):
        try:
            raise exc
        except Exception:
            record = log.makeRecord(
                log.name, logging.ERROR, __file__, 0, "Task run failed: %r", (exc,), sys.exc_info()
            )
        assert errors._FILTER.filter(record)  # kept, as one line
        records.append(record)
    assert records[0].exc_info is None and "bad row" in records[0].getMessage()
    assert records[1].exc_info is not None  # a bug keeps its traceback


@pytest.mark.slow
def test_grpo_run_whose_reward_fails_everywhere_stops_and_registers_nothing(tmp_path):
    import mlflow

    spec = _spec(tmp_path)
    cmd = [sys.executable, "-m", "flows.cli", "run"]
    cmd += [a for o in TINY_OVERRIDES for a in ("--set", o)]
    cmd += ["--set", f"rewards={{'{spec}': 1.0}}"]
    cmd += ["--set", f"output_dir={tmp_path / 'runs'}", "--set", "run_name=bad"]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"grpo: error: reward {spec!r} failed on all 16 rows of rl_1 iteration 0"
    )
    assert last.endswith("KeyError: 'solution' (first row 0)")
    rl_1 = tmp_path / "runs" / "bad" / "rl_1" / "iter_0000"
    assert (rl_1 / "rollouts.parquet").exists() and not (rl_1 / "scored.parquet").exists()
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert client.search_registered_models() == []

"""``rl.async_level`` (flows/rl_schedule.py): the rollouts of iteration i are sampled by the
policy k updates behind the newest, in the engine process, while the trainer updates.

Through `grpo run` at the tests' tiny budget: every rollout file's sampling policy is the
one the schedule names, rows of an older policy get the token-level behaviour weight, the
stage's Prefect graph shows rollouts running beside updates, MLflow gets the lag and idle
numbers; a run killed mid-stage and rerun ends with the weights of an uninterrupted run."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from tests_support import TINY_OVERRIDES

from flows.rl_schedule import sampled_by, sampling_index

ROOT = Path(__file__).resolve().parents[2]
ITERATIONS = 5
ASYNC = [
    o for o in TINY_OVERRIDES if not o.startswith(("rl.iterations", "rl.eval_every", "rl_2"))
] + [
    f"rl.iterations={ITERATIONS}",
    "rl.eval_every=5",
    "rl.async_level=1",
    "rl.learning_rate=0.003",  # the tiny policy moves every update: each policy_id differs
    "rewards={accuracy: 1.0, format: 0.1, tag_count: 0.5}",
    "rl_2={iterations: 2}",
]


def test_the_schedule():
    assert [sampling_index(i, 0) for i in range(4)] == [0, 1, 2, 3]  # on-policy
    assert [sampling_index(i, 1) for i in range(5)] == [0, 0, 1, 2, 3]
    assert [sampling_index(i, 2) for i in range(5)] == [0, 0, 0, 1, 2]
    assert sampled_by(0, 2, 5) == [0, 1, 2] and sampled_by(3, 2, 5) == []
    assert sampled_by(2, 2, 5) == [4]


def _sampling_policies(ws, stage: str, iterations: int) -> tuple[list[str], list[str]]:
    """(the policy_id of each rollout file's rows, P_0..P_n of the stage's records)."""
    from tasks.policies import ref as policy_ref

    start = ws.checkpoint("cold_start_sft" if stage == "rl_1" else "re_sft")
    policies = [policy_ref.policy_id(start)]
    policies += [policy_ref.policy_id(ws.policy_ref(stage, j)) for j in range(iterations)]
    rows = []
    for it in range(iterations):
        (pid,) = set(pq.read_table(ws.rollouts(stage, it)).column("policy_id").to_pylist())
        rows.append(pid)
    return rows, policies


@pytest.mark.slow
def test_async_run_follows_the_schedule(prefect_harness, tmp_path, tracking_uri):
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client

    from flows.config import load_config
    from flows.r1 import r1_pipeline
    from tasks.workspace import Workspace

    cfg = load_config(None, [*ASYNC, f"output_dir={tmp_path}", f"tracking.uri={tracking_uri}",
                             "run_name=async"])  # fmt: skip
    summary = r1_pipeline(cfg)
    ws = Workspace(tmp_path / "async")
    rows, policies = _sampling_policies(ws, "rl_1", ITERATIONS)
    assert rows == [policies[sampling_index(i, 1)] for i in range(ITERATIONS)]
    assert len(set(policies)) == len(policies)  # every update moved the weights: a real lag
    rows2, policies2 = _sampling_policies(ws, "rl_2", 2)
    assert rows2 == [policies2[0], policies2[0]]

    client = MlflowClient(tracking_uri)
    parent = client.get_run(summary["parent_run_id"])
    children = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    rl1 = {r.data.tags["stage"]: r for r in children}["rl_1"]
    lag = client.get_metric_history(rl1.info.run_id, "train/async/policy_lag")
    assert [(h.step, h.value) for h in sorted(lag, key=lambda h: h.step)] == [
        (1, 0.0),
        *[(i + 1, 1.0) for i in range(1, ITERATIONS)],
    ]
    metrics = rl1.data.metrics
    assert 0 <= metrics["train/async/trainer_idle_share"] <= 1
    assert 0 <= metrics["train/async/engine_idle_share"] <= 1
    assert "train/timing/trainer_wait_s" in metrics and "train/timing/engine_idle_s" in metrics
    # iterations 2.. learn from rows of the policy before: the behaviour weight ran, with
    # its effective sample size; the engine correction stayed off (the weight covers it)
    assert 0 < metrics["train/sampling/behaviour_weight/ess"] <= 1
    assert "train/sampling/behaviour_weight/near_zero_share" in metrics
    assert "train/sampling/importance_sampling_ratio/clipped_share" not in metrics

    # the Prefect graph: rollout i+1 started before update i ended
    with get_client(sync_client=True) as c:
        runs = {r.name: r for r in c.read_task_runs(limit=200) if r.name.startswith("async/rl_1/")}
    for i in range(ITERATIONS - 1):
        nxt, upd = runs[f"async/rl_1/rollout-{i + 1}"], runs[f"async/rl_1/update-{i}"]
        assert nxt.start_time < upd.end_time, (i, nxt.start_time, upd.end_time)


def _grpo_run(
    cwd: Path, kill_on: str | None = None, sig: int = signal.SIGKILL, group: bool = True
) -> tuple[int, str]:
    """`grpo run` of ASYNC into ``cwd`` as a process; ``sig`` when a line matches ``kill_on``,
    to its process group (the engine process too, as a terminal's Ctrl-C or a SIGKILL of the
    group) or to grpo alone (``kill PID``). Returns its exit code and output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "PREFECT_HOME"))}
    env.update(PREFECT_HOME=str(cwd / "prefect-home"), PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "flows.cli", "run"]
    cmd += [a for o in ASYNC for a in ("--set", o)]
    cmd += ["--set", f"output_dir={cwd / 'runs'}", "--set", "run_name=r",
            "--set", f"tracking.uri=sqlite:///{cwd / 'mlflow.db'}"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if kill_on and re.search(kill_on, line):
            if group:
                os.killpg(proc.pid, sig)
            else:
                os.kill(proc.pid, sig)
            kill_on = None  # once; read the rest of what it prints while it stops
            if sig == signal.SIGKILL:
                break
    proc.wait(timeout=600)
    return proc.returncode, "".join(lines)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    whole = tmp_path_factory.mktemp("whole")
    rc, out = _grpo_run(whole)
    assert rc == 0, out[-3000:]
    return whole


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig,group,code",
    [
        (signal.SIGKILL, True, -signal.SIGKILL),
        (signal.SIGTERM, False, 143),
        (signal.SIGINT, True, 130),
    ],
    ids=["SIGKILL", "SIGTERM", "Ctrl-C"],
)
def test_a_killed_async_run_resumes_to_the_uninterrupted_weights(
    uninterrupted, tmp_path, sig, group, code
):
    """Stopped while iteration 3's rollout is in flight beside update 2, in the engine
    process: a rollout that ends after the stop is not recorded (it would be cached as if
    whole), a stop prints one line and no traceback, and the rerun ends bit-identical."""
    from tasks.policies import ref as policy_ref

    resumed = tmp_path
    rc, out = _grpo_run(resumed, kill_on=r"rl_1 iteration 2: \d+ steps", sig=sig, group=group)
    assert rc == code, out[-3000:]
    if sig != signal.SIGKILL:
        assert "Traceback" not in out, out[-3000:]
        assert re.search(r"grpo: interrupted \(SIG(TERM|INT)\)", out), out[-3000:]
    rc, out = _grpo_run(resumed)
    assert rc == 0, out[-3000:]
    assert re.search(r"rl_1 iteration 0 rollout: inputs unchanged", out), out[-3000:]
    for stage in ("rl_1", "rl_2"):
        a = policy_ref.policy_id(uninterrupted / "runs" / "r" / "checkpoints" / stage)
        b = policy_ref.policy_id(resumed / "runs" / "r" / "checkpoints" / stage)
        assert a == b, stage

"""An RL stage keeps its train state only at save points and replays the rest (issue 26).

A rerun that changes the reward weights from iteration k on (``rl.reward_weights_from``)
reuses iterations 0..k-1, replays their updates from the nearest kept state on their cached
scored files to get iteration k's policy and optimizer, and ends with the weights of a fresh
run that had those weights from the start. The stage folder keeps at most
``save_total_limit`` checkpoints whatever its iteration count.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests_support import TINY_OVERRIDES as TINY

from flows.config import load_config
from grpo_core.training.checkpoint import TRAINER_STATE, policy_id
from tasks.policies.ref import read_ref
from tasks.policies.trainer import open_trainer
from tasks.workspace import Workspace

ROOT = Path(__file__).resolve().parents[2]
ITERATIONS = 5
RL = [
    f"rl.iterations={ITERATIONS}",
    "rl.save_steps=2",  # save points: iterations 1, 3 and the last (4)
    "rl.save_total_limit=2",
    "rl.eval_every=5",
    "rl_2={iterations: 1}",
]
CHANGE = "rl.reward_weights_from={3: {format: 0.0}}"


def _run(tmp_path, name: str, tracking_uri: str, *extra: str) -> dict:
    from flows.r1 import r1_pipeline

    cfg = load_config(
        None,
        [*TINY, *RL, *extra, f"output_dir={tmp_path / 'runs'}", f"tracking.uri={tracking_uri}",
         f"run_name={name}", "torch_threads=1"],
    )  # fmt: skip
    return r1_pipeline(cfg)


def _final_ids(ws: Workspace) -> dict[str, str]:
    return {s: policy_id(ws.checkpoint(s)) for s in ("rl_1", "re_sft", "rl_2")}


@pytest.mark.slow
def test_reward_change_from_iteration_k_reuses_k_iterations_and_equals_a_fresh_run(
    prefect_harness, tmp_path, tracking_uri
):
    _run(tmp_path, "a", tracking_uri)
    ws = Workspace(tmp_path / "runs" / "a")
    stage = ws.stage_dir("rl_1")
    # only the last two save points keep a checkpoint; every iteration keeps its record
    kept = sorted(p.parent.name for p in stage.glob("iter_*/checkpoint"))
    assert kept == ["iter_0003", "iter_0004"]
    assert all((ws.iteration_checkpoint("rl_1", i) / TRAINER_STATE).exists() for i in (3, 4))
    refs = [read_ref(ws.policy_ref("rl_1", i)) for i in range(ITERATIONS)]
    assert [r.global_step for r in refs] == [2 * (i + 1) for i in range(ITERATIONS)]
    assert refs[-1].policy_id == policy_id(ws.checkpoint("rl_1"))
    assert len({r.policy_id for r in refs}) == ITERATIONS

    records = [ws.policy_ref("rl_1", i).with_name("policy.json.stage.json") for i in range(5)]
    written = [p.stat().st_mtime_ns for p in records]
    open_trainer().forget()  # as a new process: nothing warm
    replays = open_trainer().stats["replays"]
    _run(tmp_path, "a", tracking_uri, CHANGE)
    # iterations 0-2 reused, 3 and 4 trained again; iteration 3's policy rebuilt by replaying
    # updates 0, 1 and 2 (its nearest kept state, iteration 1's, was pruned: so from the
    # stage's initial checkpoint)
    rewritten = [p.stat().st_mtime_ns != t for p, t in zip(records, written, strict=True)]
    assert rewritten == [False, False, False, True, True]
    assert open_trainer().stats["replays"] - replays == 3

    _run(tmp_path, "fresh", tracking_uri, CHANGE)
    assert _final_ids(ws) == _final_ids(Workspace(tmp_path / "runs" / "fresh"))


# `grpo run` whose checkpoint writer kills the process half-way through writing iteration
# 3's kept state, once the iteration is recorded: a crash during a background write
CRASH = """
import os, sys, time
from pathlib import Path
import grpo_core.training.checkpoint as checkpoint
real = checkpoint.save_checkpoint

def crash(model, tokenizer, out, **kwargs):
    out = Path(out)
    if out.parent.name == "iter_0003" and out.parent.parent.name == "rl_1":
        while not (out.parent / "policy.json.stage.json").exists():
            time.sleep(0.02)
        tmp = out.with_name(".checkpoint.tmp-crashed")
        tmp.mkdir()
        (tmp / "model.safetensors").write_bytes(b"half")
        print("CRASHED mid-write of", out, flush=True)
        os._exit(9)
    return real(model, tokenizer, out, **kwargs)

checkpoint.save_checkpoint = crash
from flows.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _cli(tmp_path, script: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "PREFECT_HOME"))}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-c", script] if script else [sys.executable, "-m", "flows.cli"]
    cmd += ["run"] + [a for o in [*TINY, *RL, "torch_threads=1"] for a in ("--set", o)]
    cmd += ["--set", f"output_dir={tmp_path / 'runs'}", "--set", "run_name=c"]
    return subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_crash_during_a_background_write_resumes_from_the_previous_kept_state(
    prefect_harness, tmp_path, tracking_uri
):
    crashed = _cli(tmp_path, CRASH)
    assert crashed.returncode == 9 and "CRASHED mid-write" in crashed.stdout, crashed.stderr[-3000:]
    ws = Workspace(tmp_path / "runs" / "c")
    assert not ws.iteration_checkpoint("rl_1", 3).exists()  # never under its real name
    assert read_ref(ws.policy_ref("rl_1", 3)).checkpoint  # recorded as a save point
    rerun = _cli(tmp_path, None)
    log = rerun.stdout + rerun.stderr
    assert rerun.returncode == 0, log[-4000:]
    assert "(its background write did not finish): replaying the update of iteration 3" in log
    assert "rl_1/iter_0001/checkpoint: optimizer state at step 4 from disk" in log
    _run(tmp_path, "uninterrupted", tracking_uri)
    assert _final_ids(ws) == _final_ids(Workspace(tmp_path / "runs" / "uninterrupted"))

"""A killed `grpo run` resumes to the same result (issue 12, items 1 and 2).

`grpo run` runs as a real process and is killed with SIGKILL at four points: mid cold-start
SFT (after a resume checkpoint), mid rl_1 and mid rl_2 (after an iteration whose train state
is not kept, between two save points: issue 26), mid re-SFT. Each rerun continues where the previous one stopped; the final weights of every
stage, bit for bit, and the summary's accuracy table equal those of an uninterrupted run of
the same config in another folder (which runs at the same time, to save wall time). Both
run a snapshot of the code taken when the test starts: the stage cache keys include the code
version, and a rerun resumes only under the same keys.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tests_support import TINY_OVERRIDES, TOOL_TINY_OVERRIDES

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("cold_start_sft", "rl_1", "re_sft", "rl_2")
MARKER = "GRPO_RESUME_TEST"  # in the environment of every process a run starts
PACKAGES = ("grpo_core", "tasks", "cluster", "flows", "configs", "infra")

# Long enough SFT stages to be killed between resume checkpoints; five RL iterations each,
# with the train state kept at iterations 2 and 4 (rl.save_steps: 3, and the last).
RESUME_OVERRIDES = {
    "sft.max_steps": "60",
    "sft.checkpoint_every": "10",
    "rl.iterations": "5",
    "rl.eval_every": "5",
    "rl.save_steps": "3",
    "re_sft.max_steps": "30",
    "rl_2": "{iterations: 5}",
    "torch_threads": "1",
}


def _with(base: list[str], changes: dict[str, str]) -> list[str]:
    """``base``'s ``--set`` overrides with ``changes`` in place of those of the same keys."""
    kept = [o for o in base if o.split("=", 1)[0] not in changes]
    return kept + [f"{k}={v}" for k, v in changes.items()]


OVERRIDES = _with(TINY_OVERRIDES, RESUME_OVERRIDES)

# (log line after which the run is killed, line the rerun must print). SFT is killed once it
# has written a resume checkpoint; RL once iteration 4's rollout is done: iteration 3 is
# recorded but its state is not kept (between the save points 2 and 4), so the rerun loads
# iteration 2's kept state and replays iteration 3's update from its cached scored file.
KILLS = [
    (r"cold_start_sft: resume checkpoint at step 20 ", r"cold_start_sft: resumed at step \d+"),
    (r"rl_1 iteration 4: \d+ completions", r"rl_1 iteration 3 replayed from"),
    (r"re_sft: resume checkpoint at step 10 ", r"re_sft: resumed at step \d+"),
    (r"rl_2 iteration 4: \d+ completions", r"rl_2 iteration 3 replayed from"),
]
REPLAYED_FROM = r"rl_{}/iter_0002/checkpoint: optimizer state at step 6 from disk"


class Run:
    """One `grpo run` process; ``kill_on``: SIGKILL it when a line of its output matches."""

    def __init__(
        self, code: Path, cwd: Path, kill_on: str | None = None, args: list[str] | None = None
    ):
        cwd.mkdir(parents=True, exist_ok=True)
        env = {
            k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "PREFECT_HOME"))
        }
        env.update(
            PREFECT_HOME=str(cwd / "prefect-home"),
            PYTHONPATH=str(code),
            PYTHONUNBUFFERED="1",
            **{MARKER: str(cwd)},
        )
        cmd = [sys.executable, "-m", "flows.cli", "run"]
        cmd += args if args is not None else [a for o in OVERRIDES for a in ("--set", o)]
        cmd += ["--set", f"output_dir={cwd / 'runs'}", "--set", "run_name=r"]
        self.cwd, self.lines, self.killed, self.leftovers = cwd, [], False, []
        self.proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.reader = threading.Thread(target=self._read, args=(kill_on,), daemon=True)
        self.reader.start()

    def _read(self, kill_on: str | None) -> None:
        pattern = re.compile(kill_on) if kill_on else None
        for line in self.proc.stdout:
            self.lines.append(line)
            if pattern and not self.killed and pattern.search(line):
                self.killed = True
                self.proc.send_signal(signal.SIGKILL)

    def wait(self, timeout: float) -> str:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.reader.join(timeout=10)
            self.leftovers = _kill_leftovers(self.cwd)
        out = "".join(self.lines)
        (self.cwd / f"grpo-run-{self.proc.pid}.log").write_text(out)  # for a failure's reader
        return out


def _marked(cwd: Path) -> list[int]:
    """Live processes of the runs in ``cwd``, found by the marker in their environment."""
    needle = f"{MARKER}={cwd}".encode()
    found = []
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit() or int(pid_dir.name) == os.getpid():
            continue
        try:
            env = (pid_dir / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle in env:
            found.append(int(pid_dir.name))
    return found


def _kill_leftovers(cwd: Path, grace: float = 0.0) -> list[int]:
    """SIGKILL what a run left behind (a temporary Prefect server that outlived a killed
    run) once ``grace`` seconds have not seen it exit; returns their pids."""
    deadline = time.monotonic() + grace
    while (found := _marked(cwd)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return found


def _weights(run_dir: Path) -> dict[str, str]:
    return {
        s: hashlib.sha256(
            (run_dir / "checkpoints" / s / "model.safetensors").read_bytes()
        ).hexdigest()
        for s in STAGES
    }


def _accuracy_table(out: str) -> list[list[str]]:
    """The summary table's rows (stage, accuracy, format rate, mean length), wall time left
    out."""
    rows = [
        [c.strip() for c in line.strip().strip("│").split("│")]
        for line in out.splitlines()
        if line.startswith("│")
    ]
    return [r[:4] for r in rows if r and r[0] in STAGES]


def _adam_step(ckpt: Path) -> float:
    import torch

    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)["optimizer"]["state"]
    return float(next(iter(state.values()))["step"])


@pytest.mark.slow
def test_run_killed_at_four_points_ends_like_an_uninterrupted_run(tmp_path):
    t0 = time.perf_counter()
    code = tmp_path / "code"
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, code / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    reference = Run(code, tmp_path / "uninterrupted")
    try:
        resumed = tmp_path / "killed"
        outputs, leftovers = [], []
        for kill_on, _ in KILLS:
            run = Run(code, resumed, kill_on=kill_on)
            out = run.wait(timeout=240)
            assert run.killed, f"never saw {kill_on!r}:\n{out[-4000:]}"
            outputs.append(out)
            leftovers += run.leftovers
        final = Run(code, resumed)
        out = final.wait(timeout=240)
        assert final.proc.returncode == 0, out[-4000:]
        outputs.append(out)
        ref_out = reference.wait(timeout=240)
        assert reference.proc.returncode == 0, ref_out[-4000:]
    finally:
        for cwd in (tmp_path / "uninterrupted", tmp_path / "killed"):
            _kill_leftovers(cwd)

    # each rerun continued where the killed run stopped (SFT from its resume checkpoint, RL
    # from the last iteration's trainer state on disk)
    for (_, resumed_line), rerun in zip(KILLS, outputs[1:], strict=True):
        assert re.search(resumed_line, rerun), f"{resumed_line!r} not in:\n{rerun[-4000:]}"
    for stage, rerun in ((1, outputs[2]), (2, outputs[4])):
        assert re.search(REPLAYED_FROM.format(stage), rerun), rerun[-4000:]
    assert "Traceback" not in outputs[-1]
    for stage in ("cold_start_sft", "re_sft"):  # deleted once the stage is done
        assert not (resumed / "runs/r/checkpoints" / f"{stage}.resume").exists()

    assert _weights(resumed / "runs/r") == _weights(tmp_path / "uninterrupted/runs/r")
    table = _accuracy_table(outputs[-1])
    assert [r[0] for r in table] == list(STAGES)
    assert table == _accuracy_table(ref_out)
    # rl_2's AdamW starts at rl_2's first step: 2 optimizer steps per iteration; only the
    # save points' checkpoints are on disk
    for root in (resumed, tmp_path / "uninterrupted"):
        assert _adam_step(root / "runs/r/rl_2/iter_0004/checkpoint") == 10
        kept = sorted(p.parent.name for p in (root / "runs/r/rl_2").glob("iter_*/checkpoint"))
        assert kept == ["iter_0002", "iter_0004"]
    # the stage's final checkpoint is its last iteration's files, hard-linked, not copied
    root = tmp_path / "uninterrupted/runs/r"
    last_iteration = max((root / "rl_2").glob("iter_*")) / "checkpoint"
    for name in ("model.safetensors", "trainer_state.pt"):
        final, last = root / "checkpoints/rl_2" / name, last_iteration / name
        assert final.stat().st_ino == last.stat().st_ino, name
    print(
        f"kill/rerun test: {time.perf_counter() - t0:.0f}s; "
        f"{len(leftovers)} processes outlived the 4 killed runs: {leftovers}"
    )


# the tool demo's tiny budget with four RL iterations and save points at 1 and 3
TOOL_RESUME = {
    "rl.iterations": "4",
    "rl.eval_every": "4",
    "rl.save_steps": "2",
    "torch_threads": "1",
}
TOOL_OVERRIDES = _with(TOOL_TINY_OVERRIDES, TOOL_RESUME)


@pytest.mark.slow
def test_a_killed_tool_run_resumes_to_the_uninterrupted_weights(tmp_path):
    """The tool demo (configs/demo-tools.yaml, tiny) killed mid rl_1, once iteration 3's
    tool rollouts are recorded and being scored, before its update (iteration 2's state was
    not kept: save points 1 and 3): the rerun reuses the tool rollouts on disk, replays
    iteration 2's update from iteration 1's kept state and ends with the uninterrupted run's
    weights, bit for bit (RL changes them: a length reward spreads every group)."""
    from grpo_core.sandbox import SandboxUnavailable, detect_isolation

    try:
        detect_isolation()
    except SandboxUnavailable:
        pytest.skip("no sandbox isolation on this machine")
    code = tmp_path / "code"
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, code / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    # at this budget no completion is right: a reward for length gives every group some
    # spread, so each RL iteration moves the weights and a wrong replay would show
    (tmp_path / "length_reward.py").write_text(
        "def shorter(prompts, completions, completion_ids, **_):\n"
        "    return [8 / (8 + len(ids)) for ids in completion_ids]\n"
    )
    rewards = f'{{accuracy: 1.0, format: 0.1, "{tmp_path / "length_reward.py"}:shorter": 0.5}}'
    args = ["--config", str(code / "configs" / "demo-tools.yaml")]
    args += [a for o in [*TOOL_OVERRIDES, f"rewards={rewards}"] for a in ("--set", o)]
    try:
        reference = Run(code, tmp_path / "uninterrupted", args=args)
        ref_out = reference.wait(timeout=300)
        assert reference.proc.returncode == 0, ref_out[-4000:]
        run = Run(code, tmp_path / "killed", kill_on=r"rl_1 iteration 3: reward", args=args)
        out = run.wait(timeout=300)
        assert run.killed, f"never saw the scores of iteration 3:\n{out[-4000:]}"
        rollouts = tmp_path / "killed/runs/r/rl_1/iter_0003/rollouts.parquet"
        stamp = rollouts.stat().st_mtime_ns
        final = Run(code, tmp_path / "killed", args=args)
        out = final.wait(timeout=300)
        assert final.proc.returncode == 0, out[-4000:]
    finally:
        leftovers = [p for cwd in (tmp_path / "uninterrupted", tmp_path / "killed")
                     for p in _kill_leftovers(cwd, grace=3.0)]  # fmt: skip
    assert not leftovers, f"processes outlived their runs (the kill included): {leftovers}"
    assert rollouts.stat().st_mtime_ns == stamp  # the tool rollouts were not sampled again
    assert re.search(r"rl_1 iteration 2 replayed from", out), out[-4000:]
    killed, straight = tmp_path / "killed/runs/r", tmp_path / "uninterrupted/runs/r"
    weights = _weights(straight)
    assert weights["rl_1"] != weights["cold_start_sft"]  # RL moved them: the check has teeth
    assert _weights(killed) == weights
    assert _accuracy_table(out) == _accuracy_table(ref_out)

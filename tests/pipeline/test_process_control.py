"""`grpo run` killed, interrupted and started twice, as real processes on a real sqlite MLflow
store and Prefect's temporary server (flows/local_server.py, flows/interrupts.py,
flows/lock.py, tasks/tracking/stages.py, tasks/tracking/run_states.py, tasks/tracking/store.py).

One workspace goes through a user's bad day: SIGKILL in rl_1 (the temporary server dies
with it), a rerun stopped by SIGTERM in rl_1, a rerun stopped by Ctrl-C in rl_2, and a last
rerun that finishes while a second `grpo run` of the same folder is refused. Every resume
continues the same MLflow parent run, and no run is left RUNNING."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests_support import TINY_OVERRIDES

ROOT = Path(__file__).resolve().parents[2]
# the tiny budget, smaller still: these tests are about processes, not training
OVERRIDES = [
    *TINY_OVERRIDES,
    "sft.max_steps=6",
    "rl.iterations=2",
    "rl.eval_every=2",
    "data.demo.n_eval=8",
    "rejection_sampling.num_prompts=4",
    "re_sft.max_steps=2",
    "run_name=demo",
]
INTERRUPTED = re.compile(
    r"^grpo: interrupted \((SIGTERM|SIGINT)\) during (.+); rerun the same command to resume$"
)


def _terminal_sigint() -> None:
    """In the child, before exec: SIGINT as a terminal's foreground process has it. A test run
    started as a background job (``cmd &`` in a script) ignores SIGINT, and an ignored signal
    stays ignored across exec, so Ctrl-C would not reach the run."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Run:
    """One `grpo run` (or another `grpo` command) in its own session (as a shell runs a foreground command), output
    to files that the test reads while it runs."""

    def __init__(self, tmp: Path, tag: str, command: list[str] | None = None) -> None:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("PREFECT_API", "PREFECT_HOME", "MLFLOW_TRACKING_URI"))
        }
        env["PREFECT_HOME"] = str(tmp / "prefect-home")
        env["PYTHONPATH"] = str(ROOT)
        cmd = [sys.executable, "-m", "flows.cli"]
        cmd += command or ["run", *(a for o in OVERRIDES for a in ("--set", o))]
        cmd += ["--set", f"output_dir={tmp / 'runs'}"]
        self.out, self.err = tmp / f"{tag}.out", tmp / f"{tag}.err"
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen(
                cmd,
                env=env,
                cwd=tmp,
                stdout=out,
                stderr=err,
                start_new_session=True,
                preexec_fn=_terminal_sigint,
            )
        self.pid = self.proc.pid

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float = 150) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.stderr():
            assert self.proc.poll() is None, f"exited {self.proc.returncode}: {self.tail()}"
            assert time.monotonic() < deadline, f"no {text!r} after {timeout} s: {self.tail()}"
            time.sleep(0.1)

    def signal_group(self, sig: int) -> None:
        """What a terminal does on Ctrl-C: the signal to the foreground process group."""
        os.killpg(self.pid, sig)

    def wait(self, timeout: float = 150) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def tail(self) -> str:
        return self.stderr()[-3000:]

    def server_url(self) -> str:
        m = re.search(r"Temporary Prefect server on (http://\S+)/api", self.stderr())
        assert m, self.tail()
        return m.group(1)


def _server_pids(parent: int) -> list[int]:
    """Processes of the temporary Prefect server started by ``parent`` (the launcher passes
    its parent's pid on its command line)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        server = b"prefect.server.api.server:create_app" in argv
        if server and state != "Z" and str(parent).encode() in argv:
            pids.append(int(proc.name))
    return pids


def _answers(url: str) -> bool:
    host, port = url.split("//")[1].split(":")
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, int(port))) == 0


def _runs(tmp: Path) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    exps = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(exps, "", max_results=1000)


def _check_interrupted(run: Run, sig: int, stage: str) -> None:
    code = run.wait()
    err = run.stderr()
    assert code == 128 + sig, run.tail()
    assert "Traceback" not in err, run.tail()
    lines = [line for line in err.splitlines() if line.startswith("grpo:")]
    assert len(lines) == 1, lines
    m = INTERRUPTED.match(lines[0])
    assert m and m.group(1) == signal.Signals(sig).name, lines[0]
    assert m.group(2).startswith(stage), lines[0]
    assert err.rstrip().endswith(lines[0])  # the last word, after Prefect's own crash lines
    running = [r.info.run_name for r in _runs(run.err.parent) if r.info.status == "RUNNING"]
    assert not running, running


@pytest.mark.slow
def test_sigkill_in_async_mode_takes_the_server_down_at_once_and_quietly(tmp_path):
    """SIGKILL while an async run (``rl.async_level=1``) has a rollout and an update in
    flight: the temporary Prefect server is gone within 2 s, and nothing (no server
    traceback) is printed after the kill."""
    overrides = [*OVERRIDES, "rl.async_level=1", "rl.iterations=3", "rl.eval_every=3"]
    run = Run(tmp_path, "async-sigkill", ["run", *(a for o in overrides for a in ("--set", o))])
    run.wait_for("demo/rl_1/update-0")
    url = run.server_url()
    assert _server_pids(run.pid) and _answers(url)
    run.proc.send_signal(signal.SIGKILL)
    assert run.wait() == -signal.SIGKILL
    said = run.stderr()
    deadline = time.monotonic() + 2
    while (_server_pids(run.pid) or _answers(url)) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _server_pids(run.pid)
    assert not alive, f"the temporary Prefect server outlived the kill by 2 s: {alive}"
    assert not _answers(url), f"{url} still answers 2 s after the kill"
    time.sleep(3)  # what a dying server or engine process would still print
    after = run.stderr()[len(said) :]
    assert not after.strip(), (
        f"printed after the kill:\n{after[-3000:]}\nbefore it:\n{said[-2000:]}"
    )


@pytest.mark.slow
def test_kill_term_interrupt_resume_and_a_second_run(tmp_path):
    # 1. SIGKILL in rl_1: the temporary Prefect server dies with the process
    first = Run(tmp_path, "1-sigkill")
    first.wait_for("Beginning subflow run 'demo/rl_1'")
    url = first.server_url()
    servers = _server_pids(first.pid)
    assert servers and _answers(url)
    first.proc.send_signal(signal.SIGKILL)
    assert first.wait() == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while (_server_pids(first.pid) or _answers(url)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _server_pids(first.pid), "the temporary Prefect server outlived a SIGKILL"
    assert not _answers(url)
    killed = {r.info.run_id for r in _runs(tmp_path) if r.info.status == "RUNNING"}
    assert killed  # nothing could end them: the next run of the workspace does

    # 2. rerun, SIGTERM in an rl_1 iteration: exit 143, one line, runs KILLED
    second = Run(tmp_path, "2-sigterm")
    second.wait_for("demo/rl_1/rollout-1")
    second.proc.send_signal(signal.SIGTERM)
    _check_interrupted(second, signal.SIGTERM, "rl_1 iteration")
    runs = {r.info.run_id: r for r in _runs(tmp_path)}
    assert all(runs[k].info.status == "KILLED" for k in killed)
    assert not _server_pids(second.pid)

    # 3. rerun, Ctrl-C (SIGINT to the process group) in rl_2: exit 130, one line, KILLED
    third = Run(tmp_path, "3-sigint")
    third.wait_for("Beginning subflow run 'demo/rl_2'")
    third.signal_group(signal.SIGINT)
    _check_interrupted(third, signal.SIGINT, "rl_2")
    assert not _server_pids(third.pid)

    # 4. rerun to the end; a second `grpo run` of the same folder is refused meanwhile
    last = Run(tmp_path, "4-finish")
    last.wait_for("Temporary Prefect server on")  # holds the lock by then
    other = Run(tmp_path, "5-second")
    assert other.wait(timeout=60) == 2, other.tail()
    message = other.stderr().strip()
    assert re.fullmatch(
        rf"grpo: error: run demo \(pid {last.pid}, started \d\d:\d\d\) is using "
        rf"{re.escape(str(tmp_path / 'runs' / 'demo'))}; wait for it or use --set run_name=\.\.\.",
        message,
    ), message
    assert last.wait() == 0, last.tail()
    assert "Traceback" not in last.stderr()

    runs = _runs(tmp_path)
    assert not [r.info.run_name for r in runs if r.info.status == "RUNNING"]
    parents = [r for r in runs if r.data.tags.get("pipeline") == "r1"]
    assert len(parents) == 1, "a resumed run continues its parent run"
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["grpo.resumes"] == "3"
    assert parent.data.tags["grpo.pid"] == str(last.pid)
    statuses = {r.info.status for r in runs}
    assert statuses == {"FINISHED", "KILLED"}
    # `grpo compare` reads each stage from its finished attempt, not the killed ones too
    from mlflow.tracking import MlflowClient

    from flows.compare import load_pipeline_run

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    stages = {s.stage: s for s in load_pipeline_run(client, parent).stages}
    assert len(stages["rl_1"].rewards) == 2 and len(stages["rl_2"].rewards) == 1


_OPEN_STORE = """
import sys, time
from pathlib import Path
from tasks.tracking.stages import Tracking
uri, barrier, me, n = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
(barrier / me).touch()  # imported; go when every process is
while len(list(barrier.iterdir())) < n:
    time.sleep(0.001)
t = Tracking.open(uri, "race").start_parent("r", {})
t.end(t.parent_run_id)
print("opened")
"""


def test_processes_opening_a_fresh_sqlite_store_at_once_all_succeed(tmp_path):
    """Without the store lock, two or three of these fail on "table ... already exists" or
    a half-done migration (MLflow 3.x, most tries)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    barrier = tmp_path / "ready"
    barrier.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_DISABLE_TELEMETRY": "true"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _OPEN_STORE, uri, str(barrier), str(i), "3"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(3)
    ]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and "opened" in out, err[-2000:]
    assert len(_runs(tmp_path)) == 3


def test_workspace_lock_nests_in_its_thread_and_names_its_owner(tmp_path):
    import threading

    from flows.lock import WorkspaceBusy, acquire_workspace

    with acquire_workspace(tmp_path, "demo") as lock:
        assert acquire_workspace(tmp_path, "demo") is lock  # the CLI, then the flow
        lock.release()
        errors = []

        def other_thread():
            try:
                acquire_workspace(tmp_path, "demo")
            except WorkspaceBusy as e:
                errors.append(str(e))

        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        assert errors and f"pid {os.getpid()}" in errors[0]
    # released: another process takes it
    code = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from flows.lock import acquire_workspace; "
            "acquire_workspace(sys.argv[1], 'demo')",
            str(tmp_path),
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    ).returncode
    assert code == 0


@pytest.fixture
def terminal_sigint():
    """Ctrl-C raises KeyboardInterrupt in this process, as in a terminal, even when pytest
    was started as a background job (which inherits SIGINT ignored)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_store_calls_hold_a_signal_until_they_end_and_a_second_one_at_once(terminal_sigint):
    from tasks.tracking.store import signals_deferred

    steps = []
    with pytest.raises(KeyboardInterrupt), signals_deferred():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # a handler runs between two bytecodes: not here
        steps.append("finished")
    assert steps == ["finished"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    with pytest.raises(KeyboardInterrupt), signals_deferred():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C twice: do not wait
        time.sleep(0.05)
        steps.append("not reached")
    assert steps == ["finished"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.slow
def test_a_stage_command_stops_on_sigterm_with_one_line(tmp_path, tiny_checkpoint):
    from grpo_core.contracts.io import write_jsonl
    from grpo_core.demo.task import make_splits

    rows = write_jsonl(  # enough rows that the eval still runs when SIGTERM comes
        make_splits(0, n_sft=1, n_rl=1, n_dev=0, n_eval=3000).eval, tmp_path / "e.jsonl"
    )
    run = Run(tmp_path, "eval", ["eval", "--checkpoint", str(tiny_checkpoint), "--data", str(rows)])
    run.wait_for("Beginning flow run")
    run.signal_group(signal.SIGTERM)
    assert run.wait() == 128 + signal.SIGTERM, run.tail()
    err = run.stderr()
    assert "Traceback" not in err, run.tail()
    m = INTERRUPTED.match(err.strip().splitlines()[-1])
    assert m and m.group(1) == "SIGTERM" and m.group(2) == "eval", run.tail()

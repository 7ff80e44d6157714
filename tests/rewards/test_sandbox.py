"""Hostile programs, really run. Each must score 0, be reported, and leave the scorer and
the machine unharmed. Dangerous ones (fork bomb, kill -1) run only where the sandbox can
contain them (pid namespace + an enforced RLIMIT_NPROC)."""

import os
import re
import secrets
import textwrap
import time
from pathlib import Path

import pytest

from grpo_core.rewards.code import run_many
from grpo_core.rewards.sandbox import Limits, detect_isolation, run_program

LIMITS = Limits(wall_seconds=4.0, cpu_seconds=1, memory_bytes=512 << 20, nproc=16)
ISO = detect_isolation()
CONTAINED = ISO.nproc_enforced and ISO.mode in ("bwrap", "unshare")
TOKEN = secrets.token_hex(6)
OUTSIDE = [f"/tmp/grpo-escape-{TOKEN}", f"/work/grpo-escape-{TOKEN}", f"/root/grpo-escape-{TOKEN}"]
SECRET = "s3cr3t-" + TOKEN

ADD_TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(5, 5) == 10"]
GOOD = "def add(a, b):\n    return a + b\n"


def prog(src: str) -> str:
    return textwrap.dedent(src).strip() + "\n"


HOSTILE = {
    "infinite_loop": prog("while True:\n    pass"),
    "sleep_forever": prog("import time\ntime.sleep(1000)"),
    "memory_bomb": prog("""
        blocks = []
        while True:
            blocks.append(bytearray(50 << 20))
    """),
    "huge_alloc": prog("x = bytearray(1 << 40)"),
    "write_outside": prog(f"""
        import os
        for p in {OUTSIDE!r}:
            try:
                with open(p, "w") as f:
                    f.write("pwned")
            except OSError:
                pass
        def add(a, b):
            return 0
    """),
    "read_secret": prog(f"""
        import os
        leaked = os.environ.get("GRPO_SANDBOX_SECRET", "")
        for p in ["/proc/1/environ", "/proc/self/environ", "/proc/{os.getpid()}/environ"]:
            try:
                leaked += open(p, "rb").read().decode("latin-1")
            except OSError:
                pass
        def add(a, b):
            return a + b if "{SECRET}" in leaked else 0  # only a leak passes
    """),
    "read_repo": prog("""
        def add(a, b):
            try:
                open("/work/main/pyproject.toml").read()
                return a + b  # only a sandbox that shows the host filesystem passes
            except OSError:
                return None
    """),
    "network": prog("""
        import socket
        def add(a, b):
            try:
                socket.create_connection(("1.1.1.1", 53), timeout=1).close()
                return a + b
            except OSError:
                return None
    """),
    "sys_exit_module": prog("import sys\nsys.exit(0)\ndef add(a, b):\n    return 0"),
    "os_exit_module": prog("import os\nos._exit(0)"),
    "sys_exit_in_candidate": prog("import sys\ndef add(a, b):\n    sys.exit(0)"),
    "os_exit_in_candidate": prog("import os\ndef add(a, b):\n    os._exit(0)"),
    "atexit_exit0": prog("""
        import atexit, os
        atexit.register(os._exit, 0)
        def add(a, b):
            return 0
    """),
    "keyboard_interrupt": prog("def add(a, b):\n    raise KeyboardInterrupt"),
    "sigkill_self": prog(
        "import os, signal\ndef add(a, b):\n    os.kill(os.getpid(), signal.SIGKILL)"
    ),
    "always_equal": prog("""
        class Yes:
            def __eq__(self, other):
                return True
            def __bool__(self):
                return True
        def add(a, b):
            return Yes()
    """),
    "forge_records": prog("""
        import json, os, sys
        fake = "\\n".join(json.dumps([n, "assert", f"a{i}.0", True, ""]) for n in ["", "0" * 32] for i in range(3))
        for fd in range(1, 64):
            try:
                os.write(fd, (fake + "\\n").encode())
            except OSError:
                pass
        print(fake)
        def add(a, b):
            return 0
    """),
    "fork_then_pass": prog("""
        import os
        pid = os.fork()
        def add(a, b):
            return a + b if pid == 0 else 0  # only the forked child is correct
    """),
}
DANGEROUS = {
    "fork_bomb": prog("""
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """),
    "fork_bomb_setsid": prog("""
        import os, time
        for _ in range(10000):
            try:
                if os.fork() == 0:
                    os.setsid()
                    time.sleep(1000)
            except OSError:
                pass
        def add(a, b):
            return 0
    """),
    "kill_parent": prog("""
        import os, signal
        for target in (os.getppid(), 1):
            try:
                os.kill(target, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
        def add(a, b):
            return 0
    """),
}


def _sandbox_pids() -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                uid = d.stat().st_uid
                state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if 100_000 <= uid < 900_000 and state != "Z":
                out.append(int(d.name))
    return out


def sandbox_uids_alive(grace: float = 3.0) -> list[int]:
    """Live processes of sandbox uids, after giving the kernel ``grace`` s to reap them."""
    deadline = time.monotonic() + grace
    while (pids := _sandbox_pids()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


@pytest.fixture(scope="module")
def hostile_results(monkeypatch_module):
    monkeypatch_module.setenv("GRPO_SANDBOX_SECRET", SECRET)
    progs = dict(HOSTILE)
    if CONTAINED:
        progs.update(DANGEROUS)
    progs["good"] = GOOD
    jobs = [{"program": p, "kind": "asserts", "tests": ADD_TESTS} for p in progs.values()]
    results = run_many(jobs, limits=LIMITS, workers=2, progress=False)
    return dict(zip(progs, results, strict=True))


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_scores_zero(hostile_results, name):
    res = hostile_results[name]
    assert res.passed == 0, (name, res)
    assert res.fraction == 0.0
    assert res.total >= len(ADD_TESTS)
    assert res.error, f"{name} must be reported"


@pytest.mark.skipif(not CONTAINED, reason=f"isolation {ISO} cannot contain fork bombs / kill -1")
@pytest.mark.parametrize("name", sorted(DANGEROUS))
def test_dangerous_contained(hostile_results, name):
    res = hostile_results[name]
    assert res.passed == 0 and res.error, res
    assert res.wall_s < LIMITS.wall_seconds + 3


def test_reports_say_why(hostile_results):
    assert hostile_results["infinite_loop"].status in ("killed", "timeout")
    # killed by the CPU rlimit, or by the wall clock first when the machine is loaded
    assert re.search("SIGXCPU|timeout", hostile_results["infinite_loop"].error)
    assert hostile_results["sleep_forever"].status == "timeout"
    assert "timeout" in hostile_results["sleep_forever"].error
    assert hostile_results["os_exit_module"].status == "exited"
    assert "before the tests finished" in hostile_results["os_exit_in_candidate"].error
    assert "MemoryError" in hostile_results["huge_alloc"].error


def test_scorer_and_machine_unharmed(hostile_results):
    assert hostile_results["good"].fraction == 1.0 and hostile_results["good"].error is None
    for p in OUTSIDE:
        assert not os.path.exists(p), f"sandbox escaped: {p}"
    assert os.environ["GRPO_SANDBOX_SECRET"] == SECRET  # we are alive, env intact
    assert sandbox_uids_alive() == [], "sandbox processes survived the run"
    assert os.getppid() != 1 or os.getpid() == 1  # parent still there
    # the scorer still works after the hostile batch
    assert run_program(GOOD, kind="asserts", tests=ADD_TESTS, limits=LIMITS).fraction == 1.0


def test_partial_credit_and_humaneval():
    half = "def add(a, b):\n    return a + b if a < 5 else 0\n"
    res = run_program(half, kind="asserts", tests=ADD_TESTS, limits=LIMITS)
    assert (res.passed, res.total) == (2, 3)
    test = "def check(candidate):\n    assert candidate(1, 2) == 3\n    for i in range(4):\n        assert candidate(i, 0) == i\n"
    res = run_program(
        "def f(a, b):\n    return a + b\n",
        kind="humaneval",
        tests=test,
        entry_point="f",
        limits=LIMITS,
    )
    assert (res.passed, res.total, res.error) == (5, 5, None)
    res = run_program(
        "def f(a, b):\n    return 1/0\n",
        kind="humaneval",
        tests=test,
        entry_point="f",
        limits=LIMITS,
    )
    assert (res.passed, res.total) == (0, 5)
    assert "ZeroDivisionError" in res.error


def test_timeout_kills_whole_group():
    src = "import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\nimport time\ntime.sleep(60)"
    res = run_program(src, kind="run", limits=Limits(wall_seconds=1.5, cpu_seconds=1))
    assert res.status == "timeout"
    assert sandbox_uids_alive() == []


def test_signal_exit_code_not_trusted():
    res = run_program(
        "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)", kind="run", limits=LIMITS
    )
    assert res.status == "killed" and not res.program_ok

"""Hostile programs, really run, under every isolation mode this machine has: ``bwrap``,
``namespaces``, and ``auto`` with bwrap hidden from PATH (what a fresh machine without
bubblewrap gets). Each program must score 0, be reported, and leave the scorer and the host
unharmed: no file outside, no surviving process, no connection to a listening port, the
scorer's environment unread. ``none`` runs only the programs that cannot harm the host (it
is not isolation), and ``auto`` must fail closed where nothing can isolate."""

import contextlib
import logging
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from grpo_core import rewards
from grpo_core.rewards.code import run_many
from grpo_core.sandbox import (
    Limits,
    SandboxUnavailable,
    detect_isolation,
    isolation,
    launcher,
    requested_isolation,
    run_program,
)

from .sandbox_programs import (
    ADD_TESTS,
    GOOD,
    HARMLESS,
    LIMITS,
    MODES,
    OUTSIDE,
    SECRET,
    available,
    bwrap_hidden,
    hostile,
    prog,
    sandbox_uids_alive,
)


@pytest.fixture(scope="module")
def listener():
    """A port listening on 127.0.0.1 of the scorer's machine; yields (port, accepted())."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.setblocking(False)

    def accepted() -> int:
        n = 0
        while True:
            try:
                conn, _ = srv.accept()
            except BlockingIOError:
                return n
            conn.close()
            n += 1

    yield srv.getsockname()[1], accepted
    srv.close()


@pytest.fixture(scope="module", params=MODES)
def batch(request, listener):
    """Every hostile program (and a correct one) under one isolation mode, two at a time."""
    mode = request.param
    port, accepted = listener
    mp = pytest.MonkeyPatch()
    mp.setenv("GRPO_SANDBOX_SECRET", SECRET)
    progs = {**hostile(port), "good": GOOD}
    jobs = [{"program": p, "kind": "asserts", "tests": ADD_TESTS} for p in progs.values()]
    try:
        if mode == "auto-without-bwrap":
            with bwrap_hidden():
                assert detect_isolation().mode == "namespaces"
                results = run_many(jobs, limits=LIMITS, workers=2, progress=False)
        else:
            results = run_many(jobs, limits=LIMITS, workers=2, progress=False, isolation=mode)
        alive = sandbox_uids_alive()  # right after the verdicts: no grace
        yield {
            "mode": mode,
            "results": dict(zip(progs, results, strict=True)),
            "alive": alive,
            "connections": accepted(),
        }
    finally:
        mp.undo()
        for p in OUTSIDE:
            with contextlib.suppress(OSError):
                os.remove(p)


@pytest.mark.parametrize("name", sorted(hostile(0)))
def test_hostile_scores_zero(batch, name):
    res = batch["results"][name]
    assert res.passed == 0, (batch["mode"], name, res)
    assert res.fraction == 0.0
    assert res.total >= len(ADD_TESTS)
    assert res.error, f"{name} must be reported"


def test_no_trace_on_the_host(batch):
    assert batch["results"]["good"].fraction == 1.0 and batch["results"]["good"].error is None
    for p in OUTSIDE:
        assert not os.path.exists(p), f"sandbox escaped ({batch['mode']}): {p}"
    assert batch["alive"] == [], "sandbox processes outlived their verdict"
    assert batch["connections"] == 0, "a sandboxed program reached 127.0.0.1 of the host"
    assert os.environ.get("GRPO_SANDBOX_SECRET") == SECRET  # the scorer's env is intact
    assert os.getppid() != 1 or os.getpid() == 1  # parent still there
    assert run_program(GOOD, kind="asserts", tests=ADD_TESTS, limits=LIMITS).fraction == 1.0


def test_contained_quickly(batch):
    for name in ("fork_bomb", "fork_bomb_setsid", "kill_parent", "memory_bomb"):
        res = batch["results"][name]
        assert res.wall_s < LIMITS.wall_seconds + 3, (name, res)


def test_reports_say_why(batch):
    res = batch["results"]
    assert res["infinite_loop"].status in ("killed", "timeout")
    # killed by the CPU rlimit, or by the wall clock first when the machine is loaded
    assert re.search("SIGXCPU|timeout", res["infinite_loop"].error)
    assert res["sleep_forever"].status == "timeout"
    assert "timeout" in res["sleep_forever"].error
    assert res["os_exit_module"].status == "exited"
    assert "before the tests finished" in res["os_exit_in_candidate"].error
    assert "MemoryError" in res["huge_alloc"].error


@pytest.mark.parametrize("mode", MODES)
def test_detached_daemon_dies_with_the_verdict(mode, tmp_path):
    """The program has one process: a fork (for a double-forked, setsid daemon that would
    act after the verdict) is refused, and nothing of the sandbox outlives run_program."""
    src = prog("""
        import os, time
        try:
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    time.sleep(1.5)  # after the verdict
                    for p in ("/tmp/late", "/work/late"):
                        try:
                            open(p, "w").write("late")
                        except OSError:
                            pass
                    time.sleep(60)
                os._exit(0)
            refused = False
        except PermissionError:
            refused = True
        def add(a, b):
            return a + b if refused else 0
    """)
    iso = None if mode == "auto-without-bwrap" else mode
    with bwrap_hidden() if iso is None else contextlib.nullcontext():
        res = run_program(src, kind="asserts", tests=ADD_TESTS, limits=LIMITS, isolation=iso)
    assert sandbox_uids_alive() == [], "a sandbox process outlived the verdict"
    assert res.fraction == 1.0, res  # the fork was refused, the program itself correct
    time.sleep(1.7)
    assert sandbox_uids_alive() == [] and not os.path.exists("/work/late")


@pytest.mark.parametrize("mode", MODES)
def test_timeout_kills_whole_namespace(mode):
    """A candidate stuck in a call, and a program that tries to leave a process behind:
    the harness and the candidate process both end with the timeout."""
    src = prog("""
        import subprocess, sys, time
        try:
            subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(60)"])
        except OSError:
            pass
        def add(a, b):
            time.sleep(60)
    """)
    iso = None if mode == "auto-without-bwrap" else mode
    with bwrap_hidden() if iso is None else contextlib.nullcontext():
        res = run_program(
            src, kind="asserts", tests=ADD_TESTS, limits=Limits(wall_seconds=1.5), isolation=iso
        )
    assert res.status == "timeout" and (res.passed, res.total) == (0, 3)
    assert sandbox_uids_alive() == []


@pytest.mark.parametrize("mode", MODES)
def test_signal_exit_code_not_trusted(mode):
    iso = None if mode == "auto-without-bwrap" else mode
    with bwrap_hidden() if iso is None else contextlib.nullcontext():
        res = run_program(
            "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)",
            kind="run",
            limits=LIMITS,
            isolation=iso,
        )
    assert res.status == "killed" and not res.program_ok and "SIGTERM" in res.error


@pytest.mark.parametrize("mode", MODES)
def test_private_tmpfs_and_readonly_rest(mode):
    """The program may write its working directory and /tmp (a private tmpfs), nothing else;
    the Python installation is readable (as the unprivileged uid when the scorer is root)."""
    src = prog(f"""
        import os, sys
        open("here.txt", "w").write("ok")
        open("/tmp/t.txt", "w").write("ok")
        for p in ["/usr/x", sys.prefix + "/x", "/x", "/proc/sys/kernel/hostname"]:
            try:
                open(p, "w").write("x")
                raise SystemExit(f"wrote {{p}}")
            except OSError:
                pass
        if {os.geteuid() == 0} and os.getuid() == 0:
            raise SystemExit("runs as root")
    """)
    iso = None if mode == "auto-without-bwrap" else mode
    with bwrap_hidden() if iso is None else contextlib.nullcontext():
        res = run_program(src, kind="run", limits=LIMITS, isolation=iso)
    assert res.status == "ok" and res.program_ok, res


def test_auto_without_bwrap_is_namespaces_not_weaker():
    if not available("namespaces"):
        pytest.skip("no namespaces here")
    with bwrap_hidden():
        iso = detect_isolation()
    assert iso.mode == "namespaces" and iso.contained and iso.nproc_enforced


def test_none_only_when_named_and_logged(caplog, tmp_path):
    with caplog.at_level(logging.WARNING, logger="grpo_core.sandbox"):
        isolation._detect.cache_clear()
        iso = detect_isolation("none")
    assert iso.mode == "none" and not iso.contained
    assert "NOT isolated" in caplog.text and "on purpose" in caplog.text
    progs = hostile(0)
    jobs = [{"program": progs[n], "kind": "asserts", "tests": ADD_TESTS} for n in HARMLESS]
    results = run_many(jobs, limits=LIMITS, workers=2, progress=False, isolation="none")
    for name, res in zip(HARMLESS, results, strict=True):
        assert res.passed == 0 and res.error, (name, res)


def _no_namespaces(monkeypatch):
    """This machine as one where neither bwrap nor namespaces can run."""
    fail = "import os\nos.write(2, b'sandbox setup failed: unshare: Operation not permitted\\n')\n"
    monkeypatch.setattr(launcher, "_NSINIT", fail + "os._exit(125)\n")
    isolation._detect.cache_clear()


def test_fails_closed_when_nothing_isolates(monkeypatch):
    _no_namespaces(monkeypatch)
    with bwrap_hidden():
        with pytest.raises(SandboxUnavailable) as err:
            detect_isolation()
        msg = str(err.value)
        assert "bubblewrap is not installed" in msg and "Operation not permitted" in msg
        assert "apt-get install bubblewrap" in msg and "sandbox.isolation=none" in msg
        # the executing rewards refuse: score_completions stops instead of scoring rows
        cols = {"test_list": [ADD_TESTS]}
        for name in ("code_tests", "code_runs"):
            with pytest.raises(SandboxUnavailable):
                rewards.score_completions(["p"], [GOOD], cols, {name: 1.0})
        with pytest.raises(SandboxUnavailable, match="bubblewrap is not installed"):
            run_program(GOOD, kind="asserts", tests=ADD_TESTS, isolation="bwrap")
        # named on purpose, the weaker mode runs
        assert run_program(GOOD, kind="asserts", tests=ADD_TESTS, isolation="none").fraction == 1
    isolation._detect.cache_clear()


def test_isolation_names(monkeypatch):
    assert requested_isolation() == "auto"
    monkeypatch.setenv("GRPO_SANDBOX_ISOLATION", "namespaces")
    assert requested_isolation() == "namespaces"
    assert requested_isolation("bwrap") == "bwrap"  # an explicit argument wins
    monkeypatch.setenv("GRPO_SANDBOX_ISOLATION", "unshare")
    with pytest.raises(ValueError, match="GRPO_SANDBOX_ISOLATION"):
        requested_isolation()
    with pytest.raises(ValueError, match="auto, bwrap, namespaces, none"):
        requested_isolation("chroot")


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
    assert (res.passed, res.total, res.error) == (2, 2, None)  # per assert statement
    res = run_program(
        "def f(a, b):\n    return 1/0\n",
        kind="humaneval",
        tests=test,
        entry_point="f",
        limits=LIMITS,
    )
    assert (res.passed, res.total) == (0, 2)
    assert "ZeroDivisionError" in res.error


def test_namespaces_as_an_unprivileged_scorer(tmp_path):
    """A scorer that is not root gets the same isolation through a user namespace mapping
    only its own uid (run here as uid 65534 with the system's Python)."""
    py = shutil.which("python3", path="/usr/bin:/bin")
    if os.geteuid() != 0 or shutil.which("setpriv") is None or py is None:
        pytest.skip("needs root (to become another user), setpriv and /usr/bin/python3")
    if not available("namespaces"):
        pytest.skip("no namespaces here")
    work = Path(tempfile.mkdtemp(prefix="grpo-nonroot-"))
    try:
        (work / "sandbox.py").write_text(launcher._NSINIT + "\n" + launcher._HARNESS)
        (work / "candidate.py").write_text(launcher.CANDIDATE)
        (work / "run.py").write_text(
            prog(f"""
            import json, os, subprocess, sys, tempfile
            code = open({str(work / "sandbox.py")!r}).read()
            r, w = os.pipe()
            cfg = {{"root": tempfile.mkdtemp(), "uid": None, "fd": w, "roots": [],
                    "rlimits": {{"RLIMIT_NPROC": [16, 16]}}, "tmp_bytes": 1 << 24,
                    "parent": os.getpid(), "deadline": 30}}
            prog = ("import os\\nfor p in ['/usr/x', '/x', {str(work / "escape")!r}]:\\n"
                    "    try:\\n        open(p, 'w')\\n        raise SystemExit(p)\\n"
                    "    except OSError:\\n        pass\\ndef add(a, b):\\n    return a + b\\n")
            payload = {{"kind": "asserts", "program": prog, "tests": ["assert add(1, 2) == 3"],
                        "candidates": ["add"], "nonce": "n0",
                        "candidate_code": open({str(work / "candidate.py")!r}).read()}}
            p = subprocess.Popen([sys.executable, "-I", "-B", "-c", code, json.dumps(cfg)],
                                 stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                 pass_fds=(w,), env={{"PATH": "/usr/bin:/bin"}})
            os.close(w)
            p.communicate(json.dumps(payload).encode(), timeout=60)
            out = b""
            while chunk := os.read(r, 65536):
                out += chunk
            print(out.decode())
        """)
        )
        os.chmod(work, 0o755)
        for f in work.iterdir():
            os.chmod(f, 0o644)
        proc = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", py, work / "run.py"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if "sandbox setup failed: unshare" in proc.stderr:
            pytest.skip("unprivileged user namespaces are not allowed here")
        records = [line for line in proc.stdout.splitlines() if line.startswith('["n0"')]
        assert '["n0","program","",true,""]' in records, proc.stderr
        assert '["n0","assert","a0.0",true,""]' in records, proc.stderr
        assert not (work / "escape").exists()
    finally:
        shutil.rmtree(work, ignore_errors=True)


CUT_SHORT = {
    # answers the first call, then ends the verdict early (issue 44): each scored 1.0 before
    "kill_harness": "os.kill(os.getppid(), signal.SIGKILL)",
    "stop_harness": "os.kill(os.getppid(), signal.SIGSTOP)",
    "sleep_to_timeout": "time.sleep(60)",
}
LOOP_TESTS = ["cases = [((1, 2), 3), ((2, 2), 4), ((5, 5), 10)]\n"
              "for args, want in cases:\n    assert add(*args) == want"]  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", sorted(CUT_SHORT))
def test_a_verdict_cut_short_pays_nothing_for_an_unfinished_loop(mode, how):
    """An assert in a loop whose first run passed does not count when the harness never got
    to the loop's end: killed, stopped or timed out, the verdict is unfinished and the assert
    failed."""
    src = prog(f"""
        import os, signal, time
        calls = 0
        def add(a, b):
            global calls
            calls += 1
            if calls > 1:
                {CUT_SHORT[how]}
            return a + b
    """)
    iso = None if mode == "auto-without-bwrap" else mode
    with bwrap_hidden() if iso is None else contextlib.nullcontext():
        res = run_program(src, kind="asserts", tests=LOOP_TESTS, limits=Limits(wall_seconds=2.0),
                          isolation=iso)  # fmt: skip
        good = run_program(GOOD, kind="asserts", tests=LOOP_TESTS, limits=LIMITS, isolation=iso)
    assert (res.passed, res.total) == (0, 1), res
    assert res.status != "ok" and res.error
    assert (good.passed, good.total) == (1, 1), good  # a correct program still gets it
    assert sandbox_uids_alive(grace=2.0) == []


def test_a_killed_scorers_folders_are_swept(tmp_path, monkeypatch):
    """A scorer killed with SIGKILL runs no cleanup: its grpo-sandbox-<pid>-* folders stay.
    The next scorer process removes those of dead pids, never a live one's (issue 44)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(launcher, "_SWEPT", set())
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = tmp_path / f"grpo-sandbox-{dead.pid}-abc"
    (orphan / "tmp").mkdir(parents=True)
    alive = tmp_path / f"grpo-sandbox-{os.getpid()}-def"
    alive.mkdir()
    other = tmp_path / "grpo-sandbox-err-xyz"
    other.write_text("")
    launcher._sweep_orphans()
    assert not orphan.exists()
    assert alive.exists() and other.exists()

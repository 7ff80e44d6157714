"""Tool calls that fail or attack: the code reward's hostile-program suite runs as python
tool calls (grpo_core/engines/environments.py), under the isolation this machine picks. Each call
ends as an observation (an error one where it failed), nothing reaches the host, nothing is
left running, and the scorer's environment is intact."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
from rewards.sandbox_programs import (
    OUTSIDE,
    SECRET,
    available,
    hostile,
    isolation_or_skip,
    run_as_pid_1,
    sandbox_uids_alive,
)

from grpo_core.engines.environments import PythonTool, ToolSpec

pytestmark = pytest.mark.skipif(not available(), reason="no sandbox isolation on this machine")
SPEC = ToolSpec(tool_timeout_s=4.0, tool_memory_mb=512, max_tool_output_tokens=32)


@pytest.fixture(
    scope="module",
    params=[(iso, mode) for iso in ("bwrap", "namespaces") for mode in ("warm", "fresh")],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def calls(request):
    """The hostile suite as tool calls, under each isolation, on a warm sandbox (a clean
    process forked per call) and on a fresh sandbox per call."""
    iso, mode = request.param
    isolation_or_skip(iso)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.setblocking(False)
    port = srv.getsockname()[1]
    mp = pytest.MonkeyPatch()
    mp.setenv("GRPO_SANDBOX_SECRET", SECRET)
    programs = hostile(port)
    tool = PythonTool(
        dataclasses.replace(SPEC, tool_isolation=iso, tool_sandbox=mode, tool_workers=2)
    )
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:  # as the turn loop runs a turn's calls
            observations = list(pool.map(tool.run, programs.values()))
        alive = sandbox_uids_alive()
        connections = 0
        with contextlib.suppress(BlockingIOError):
            while True:
                srv.accept()[0].close()
                connections += 1
        yield dict(zip(programs, observations, strict=True)), alive, connections
    finally:
        mp.undo()
        srv.close()
        for p in OUTSIDE:
            with contextlib.suppress(OSError):
                os.remove(p)


def test_every_hostile_call_is_an_observation_and_the_host_is_untouched(calls):
    observations, alive, connections = calls
    for name, obs in observations.items():
        assert obs.text.startswith(SPEC.tool_result_start) and obs.text.endswith(
            SPEC.tool_result_end
        ), name
        assert obs.seconds < SPEC.tool_timeout_s + 5, (name, obs.seconds)
    for p in OUTSIDE:
        assert not os.path.exists(p), f"a tool call escaped: {p}"
    assert alive == [], "tool-call processes outlived the call"
    assert connections == 0, "a tool call reached 127.0.0.1 of the host"
    assert os.environ.get("GRPO_SANDBOX_SECRET") == SECRET
    assert SECRET not in "".join(o.text for o in observations.values())


def test_failures_say_why(calls):
    observations, _, _ = calls
    assert observations["infinite_loop"].error  # CPU limit or wall clock
    assert observations["memory_bomb"].error
    assert observations["sleep_forever"].error.startswith("timeout")
    assert observations["fork_bomb"].error  # its forks refused, it loops to its limit


def test_a_flood_of_output_is_cut_and_the_next_call_still_runs():
    tool = PythonTool(SPEC)
    flood = tool.run("print('7' * (50 << 20))")
    assert len(flood.text) < 10_000 and "more characters" in flood.text
    assert tool.run("print(6*7)").text == f"{SPEC.tool_result_start}42{SPEC.tool_result_end}"


FORGE_THEN_RAISE = """
import json, os, sys
os.write(int(sys.argv[2]), (json.dumps({"ok": True, "error": "", "output": "42"}) + "\\n").encode())
raise ValueError("the call failed")
"""


@pytest.mark.parametrize("isolation", ["bwrap", "namespaces"])
def test_a_reply_forged_on_the_pipe_does_not_hide_a_failed_call(isolation):
    """The program writes ``{"ok": true}`` on the candidate's reply pipe, then raises: the
    observation still says the call failed (the exit status decides, read from outside)."""
    isolation_or_skip(isolation)
    tool = PythonTool(ToolSpec(tool_isolation=isolation))
    obs = tool.run(FORGE_THEN_RAISE)
    assert obs.error is not None
    assert tool.run("print(6 * 7)").error is None


def test_hashing_is_the_same_on_every_call():
    """str hashing and set order do not change between calls (nor between a run and its
    resume): the sandbox fixes PYTHONHASHSEED for the program."""
    tool = PythonTool(ToolSpec())
    code = "print(hash('grpo'), list({'a', 'b', 'c', 'd', 'e', 'f', 'g'}))"
    outputs = {tool.run(code).text for _ in range(3)}
    assert len(outputs) == 1


SYSV_IPC = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
shm = libc.shmget(0, 300 << 20, 0o1000 | 0o600)  # IPC_PRIVATE, IPC_CREAT
shm_errno = ctypes.get_errno()
msg = libc.msgget(0, 0o1000 | 0o600)
print(shm, shm_errno, msg, ctypes.get_errno())
"""


@pytest.mark.parametrize("isolation", ["bwrap", "namespaces"])
def test_sysv_shared_memory_and_queues_are_refused(isolation):
    """SysV shared memory and message queues are kernel memory outside the call's address-space
    cap: the sandbox refuses them (EPERM), as a tool call and as a code reward."""
    import errno

    from grpo_core.rewards.code import code_runs

    isolation_or_skip(isolation)
    obs = PythonTool(ToolSpec(tool_isolation=isolation)).run(SYSV_IPC)
    assert obs.error is None, obs.text
    body = obs.text.removeprefix("<tool_response>").removesuffix("</tool_response>")
    assert body.split() == ["-1", str(errno.EPERM), "-1", str(errno.EPERM)]
    held = SYSV_IPC + "assert shm >= 0 or msg >= 0\n"
    (score,) = code_runs([""], [f"```python\n{held}```"], sandbox_isolation=isolation)
    assert score == 0.0


ZOMBIES = """
import os
from grpo_core.engines.environments import PythonTool, ToolSpec
tool = PythonTool(ToolSpec(tool_isolation=os.environ["ISO"]))
for _ in range(5):
    tool.run("print(1)")
zombies = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        continue
    if stat[stat.rfind(")") + 2 :].split()[0] == "Z":
        zombies.append(stat[stat.find("(") + 1 : stat.rfind(")")])
print(os.getpid(), len(zombies))
"""


@pytest.mark.parametrize("isolation", ["bwrap", "namespaces"])
def test_no_zombie_is_left_under_a_pid_1_that_does_not_reap(isolation):
    """As a container's entry point (here ``unshare --pid --fork``: the scorer is PID 1 and
    nothing else reaps), five tool calls leave no zombie (bwrap left one per call)."""
    import sys
    from pathlib import Path

    isolation_or_skip(isolation)
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "ISO": isolation, "PYTHONPATH": root}
    proc = run_as_pid_1([sys.executable, "-c", ZOMBIES], env, timeout=120)
    assert proc.stdout.split() == ["1", "0"], proc.stderr[-2000:]


BUFFERS = """
import errno, fcntl, os, socket
out = []
a, b = socket.socketpair()
for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF, 32, 33):  # and the FORCE variants
    try:
        a.setsockopt(socket.SOL_SOCKET, opt, 64 << 20)
        out.append("raised")
    except OSError as e:
        out.append(errno.errorcode[e.errno])
r, w = os.pipe()
try:
    fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ
    out.append("raised")
except OSError as e:
    out.append(errno.errorcode[e.errno])
a.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # other options still work
out.append(str(fcntl.fcntl(w, fcntl.F_GETFL) >= 0))
print(" ".join(out))
"""


@pytest.mark.parametrize("isolation", ["bwrap", "namespaces"])
def test_socket_and_pipe_buffers_cannot_be_raised(isolation):
    """Socket and pipe buffers are kernel memory outside the call's address-space cap (30
    socket pairs raised to the host's wmem_max held 470 MiB past a 512 MiB cap): raising them
    is refused (EPERM), as a tool call and as a code reward; other options still work."""
    from grpo_core.rewards.code import code_runs

    isolation_or_skip(isolation)
    obs = PythonTool(ToolSpec(tool_isolation=isolation)).run(BUFFERS)
    assert obs.error is None, obs.text
    body = obs.text.removeprefix("<tool_response>").removesuffix("</tool_response>")
    assert body.split() == ["EPERM"] * 5 + ["True"], body
    held = BUFFERS + "assert 'raised' not in out\n"
    (score,) = code_runs([""], [f"```python\n{held}```"], sandbox_isolation=isolation)
    assert score == 1.0

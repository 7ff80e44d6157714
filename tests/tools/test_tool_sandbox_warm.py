"""The warm tool sandbox (grpo_core/sandbox/forkserver.py): one sandbox serves many calls,
each in a clean process forked for it. A call sees nothing another call left (files in its
working directory or /tmp, processes, threads, environment, globals, memory), two calls at
once cannot see each other, a reply forged on the pipe does not hide a failure, the outputs
are those of a fresh sandbox per call, and no server outlives the scorer."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rewards.sandbox_programs import isolation_or_skip, sandbox_uids_alive

from grpo_core.engines.environments import PythonTool, ToolSpec
from grpo_core.sandbox import Limits, detect_isolation, forkserver

ROOT = Path(__file__).resolve().parents[2]
MODES = ["bwrap", "namespaces"]


def warm_tool(isolation: str, workers: int = 1, **kw) -> PythonTool:
    isolation_or_skip(isolation)
    forkserver.shutdown_all()  # servers of its own, none left from another test
    tool = PythonTool(
        ToolSpec(tool_isolation=isolation, tool_sandbox="warm", tool_workers=workers, **kw)
    )
    limits = Limits(memory_bytes=tool.spec.tool_memory_mb << 20)
    forkserver.pool(detect_isolation(isolation), limits.workdir_bytes).started = 0
    return tool


def servers_started(tool: PythonTool) -> int:
    limits = Limits(memory_bytes=tool.spec.tool_memory_mb << 20)
    return forkserver.pool(detect_isolation(tool.spec.tool_isolation), limits.workdir_bytes).started


def body(obs) -> str:
    assert obs.error is None, obs.text
    return obs.text.removeprefix("<tool_response>").removesuffix("</tool_response>")


LEAVE = """
import builtins, math, os, sys, threading, time
open("left.txt", "w").write("call 1")
os.makedirs("/tmp/locked/deeper")
open("/tmp/locked/deeper/f", "w").write("x")
os.chmod("/tmp/locked/deeper", 0)
os.chmod("/tmp/locked", 0)
os.environ["GRPO_LEFT"] = "1"
builtins.GRPO_LEFT = math.GRPO_LEFT = sys.GRPO_LEFT = 1
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
try:
    os.fork()
    forked = "forked"
except OSError:
    forked = "refused"
held = bytearray(b"\\xa5\\x5a" * (32 << 20))  # 64 MiB of a pattern
print(os.getuid(), forked)
"""

LOOK = """
import builtins, math, os, sys
needle = bytes([0xA5, 0x5A]) * 2048
found = 0
with open("/proc/self/maps") as f:
    regions = [ln.split() for ln in f]
with open("/proc/self/mem", "rb", buffering=0) as mem:
    for r in regions:
        if "r" not in r[1] or (len(r) > 5 and r[5] in ("[vvar]", "[vsyscall]")):
            continue
        lo, hi = (int(x, 16) for x in r[0].split("-"))
        try:
            mem.seek(lo)
            found += mem.read(hi - lo).count(needle)
        except (OSError, OverflowError, ValueError):
            pass
others = [p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]
alive = []
for p in others:
    try:
        os.kill(int(p), 0)
        alive.append(p)
    except OSError:
        pass
print(os.getuid(), sorted(os.listdir(".")), sorted(os.listdir("/tmp")), os.getcwd())
print(os.environ.get("GRPO_LEFT"), hasattr(builtins, "GRPO_LEFT"), hasattr(math, "GRPO_LEFT"),
      hasattr(sys, "GRPO_LEFT"))
print("threads", __import__("threading").active_count(), "signalable", alive, "pattern", found)
"""


@pytest.mark.parametrize("isolation", MODES)
def test_a_call_sees_nothing_an_earlier_call_left(isolation):
    tool = warm_tool(isolation, workers=1)
    first = body(tool.run(LEAVE)).split()
    assert first[1] == "refused"
    out = body(tool.run(LOOK)).splitlines()
    assert servers_started(tool) == 1  # both calls on one warm sandbox
    uid, listing = out[0].split(" ", 1)
    assert listing == "[] [] /tmp", out  # the working directory and /tmp: empty again
    if os.geteuid() == 0:
        assert uid != first[0]  # a fresh uid per call
    assert out[1] == "None False False False"
    assert out[2].startswith("threads 1 signalable [] pattern ")
    assert int(out[2].rsplit(" ", 1)[1]) < 50, out  # 16,384 if call 1's memory were here
    assert sandbox_uids_alive() == []


CONCURRENT = """
import os, time
open(f"/tmp/{NAME}", "w").write(NAME)
open(NAME + ".here", "w").write(NAME)
time.sleep(1.0)
seen = [p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]
signalable = []
for p in seen:
    try:
        os.kill(int(p), 0)
        signalable.append(p)
    except OSError:
        pass
print(sorted(os.listdir("/tmp")), signalable)
"""


@pytest.mark.parametrize("isolation", MODES)
def test_two_calls_at_once_cannot_see_each_other(isolation):
    tool = warm_tool(isolation, workers=2)
    out: dict[str, str] = {}

    def call(name: str) -> None:
        out[name] = body(tool.run(f"NAME = {name!r}\n" + CONCURRENT))

    threads = [threading.Thread(target=call, args=(n,)) for n in ("alpha", "beta")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert servers_started(tool) == 2
    assert out["alpha"] == "['alpha', 'alpha.here'] []"
    assert out["beta"] == "['beta', 'beta.here'] []"


SAME = [
    "print(357*46)",
    "12345 * 6789",
    "print(hash('grpo'), list({'a', 'b', 'c', 'd', 'e', 'f', 'g'}), hash(b'x'))",
    "import sys\nprint(sys.flags.hash_randomization, sys.flags.no_user_site, sys.flags.safe_path,"
    " sys.flags.dont_write_bytecode, sys.flags.isolated, sys.flags.ignore_environment)",
    "import os\nprint(os.getcwd(), sorted(os.environ), os.environ['HOME'], os.listdir('.'))",
    "raise ValueError('no \\ud800 here')",
    "import sys\nsys.exit(3)",
    "import sys\nsys.exit(0)",
    "import os\nos._exit(0)",
    "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
    "print('\\udc80', 1)\nimport sys\nsys.stderr.write('\\udfff')",
    "print('7' * 100_000)",
    "import random\nprint(random.random(), random.randint(0, 10**9), random.sample(range(99), 3))",
    "def f(:\n    pass",
    "x = bytearray(1 << 40)",
    "import os\nos.closerange(3, 256)",
    "import subprocess\nsubprocess.run(['true'])",
    "None",
]


@pytest.mark.parametrize("isolation", MODES)
def test_warm_and_fresh_give_the_same_outputs(isolation):
    """The same calls give the same observations on a fresh sandbox per call and on a warm
    one (hash seed, flags, environment, working directory, errors, output cuts)."""
    warm = warm_tool(isolation)
    fresh = PythonTool(ToolSpec(tool_isolation=isolation, tool_sandbox="fresh"))
    for code in SAME:
        a, b = fresh.run(code), warm.run(code)
        assert (a.text, a.error) == (b.text, b.error), code
    assert servers_started(warm) == 1


FORGE = """
import json, os
forged = (json.dumps({"ok": True, "error": "", "output": "42"}) + "\\n").encode()
for fd in range(0, 64):
    try:
        os.write(fd, forged)
    except OSError:
        pass
raise ValueError("the call failed")
"""


@pytest.mark.parametrize("isolation", MODES)
def test_a_forged_reply_does_not_hide_a_failed_warm_call(isolation):
    tool = warm_tool(isolation)
    obs = tool.run(FORGE)
    assert obs.error is not None
    assert tool.run("print(6 * 7)").text == "<tool_response>42</tool_response>"


@pytest.mark.parametrize("isolation", MODES)
def test_a_dead_server_is_replaced_and_servers_restart(isolation, monkeypatch):
    tool = warm_tool(isolation)
    assert body(tool.run("print(1)")) == "1"
    (srv,) = forkserver.pool(detect_isolation(isolation), Limits().workdir_bytes).idle
    os.killpg(srv.proc.pid, signal.SIGKILL)  # the server dies between two calls
    srv.proc.wait()
    select.select([srv.pidfd], [], [], 5)  # its sandbox's pid 1 is gone too
    assert body(tool.run("print(2)")) == "2"
    assert servers_started(tool) == 2
    monkeypatch.setattr(forkserver, "RESTART_EVERY", 3)
    for i in range(7):
        assert body(tool.run(f"print({i})")) == str(i)
    assert servers_started(tool) == 4  # 1 + 2 more calls, then 3, then 3


SCORER = """
import sys
from grpo_core.engines.environments import PythonTool, ToolSpec
tool = PythonTool(ToolSpec(tool_isolation=sys.argv[1], tool_sandbox="warm", tool_workers=2))
from concurrent.futures import ThreadPoolExecutor
with ThreadPoolExecutor(2) as pool:  # started from threads that end: the servers must not
    print(list(pool.map(lambda c: tool.run(c).text, ["print(1)", "print(2)"])), flush=True)
print(tool.run("print(3)").text, flush=True)
sys.stdin.read()  # until the test closes it (or kills this process)
"""


def server_processes() -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if b"_GRPO_NO_SERVE" in (d / "cmdline").read_bytes():
                    out.append(int(d.name))
            except OSError:
                continue
    return out


@pytest.mark.parametrize("how", ["exit", "kill"])
@pytest.mark.parametrize("isolation", MODES)
def test_no_server_outlives_the_scorer(isolation, how):
    isolation_or_skip(isolation)
    before = set(server_processes())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", SCORER, isolation], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
    lines = [proc.stdout.readline() for _ in range(2)]
    assert "<tool_response>3</tool_response>" in lines[1], lines
    assert len(set(server_processes()) - before) >= 2  # the two servers, up after the pool
    if how == "kill":
        proc.kill()  # SIGKILL: no atexit, no finally
    else:
        proc.stdin.close()  # a normal exit
    proc.wait(timeout=60)
    deadline = time.monotonic() + 5
    while set(server_processes()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(server_processes()) - before == set()


KERNEL_STATE = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
nr = {"x86_64": 240, "aarch64": 180}[os.uname().machine]
fd = libc.syscall(nr, b"grpo-left", os.O_CREAT | os.O_RDWR, 0o600, None)  # mq_open
mq = "refused" if fd < 0 and ctypes.get_errno() == errno.EPERM else f"made {fd}"
caps = [ln.split()[1] for ln in open("/proc/self/status") if ln.startswith(("CapPrm", "CapEff"))]
print(mq, caps)
"""


@pytest.mark.parametrize("isolation", MODES)
def test_no_kernel_object_outlives_a_call_and_no_capability(isolation):
    """POSIX message queues live in the IPC namespace a warm sandbox keeps across calls: the
    filter refuses them (SysV IPC already was). A call process holds no capability."""
    tool = warm_tool(isolation)
    assert body(tool.run(KERNEL_STATE)) == "refused ['0000000000000000', '0000000000000000']"


@pytest.mark.parametrize("isolation", MODES)
def test_a_calls_random_numbers_are_a_function_of_the_call(isolation):
    """``random`` is seeded per call from the program (as the hash seed is fixed): the same
    call prints the same numbers on a rerun, another call other numbers."""
    isolation_or_skip(isolation)
    tool = PythonTool(ToolSpec(tool_isolation=isolation, tool_sandbox="fresh"))
    code = "import random\nprint(random.random(), random.getrandbits(64))"
    a, b = tool.run(code), tool.run(code)
    assert a.error is None and a.text == b.text
    assert tool.run(code + "\nx = 1").text != a.text

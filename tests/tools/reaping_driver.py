"""A scorer and a PID 1 that does not reap, for tests/tools/test_sandbox_reaping.py.

    unshare --pid --fork --mount-proc python reaping_driver.py calls PATH ISOLATION N
    unshare --pid --fork --mount-proc python reaping_driver.py kills PATH ISOLATION TRIALS

This script is PID 1 of a pid namespace of its own: it waits only for the scorer it starts
(``Popen.wait``), as a container's entry point that does not reap, and looks only at the
processes of that namespace (all of them the test's; the kernel kills what is left when this
script exits). PATH: ``code-fresh`` (``run_program``, asserts), ``tool-fresh`` or
``tool-warm`` (the python tool on a fresh sandbox per call, on a warm server).

- ``calls``: a scorer runs N calls (every tenth one times out) and exits. Prints
  ``{"rc", "zombies_during", "zombies_after", "alive_after"}``: zombies in the namespace once
  the calls are done (the scorer still up) and once it has exited, and what still runs.
- ``kills``: per trial ``[window, delay]`` (TRIALS is their JSON list), a scorer starts a call
  of a program that sleeps, is SIGKILLed ``delay`` s after the call began, and what still
  runs in the namespace 2 s later is listed. ``window`` widens a race on purpose: ``launcher``
  delays bwrap's start by 1 s (a scorer that dies before bwrap runs), ``init`` delays the
  namespaces init by 1 s right after its fork (a launcher that dies before its init asked to
  die with it); ``none`` runs the sandbox as it is. Prints ``{"trials": [[window, delay,
  [what still runs]], ...], "zombies"}``: the zombies the killed scorers' sandboxes became are
  this PID 1's (nothing of a dead scorer can reap them).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DELAY_S = 1.0
QUICK = ("print(6 * 7)", "def f():\n    return 42\n")
SLOW = ("import time\ntime.sleep(60)", "import time\ndef f():\n    time.sleep(60)\n")


def processes() -> dict[int, tuple[str, str]]:
    """pid -> (state, command name) of the namespace's processes but this one."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            comm = stat[stat.find("(") + 1 : stat.rfind(")")]
            out[int(name)] = (stat[stat.rfind(")") + 2 :].split()[0], comm)
    return out


def zombies() -> int:
    return sum(1 for state, _ in processes().values() if state == "Z")


def widen(window: str) -> None:
    """Make a start-up race window 1 s wide (see the module doc)."""
    from grpo_core.sandbox import launcher

    if window == "launcher":
        prefix = launcher.bwrap_prefix
        wait = f"import os, sys, time; time.sleep({DELAY_S}); os.execvp('bwrap', sys.argv[1:])"
        launcher.bwrap_prefix = lambda *a: [launcher._python(), "-c", wait, *prefix(*a)[1:]]
    elif window == "init":
        text = launcher._NSINIT
        at = text.index("\n", text.index("\ndef init(") + 1) + 1
        launcher._NSINIT = text[:at] + f"    __import__('time').sleep({DELAY_S})\n" + text[at:]


def scorer(path: str, isolation: str, calls: int, window: str) -> None:
    """``calls`` calls (0: calls of SLOW until killed, saying ``go`` before the first)."""
    sys.path.insert(0, str(ROOT))
    from grpo_core.engines.environments import PythonTool, ToolSpec
    from grpo_core.sandbox import Limits, detect_isolation, run_program

    detect_isolation(isolation)
    widen(window)
    timeout = 1.0 if calls else 30.0
    tool = PythonTool(ToolSpec(tool_isolation=isolation, tool_sandbox=path.split("-")[1],
                               tool_workers=1, tool_timeout_s=timeout))  # fmt: skip
    print("go", flush=True)
    i = 0
    while calls == 0 or i < calls:
        late = calls == 0 or i % 10 == 9  # a call that runs into its wall clock
        tool_code, program = SLOW if late else QUICK
        if path == "code-fresh":
            res = run_program(program, kind="asserts", tests=["assert f() == 42"],
                              limits=Limits(wall_seconds=timeout), isolation=isolation)  # fmt: skip
            ok = res.status == ("timeout" if late else "ok")
        else:
            obs = tool.run(tool_code)
            ok = (obs.error or "").startswith("timeout") if late else obs.error is None
        if calls and not ok:
            raise SystemExit(f"call {i} went wrong")
        i += 1
    time.sleep(0.5)
    print(json.dumps({"zombies_during": zombies()}), flush=True)


def start(path: str, isolation: str, calls: int, window: str) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "scorer", path, isolation, str(calls), window]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def calls(path: str, isolation: str, n: int) -> dict:
    proc = start(path, isolation, n, "none")
    out = proc.communicate()[0].splitlines()
    during = json.loads(out[-1])["zombies_during"] if out and out[-1].startswith("{") else None
    time.sleep(1.0)
    left = processes()
    return {"rc": proc.returncode, "zombies_during": during,
            "zombies_after": sum(1 for s, _ in left.values() if s == "Z"),
            "alive_after": sorted(c for s, c in left.values() if s != "Z")}  # fmt: skip


def kills(path: str, isolation: str, trials: list) -> dict:
    report = []
    for window, delay in trials:
        before = set(processes())
        proc = start(path, isolation, 0, window)
        proc.stdout.readline()  # "go": the call starts now
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        deadline = time.monotonic() + 2.0
        while True:
            left = {p: c for p, (s, c) in processes().items() if s != "Z" and p not in before}
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        report.append([window, delay, sorted(left.values())])
    return {"trials": report, "zombies": zombies()}


if __name__ == "__main__":
    what, path, isolation, arg = sys.argv[1:5]
    if what == "scorer":
        scorer(path, isolation, int(arg), sys.argv[5])
    elif what == "calls":
        print(json.dumps(calls(path, isolation, int(arg))), flush=True)
    else:
        print(json.dumps(kills(path, isolation, json.loads(arg))), flush=True)

"""Per-call latency of the python tool: wall p50/p95 and CPU per call, per sandbox mode and
isolation.

    python benchmarks/bench_tool_calls.py [--n 200] [--isolation bwrap namespaces]
        [--modes fresh warm]

Each call is a small program of the kind the tool demo runs (``print(357*46)``, a bare
expression, a ``math`` call), through ``PythonTool.run`` as the turn loop calls it, one call
at a time. ``fresh``: a new sandbox and two interpreters per call; ``warm``: a sandbox that
stays up and forks a clean child per call (grpo_core/sandbox/forkserver.py). Before the timed
calls, 3 warm-up calls (the warm server's start is among them: its cost is the "first call"
column). CPU per call: the time of this process and every process it starts (a cgroup-v1
``cpuacct`` group made for the run, as root; else this process's and its reaped children's
rusage, which misses the sandbox processes nothing reaps), over the timed calls and the warm
server's shutdown. Run it alone: the numbers are wall times.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo_core.engines.environments import PythonTool, ToolSpec  # noqa: E402
from grpo_core.sandbox import SandboxUnavailable, detect_isolation  # noqa: E402

PROGRAMS = [
    "print(357*46)",
    "12345 * 6789",
    "import math\nprint(math.factorial(12))",
    "x = [i * i for i in range(100)]\nsum(x)",
]


CPUACCT = Path("/sys/fs/cgroup/cpuacct")


def own_cgroup() -> Path | None:
    """A cgroup-v1 cpuacct group of this process and all it starts (root only): counts the
    CPU of every sandbox process, also those nothing here reaps; None where there is none."""
    group = CPUACCT / f"grpo-bench-{os.getpid()}"
    try:
        group.mkdir()
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        return None
    return group


def cpu_seconds(group: Path | None) -> float:
    if group is not None:
        return int((group / "cpuacct.usage").read_text()) / 1e9
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def leave_cgroup(group: Path | None) -> None:
    if group is not None:
        (CPUACCT / "cgroup.procs").write_text(str(os.getpid()))
        group.rmdir()


def spec(isolation: str, mode: str) -> ToolSpec:
    fields = ToolSpec.__dataclass_fields__
    p = "tool_" if "tool_workers" in fields else ""  # older checkouts: the unprefixed names
    extra = {f"{p}sandbox": mode} if f"{p}sandbox" in fields else {}
    if mode != "fresh" and not extra:
        raise SystemExit(f"this checkout has no {mode!r} tool sandbox")
    return ToolSpec(**{f"{p}isolation": isolation, f"{p}workers": 1}, **extra)


def shutdown() -> None:
    try:
        from grpo_core.sandbox import forkserver
    except ImportError:
        return
    forkserver.shutdown_all()


def measure(isolation: str, mode: str, n: int, group: Path | None) -> dict:
    tool = PythonTool(spec(isolation, mode))
    t0 = time.perf_counter()
    first = tool.run(PROGRAMS[0])
    first_s = time.perf_counter() - t0
    assert first.error is None, first
    for p in PROGRAMS[1:3]:
        tool.run(p)
    walls = []
    c0 = cpu_seconds(group)
    for i in range(n):
        t = time.perf_counter()
        obs = tool.run(PROGRAMS[i % len(PROGRAMS)])
        walls.append(time.perf_counter() - t)
        assert obs.error is None, obs
    shutdown()
    cpu = cpu_seconds(group) - c0
    walls.sort()
    return {
        "p50": 1000 * statistics.median(walls),
        "p95": 1000 * walls[min(len(walls) - 1, int(0.95 * len(walls)))],
        "cpu": 1000 * cpu / n,
        "first": 1000 * first_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--isolation", nargs="+", default=["bwrap", "namespaces"])
    ap.add_argument("--modes", nargs="+", default=["fresh", "warm"])
    args = ap.parse_args()
    rows = []
    group = own_cgroup()
    for iso in args.isolation:
        try:
            detect_isolation(iso)
        except SandboxUnavailable as exc:
            print(f"{iso}: not available here ({str(exc)[:120]})")
            continue
        for mode in args.modes:
            rows.append((iso, mode, measure(iso, mode, args.n, group)))
    leave_cgroup(group)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=Path(__file__).parent).stdout.strip()  # fmt: skip
    print(f"CPUs: {os.cpu_count()}  python: {platform.python_version()}  kernel: "
          f"{platform.release()}  commit: {commit}  calls: {args.n}  CPU from: "
          f"{'cpuacct cgroup' if group else 'rusage (reaped children only)'}")  # fmt: skip
    print("| isolation | sandbox | p50 ms | p95 ms | CPU ms/call | first call ms |")
    print("|---|---|---|---|---|---|")
    for iso, mode, r in rows:
        print(f"| {iso} | {mode} | {r['p50']:.1f} | {r['p95']:.1f} | {r['cpu']:.1f} | "
              f"{r['first']:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()

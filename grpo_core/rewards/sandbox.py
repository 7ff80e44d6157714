"""Run untrusted Python programs against tests, isolated, with an unforgeable verdict.

Isolation modes (``isolation=``, or the ``GRPO_SANDBOX_ISOLATION`` environment variable, which
the pipeline's ``sandbox.isolation`` setting sets; default ``"auto"``):

- ``bwrap`` (Debian package ``bubblewrap``, plus ``setpriv`` from util-linux when the scorer
  is root): new pid, net, ipc, uts (and cgroup) namespaces, a read-only view of only ``/usr``
  and the Python installation, a private size-limited tmpfs as the working directory and
  ``/tmp``, nothing else of the host filesystem.
- ``namespaces`` (no external tool: ``_nsinit.py`` calls ``unshare``/``mount`` through the C
  library; needs root, or unprivileged user namespaces): the same guarantees built by hand,
  see ``_nsinit.py``. Python may live in root's home folder: its folder is bound read-only into
  the new root with traversable parents, so the uid drop works.
- ``auto``: ``bwrap`` if it works here, else ``namespaces``, else :class:`SandboxUnavailable`
  (fail closed: the message names the fix).
- ``none``, only when named: rlimits, a process group and (root, with ``setpriv`` and a Python
  readable by other users) a uid drop. The program can read and write whatever that uid can,
  use the network and signal that uid's processes. Logged as a warning.

Guarantees of ``bwrap`` and ``namespaces`` (tests/rewards/test_sandbox.py runs every hostile
program class under each mode the machine has): no write outside the private tmpfs, no
network, no signal to any host process, neither the scorer's environment nor any host
``/proc/<pid>/environ`` readable, nothing left running once the verdict is returned (the
sandbox's pid-1 is killed and its exit waited for through a pidfd, so a double-forked
``setsid`` daemon dies too), CPU and memory capped (``RLIMIT_CPU``, ``RLIMIT_AS`` per process,
``RLIMIT_NPROC`` for the random uid, tmpfs size). When the scorer is root the program runs as
a random unprivileged uid: root ignores ``RLIMIT_NPROC``.

Always: own session/process group, ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE``,
``RLIMIT_NOFILE``, ``RLIMIT_NPROC``, ``RLIMIT_CORE=0``, a wall-clock timeout, a scrubbed
environment (only ``PATH``, ``LANG``, ``HOME``, ``TMPDIR``).

The verdict comes only from a pipe held open by the scorer, one JSON record per assert, each
carrying a per-run random nonce the program never sees on disk or in argv (see
``_harness.py``); only asserts that exercise the candidate count (``credit.py``). Exit codes
and output are never trusted. Residual risk, documented: a program that introspects the
harness's own memory (``gc``, frames) in its process could recover the nonce; closing that
needs a process per assert.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import resource
import secrets
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_core.rewards import credit
from grpo_core.rewards.base import RewardUnavailable

log = logging.getLogger(__name__)

_HARNESS = (Path(__file__).with_name("_harness.py")).read_text()
_NSINIT = (Path(__file__).with_name("_nsinit.py")).read_text()
_MAX_VERDICT_BYTES = 4 << 20
_STDERR_TAIL = 2000
_SETUP_FAILED = 125  # _nsinit.py's exit code for a failed namespace setup step

MODES = ("auto", "bwrap", "namespaces", "none")
ISOLATION_ENV = "GRPO_SANDBOX_ISOLATION"


class SandboxUnavailable(RewardUnavailable):
    """The requested isolation cannot run on this machine: executing rewards refuse to run."""


@dataclass(frozen=True)
class Limits:
    """Per-program resource limits."""

    wall_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_bytes: int = 1 << 30  # address space (RLIMIT_AS)
    file_size_bytes: int = 16 << 20  # largest file it may write (RLIMIT_FSIZE)
    nproc: int = 16  # processes of the sandbox uid (RLIMIT_NPROC)
    open_files: int = 64
    workdir_bytes: int = 64 << 20  # size of the private tmpfs (bwrap, namespaces)


@dataclass
class RunResult:
    """What happened to one program.

    status: "ok" (harness finished), "timeout" (wall clock), "killed" (by a signal: CPU limit,
        memory...), "exited" (ended before the harness finished: early exit, crash).
    passed / total: executions of the asserts that exercise the candidate, passed / counted
        (unrun ones count when the run did not finish). program_ok: the program body ran
        without raising.
    error: one line for the error column (None when every assert passed).
    """

    status: str
    passed: int = 0
    total: int = 0
    program_ok: bool = False
    error: str | None = None
    returncode: int | None = None
    wall_s: float = 0.0
    stderr_tail: str = ""
    records: list[tuple[str, str, bool, str]] = field(default_factory=list, repr=False)

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


@dataclass(frozen=True)
class Isolation:
    mode: str  # "bwrap" | "namespaces" | "none"
    drop_uid: bool  # run as an unprivileged random uid (scorer is root)
    nproc_enforced: bool
    requested: str = "auto"

    @property
    def contained(self) -> bool:
        """The full guarantee set (filesystem, network, signals, environment, cleanup)."""
        return self.mode in ("bwrap", "namespaces")

    def describe(self) -> str:
        how = {
            "bwrap": "bubblewrap namespaces",
            "namespaces": "Linux namespaces (built in)",
            "none": "rlimits only, NOT isolated",
        }[self.mode]
        return f"{self.mode} ({how}; requested {self.requested})"


def requested_isolation(isolation: str | None = None) -> str:
    """The isolation asked for: ``isolation``, else ``$GRPO_SANDBOX_ISOLATION``, else auto."""
    name = isolation or os.environ.get(ISOLATION_ENV) or "auto"
    if name not in MODES:
        where = "" if isolation else f" (from ${ISOLATION_ENV})"
        raise ValueError(f"sandbox isolation {name!r}{where}: expected one of {', '.join(MODES)}")
    return name


def detect_isolation(requested: str | None = None) -> Isolation:
    """The isolation to use for ``requested`` (``auto``: the strongest that works here),
    probed once per process by really running a program; raises :class:`SandboxUnavailable`
    naming the fix when it cannot run."""
    name = requested_isolation(requested)
    return _detect(name, shutil.which("bwrap"), shutil.which("setpriv"), os.geteuid())


@functools.cache
def _detect(requested: str, bwrap: str | None, setpriv: str | None, euid: int) -> Isolation:
    root = euid == 0
    reasons: dict[str, str] = {}
    for mode in ["bwrap", "namespaces"] if requested == "auto" else [requested]:
        if mode == "bwrap" and bwrap is None:
            reasons[mode] = "bubblewrap is not installed (no bwrap on PATH)"
            continue
        if mode == "bwrap" and root and setpriv is None:
            reasons[mode] = "setpriv (util-linux) is missing: the program would run as root"
            continue
        if mode == "none":
            drop = root and setpriv is not None and _world_readable_python()
            iso = Isolation(mode, drop, nproc_enforced=not root or drop, requested=requested)
        else:
            iso = Isolation(mode, root, nproc_enforced=True, requested=requested)
        why = _probe(iso)
        if why is None:
            _log_choice(iso, reasons)
            return iso
        reasons[mode] = why
    raise SandboxUnavailable(_unavailable_message(requested, reasons))


def _log_choice(iso: Isolation, reasons: dict[str, str]) -> None:
    skipped = "".join(f"; {m} unavailable: {why}" for m, why in reasons.items())
    if iso.mode == "none":
        log.warning(
            "code sandbox: isolation %s, set on purpose: programs run with rlimits only; they "
            "can read and write what uid %s can, use the network and signal that uid's "
            "processes%s. Use it only on a machine dedicated to scoring.",
            iso.describe(),
            "(random, unprivileged)" if iso.drop_uid else os.geteuid(),
            "" if iso.nproc_enforced else ", and RLIMIT_NPROC is not enforced (root)",
        )
    else:
        log.info("code sandbox: isolation %s%s", iso.describe(), skipped)


def _unavailable_message(requested: str, reasons: dict[str, str]) -> str:
    why = "; ".join(f"{mode}: {reason}" for mode, reason in reasons.items())
    return (
        f"code sandbox: cannot run untrusted programs with isolation {requested!r} on this "
        f"machine ({why}). Fix: install bubblewrap (Debian/Ubuntu: apt-get install "
        "bubblewrap; plus util-linux's setpriv when scoring as root), or score as root / where "
        "user namespaces are allowed (isolation 'namespaces'), or run scoring on a machine "
        "that can (docs/rewards.md). To run without isolation on purpose, set the sandbox "
        "isolation to 'none' (config sandbox.isolation=none, GRPO_SANDBOX_ISOLATION=none, or "
        "the reward's sandbox_isolation='none'): the program can then read and write what the "
        "scorer's user can and use the network."
    )


def _world_readable_python() -> bool:
    path = Path(sys.executable).resolve()
    for p in [path, *path.parents]:
        mode = p.stat().st_mode
        if not mode & (stat.S_IXOTH if p != path else stat.S_IROTH | stat.S_IXOTH):
            return False
    return True


def _probe(iso: Isolation) -> str | None:
    """None if a trivial program runs under ``iso``, else why not."""
    try:
        res = _run(iso, {"kind": "run", "program": "x = 1"}, Limits(wall_seconds=20), {})
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    if res.status == "ok" and res.program_ok:
        return None
    tail = res.stderr_tail.strip().splitlines()
    return (tail[-1] if tail else res.error or res.status)[:300]


def _python_roots() -> list[str]:
    roots = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)}
    roots.add(str(Path(sys.executable).resolve().parent.parent))
    return sorted(r for r in roots if r != "/" and not r.startswith("/usr"))


def _python() -> str:
    return os.path.realpath(sys.executable)


def _harness_argv(fd: int) -> list[str]:
    return [_python(), "-I", "-B", "-c", _HARNESS, str(fd)]


_DROP = ["setpriv", "--clear-groups", "--no-new-privs"]


def _command(iso: Isolation, uid: int, workdir: str, limits: Limits, fd: int, info: int) -> list:
    drop = [*_DROP, f"--reuid={uid}", f"--regid={uid}"] if iso.drop_uid else []
    if iso.mode == "bwrap":
        cmd = ["bwrap", "--die-with-parent", "--new-session", "--info-fd", str(info)]
        cmd += [
            "--unshare-ipc",
            "--unshare-pid",
            "--unshare-net",
            "--unshare-uts",
            "--unshare-cgroup-try",
        ]
        if not iso.drop_uid:
            cmd += ["--unshare-user"]
        cmd += ["--ro-bind", "/usr", "/usr"]
        for link in ("bin", "lib", "lib64", "sbin"):
            if os.path.islink(f"/{link}"):
                cmd += ["--symlink", os.readlink(f"/{link}"), f"/{link}"]
        made: set[str] = set()
        for root in _python_roots():
            for parent in reversed(Path(root).parents[:-1]):  # traversable by the sandbox uid
                if str(parent) not in made:
                    made.add(str(parent))
                    cmd += ["--perms", "0755", "--dir", str(parent)]
            cmd += ["--ro-bind", root, root]
        cmd += ["--proc", "/proc", "--dev", "/dev"]
        cmd += ["--size", str(limits.workdir_bytes), "--tmpfs", "/tmp"]
        cmd += ["--chmod", "1777", "/tmp", "--chdir", "/tmp"]
        return cmd + ["--"] + drop + _harness_argv(fd)
    if iso.mode == "namespaces":
        cfg = {
            "root": workdir,
            "uid": uid if iso.drop_uid else None,
            "fd": fd,
            "roots": _python_roots(),
            "rlimits": _rlimits(limits),
            "tmp_bytes": limits.workdir_bytes,
            "parent": os.getpid(),
            "deadline": math.ceil(limits.wall_seconds) + 30,
        }
        return [_python(), "-I", "-B", "-c", _NSINIT + "\n" + _HARNESS, json.dumps(cfg)]
    return drop + _harness_argv(fd)


def _env(workdir: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": workdir,
        "TMPDIR": workdir,
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
    }


def _rlimits(limits: Limits) -> dict[str, tuple[int, int]]:
    cpu = max(1, int(limits.cpu_seconds))
    return {
        "RLIMIT_CPU": (cpu, cpu + 1),
        "RLIMIT_AS": (limits.memory_bytes, limits.memory_bytes),
        "RLIMIT_FSIZE": (limits.file_size_bytes, limits.file_size_bytes),
        "RLIMIT_NOFILE": (limits.open_files, limits.open_files),
        "RLIMIT_NPROC": (limits.nproc, limits.nproc),
        "RLIMIT_CORE": (0, 0),
    }


def _preexec(limits: Limits):
    values = [(getattr(resource, k), v) for k, v in _rlimits(limits).items()]

    def set_limits() -> None:  # runs in the child between fork and exec: keep it minimal
        for res, value in values:
            resource.setrlimit(res, value)
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)

    return set_limits


def run_program(
    program: str,
    *,
    kind: str = "run",
    tests: Any = None,
    entry_point: str | None = None,
    setup: str = "",
    limits: Limits | None = None,
    isolation: str | None = None,
) -> RunResult:
    """Run ``program`` in the sandbox, then its tests.

    kind: "run" (program only, as ``__main__``), "humaneval" (``tests`` defines
        ``check(candidate)``, called with ``entry_point``), "asserts" (``tests`` is a list of
        assert statements, MBPP style), "script" (``tests`` is code with asserts).
    isolation: see the module doc; ``None``: ``$GRPO_SANDBOX_ISOLATION`` or ``"auto"``.
    Only the asserts that exercise the candidate (``credit.analyse``) count.
    """
    counted, candidates = credit.analyse(kind, tests, entry_point, setup)
    payload = {
        "kind": kind,
        "program": program,
        "tests": tests,
        "entry_point": entry_point,
        "setup": setup,
        "candidates": sorted(candidates),
    }
    return _run(detect_isolation(isolation), payload, limits or Limits(), counted)


def _run(iso: Isolation, payload: dict, limits: Limits, counted: dict[str, None]) -> RunResult:
    nonce = secrets.token_hex(16)
    uid = 100_000 + secrets.randbelow(800_000)
    data = json.dumps({**payload, "nonce": nonce}).encode()
    workdir = tempfile.mkdtemp(prefix="grpo-sandbox-")  # none: cwd; namespaces: mount point
    vr, vw = os.pipe()  # the verdict
    ir, iw = os.pipe()  # the sandbox's pid-1, as "<pid>" (namespaces) or bwrap's JSON
    pidfd = -1
    try:
        if iso.drop_uid and iso.mode == "none":
            os.chown(workdir, uid, uid)
        os.chmod(workdir, 0o700)
        with tempfile.TemporaryFile(prefix="grpo-sandbox-err-") as err:
            t0 = time.monotonic()
            proc = subprocess.Popen(
                _command(iso, uid, workdir, limits, vw, iw),
                stdin=subprocess.PIPE,
                stdout=iw if iso.mode == "namespaces" else subprocess.DEVNULL,
                stderr=err,
                cwd=workdir if iso.mode == "none" else "/",
                env=_env(workdir if iso.mode == "none" else "/tmp"),
                pass_fds=(vw, iw) if iso.mode == "bwrap" else (vw,),
                start_new_session=True,
                preexec_fn=None if iso.mode == "namespaces" else _preexec(limits),
            )
            for fd in (vw, iw):
                os.close(fd)
            vw = iw = -1
            chunks: list[bytes] = []
            reader = threading.Thread(target=_drain, args=(vr, chunks), daemon=True)
            reader.start()
            writer = threading.Thread(target=_feed, args=(proc, data), daemon=True)
            writer.start()
            pidfd = _open_sandbox_init(ir, proc, t0 + limits.wall_seconds)
            timed_out = False
            try:
                proc.wait(timeout=max(0.0, limits.wall_seconds - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                timed_out = True
            _kill(proc, pidfd)
            proc.wait()
            _await_exit(pidfd)  # the sandbox's pid-1 is gone: so is every process it held
            reader.join(timeout=5)
            wall = time.monotonic() - t0
            err.seek(0)
            tail = err.read()[-_STDERR_TAIL:].decode("utf-8", "replace")
    finally:
        for fd in (vr, vw, ir, iw, pidfd):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)
    return _verdict(
        b"".join(chunks), nonce, counted, timed_out, proc.returncode, wall, tail, limits, payload
    )


def _open_sandbox_init(info_fd: int, proc: subprocess.Popen, deadline: float) -> int:
    """A pidfd on the sandbox's pid-1 (-1 in mode none, or if it already ended): the process
    whose pid the launcher (bwrap or _nsinit.py) reported, checked to be the launcher's child
    after the pidfd was opened, so a recycled pid is never signalled."""
    raw = b""
    with contextlib.suppress(OSError):
        while len(raw) < 4096:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([info_fd], [], [], wait)[0]:
                break
            if not (chunk := os.read(info_fd, 4096)):
                break
            raw += chunk
    try:
        text = raw.decode()
        pid = int(json.loads(text)["child-pid"] if text.lstrip().startswith("{") else text)
    except (ValueError, KeyError, TypeError):
        return -1
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return -1
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        ppid = int(next(ln for ln in status.splitlines() if ln.startswith("PPid:")).split()[1])
    except (OSError, StopIteration, ValueError, IndexError):
        ppid = None
    if ppid != proc.pid:  # already gone (and its pid possibly someone else's)
        os.close(fd)
        return -1
    return fd


def _kill(proc: subprocess.Popen, pidfd: int) -> None:
    """SIGKILL the sandbox's pid-1 (the kernel then kills its whole pid namespace) and the
    launcher's process group."""
    if pidfd >= 0:
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _await_exit(pidfd: int, timeout: float = 10.0) -> None:
    if pidfd >= 0:  # readable once the process has exited, after its namespace was emptied
        select.select([pidfd], [], [], timeout)


def _feed(proc: subprocess.Popen, data: bytes) -> None:
    try:
        proc.stdin.write(data)
        proc.stdin.close()
    except OSError:
        pass


def _drain(fd: int, chunks: list[bytes]) -> None:
    size = 0
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            return
        if not chunk:
            return
        if size < _MAX_VERDICT_BYTES:
            chunks.append(chunk)
            size += len(chunk)


def _verdict(raw, nonce, counted, timed_out, rc, wall, tail, limits, payload) -> RunResult:
    records = []
    for line in raw.split(b"\n"):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, list) and len(rec) == 5 and rec[0] == nonce:
            records.append((str(rec[1]), str(rec[2]), rec[3] is True, str(rec[4])))
    kinds = {r[0] for r in records}
    finished = "done" in kinds
    program_ok = any(k == "program" and ok for k, _, ok, _ in records)
    asserts = [r for r in records if r[0] == "assert" and r[1] in counted]
    passed = sum(r[2] for r in asserts)
    total = len(asserts)
    tests_error = next((r[3] for r in records if r[0] == "tests" and not r[2]), None)
    if not finished or tests_error:  # asserts never reached count as failed
        total += sum(1 for i in counted if i not in {r[1] for r in asserts})
    setup_failed = rc == _SETUP_FAILED and "sandbox setup failed" in tail
    if timed_out:
        status, error = "timeout", f"timeout: killed after {limits.wall_seconds:g}s wall clock"
    elif finished:
        status, error = "ok", None
    elif setup_failed:
        status, error = "error", tail.strip().splitlines()[-1][:300]
    elif rc is not None and (rc < 0 or rc > 128):  # launchers relay a signal as 128+N
        sig = -rc if rc < 0 else rc - 128
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        hint = {"SIGXCPU": f" (CPU limit {limits.cpu_seconds}s)", "SIGXFSZ": " (file size limit)"}
        status, error = "killed", f"killed by {name}{hint.get(name, '')}"
    else:
        status, error = "exited", f"exited with code {rc} before the tests finished"
    if error is None:
        prog_err = next((r[3] for r in records if r[0] == "program" and not r[2]), None)
        first_fail = next((r[3] for r in asserts if not r[2]), None)
        parts = [f"program raised {prog_err}"] if prog_err else []
        if tests_error:
            parts.append(f"tests raised {tests_error}")
        if passed < total:
            parts.append(
                f"{total - passed}/{total} asserts failed"
                + (f": {first_fail}" if first_fail else "")
            )
        if total == 0 and payload.get("kind") != "run":
            parts.append("no assert of the tests exercises the candidate: nothing to score")
        error = "; ".join(parts) or None
    if error and "MemoryError" in tail and status != "ok":
        error += " (MemoryError)"
    return RunResult(status, passed, total, program_ok, error, rc, wall, tail, records)

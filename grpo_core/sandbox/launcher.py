"""Start one program under a chosen isolation and collect its verdict.

:func:`run_isolated` builds the launcher's command for the mode (``bwrap``'s arguments, the
``namespaces`` launcher ``_nsinit.py`` with its JSON config, or the bare harness for ``none``;
plus ``setpriv`` for the uid drop), a scrubbed environment and the rlimits, starts it in its own
session (dying with the calling thread: a parent-death signal), writes the payload to its
stdin and drains the verdict pipe. At the wall-clock timeout or once it ends, the sandbox's
pid-1 (reported by the launcher, opened as a pidfd) and then the launcher's process group are
SIGKILLed, and both are reaped (:mod:`grpo_core.sandbox.reaper`), so nothing it started
outlives the verdict, not even a zombie. The records are read by
:func:`grpo_core.sandbox.verdict.read_verdict`.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from grpo_core.sandbox import reaper
from grpo_core.sandbox.verdict import RunResult, read_verdict

if TYPE_CHECKING:
    from grpo_core.sandbox.isolation import Isolation


def _source(*names: str) -> str:
    return "\n".join(Path(__file__).with_name(n).read_text() for n in names)


# the trusted harness and the candidate process each run as one ``python -c`` text
_HARNESS = _source("_seccomp.py", "_wire.py", "_link.py", "_harness.py")
CANDIDATE = _source("_seccomp.py", "_wire.py", "_candidate.py")
_NSINIT = _source("_nsinit.py")
_MAX_VERDICT_BYTES = 4 << 20
_STDERR_TAIL = 2000


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


def _python_roots() -> list[str]:
    roots = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)}
    roots.add(str(Path(sys.executable).resolve().parent.parent))
    return sorted(r for r in roots if r != "/" and not r.startswith("/usr"))


def _python() -> str:
    return os.path.realpath(sys.executable)


def _harness_argv(fd: int) -> list[str]:
    return [_python(), "-I", "-B", "-c", _HARNESS, str(fd)]


_DROP = ["setpriv", "--clear-groups", "--no-new-privs"]


def bwrap_prefix(iso: Isolation, tmp_bytes: int, info: int) -> list[str]:
    """bwrap's arguments up to ``--``: the namespaces and the filesystem view (also the warm
    tool sandbox's, forkserver.py)."""
    cmd = ["bwrap", "--die-with-parent", "--new-session", "--info-fd", str(info)]
    cmd += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts"]
    cmd += ["--unshare-cgroup-try"]
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
    cmd += ["--size", str(tmp_bytes), "--tmpfs", "/tmp"]
    return cmd + ["--chmod", "1777", "/tmp", "--chdir", "/tmp", "--"]


def nsinit_config(workdir: str, uid: int | None, fd: int, rlimits: dict, tmp_bytes: int,
                  deadline: int) -> str:  # fmt: skip
    """``_nsinit.py``'s JSON config (also the warm tool sandbox's, forkserver.py)."""
    cfg = {"root": workdir, "uid": uid, "fd": fd, "roots": _python_roots(), "rlimits": rlimits,
           "tmp_bytes": tmp_bytes, "parent": os.getpid(), "deadline": deadline}  # fmt: skip
    return json.dumps(cfg)


def _command(iso: Isolation, uid: int, workdir: str, limits: Limits, fd: int, info: int) -> list:
    drop = [*_DROP, f"--reuid={uid}", f"--regid={uid}"] if iso.drop_uid else []
    if iso.mode == "bwrap":
        return bwrap_prefix(iso, limits.workdir_bytes, info) + drop + _harness_argv(fd)
    if iso.mode == "namespaces":
        deadline = math.ceil(limits.wall_seconds) + 30
        cfg = nsinit_config(workdir, uid if iso.drop_uid else None, fd, _rlimits(limits),
                            limits.workdir_bytes, deadline)  # fmt: skip
        return [_python(), "-I", "-B", "-c", _NSINIT + "\n" + _HARNESS, cfg]
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
    prctl = ctypes.CDLL(None).prctl  # loaded here: nothing is imported between fork and exec
    parent = os.getpid()

    def set_limits() -> None:  # runs in the child between fork and exec: keep it minimal
        prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: die with the calling thread
        if os.getppid() != parent:  # the scorer died before that: bwrap would outlive it
            os._exit(125)
        for res, value in values:
            resource.setrlimit(res, value)
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)

    return set_limits


_WORKDIR_PREFIX = "grpo-sandbox-"
_SWEPT: set[int] = set()  # processes that swept already: once per scorer process


def _sweep_orphans() -> None:
    """Remove the sandbox folders of scorers that are gone (``grpo-sandbox-<pid>-*`` with no
    such process, or one of another owner's name that was left behind); once per process."""
    if os.getpid() in _SWEPT:
        return
    _SWEPT.add(os.getpid())
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        if not name.startswith(_WORKDIR_PREFIX):
            continue
        pid = name[len(_WORKDIR_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or os.path.exists(f"/proc/{pid}"):
            continue  # another format, or a scorer still running
        path = os.path.join(root, name)
        try:
            if os.path.isdir(path) and os.stat(path).st_uid == os.getuid():
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue


def run_isolated(
    iso: Isolation, payload: dict, limits: Limits, counted: dict[str, None]
) -> RunResult:
    nonce = secrets.token_hex(16)
    uid = 100_000 + secrets.randbelow(800_000)
    data = json.dumps({**payload, "nonce": nonce, "candidate_code": CANDIDATE}).encode()
    _sweep_orphans()
    # none: cwd; namespaces: mount point. The pid in the name lets a later scorer remove the
    # folders of one that was killed (SIGKILL runs no finally)
    workdir = tempfile.mkdtemp(prefix=f"{_WORKDIR_PREFIX}{os.getpid()}-")
    vr, vw = os.pipe()  # the verdict
    ir, iw = os.pipe()  # the sandbox's pid-1, as "<pid>" (namespaces) or bwrap's JSON
    pidfd = -1
    if iso.contained:
        reaper.hold()  # its pid-1, orphaned, comes back here to be reaped
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
            chunks: list[bytes] = []
            try:
                for fd in (vw, iw):
                    os.close(fd)
                vw = iw = -1
                reader = threading.Thread(target=_drain, args=(vr, chunks), daemon=True)
                reader.start()
                writer = threading.Thread(target=_feed, args=(proc, data), daemon=True)
                writer.start()
                pidfd = reaper.open_pid1(ir, proc, t0 + limits.wall_seconds)
                timed_out = False
                try:
                    proc.wait(timeout=max(0.0, limits.wall_seconds - (time.monotonic() - t0)))
                except subprocess.TimeoutExpired:
                    timed_out = True
            finally:  # the sandbox's pid-1 killed and reaped: so is every process it held
                reaper.stop(proc, pidfd, iso.contained)
            reader.join(timeout=5)
            wall = time.monotonic() - t0
            err.seek(0)
            tail = err.read()[-_STDERR_TAIL:].decode("utf-8", "replace")
    finally:
        for fd in (vr, vw, ir, iw, pidfd):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)
        if iso.contained:
            reaper.release()
    return read_verdict(
        b"".join(chunks), nonce, counted, timed_out, proc.returncode, wall, tail, limits, payload
    )


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

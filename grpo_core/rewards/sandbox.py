"""Run untrusted Python programs against tests, isolated, with an unforgeable verdict.

Layers, strongest available first (``isolation="auto"``):

- ``bwrap`` (Debian package ``bubblewrap``): new pid, net, ipc, uts (and cgroup) namespaces,
  a read-only view of only ``/usr`` and the Python installation, a private size-limited
  tmpfs as the working directory and ``/tmp``, nothing else of the host filesystem.
- ``unshare`` (util-linux): new pid, net, ipc, uts namespaces; the host filesystem is visible
  (writes blocked only by the privilege drop where there is one).
- ``none``: rlimits and a process group only.

Always: own session/process group, ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE``,
``RLIMIT_NOFILE``, ``RLIMIT_NPROC``, ``RLIMIT_CORE=0``, a wall-clock timeout that kills the
whole process group (and with it the pid namespace), a fresh empty working directory and a
scrubbed environment (only ``PATH``, ``LANG``, ``HOME``, ``TMPDIR``). When the scorer runs as
root, the program runs as an unprivileged uid (random per run): root ignores
``RLIMIT_NPROC`` and may signal any process, so without the drop a fork bomb is not
contained. The drop needs ``setpriv`` and, outside bwrap, a Python readable by other users;
where it is impossible the sandbox logs a warning and refuses fork-heavy limits it cannot
enforce (see ``Isolation.nproc_enforced``).

The verdict comes only from a pipe held open by the scorer, one JSON record per assert, each
carrying a per-run random nonce the program never sees on disk or in argv (see
``_harness.py``). Exit codes and output are never trusted. Residual risk, documented: a
program that introspects the harness's own memory (``gc``, frames) in its process could
recover the nonce; closing that needs a process per assert.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import resource
import secrets
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

log = logging.getLogger(__name__)

_HARNESS = (Path(__file__).with_name("_harness.py")).read_text()
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
    workdir_bytes: int = 64 << 20  # size of the private tmpfs (bwrap only)


@dataclass
class RunResult:
    """What happened to one program.

    status: "ok" (harness finished), "timeout" (wall clock), "killed" (by a signal: CPU limit,
        memory...), "exited" (ended before the harness finished: early exit, crash).
    passed / total: assert executions that passed / counted (unrun asserts count when the
        run did not finish). program_ok: the program body ran without raising.
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
    mode: str  # "bwrap" | "unshare" | "none"
    drop_uid: bool  # run as an unprivileged random uid (scorer is root)
    nproc_enforced: bool


@functools.cache
def detect_isolation(requested: str = "auto") -> Isolation:
    """Pick the strongest isolation this machine supports (probed once, by running it)."""
    root = os.geteuid() == 0
    setpriv = shutil.which("setpriv") is not None
    order = ["bwrap", "unshare", "none"] if requested == "auto" else [requested]
    for mode in order:
        if mode != "none" and shutil.which(mode) is None:
            continue
        drop = root and setpriv and (mode == "bwrap" or _world_readable_python())
        iso = Isolation(mode, drop, nproc_enforced=not root or drop)
        if mode == "none" or _probe(iso):
            if mode != "bwrap":
                log.warning(
                    "code sandbox: using %r isolation (%s): the program can read the host "
                    "filesystem%s. Install the Debian package 'bubblewrap'.",
                    mode, "requested" if requested != "auto" else "bubblewrap unavailable",
                    "" if iso.nproc_enforced else " and RLIMIT_NPROC is not enforced (root)",
                )  # fmt: skip
            return iso
    raise RuntimeError(f"sandbox isolation {requested!r} is not available on this machine")


def _world_readable_python() -> bool:
    path = Path(sys.executable).resolve()
    for p in [path, *path.parents]:
        mode = p.stat().st_mode
        if not mode & (stat.S_IXOTH if p != path else stat.S_IROTH | stat.S_IXOTH):
            return False
    return True


def _probe(iso: Isolation) -> bool:
    try:
        res = _run(iso, {"kind": "run", "program": "x = 1"}, Limits(wall_seconds=20), 0)
    except OSError:
        return False
    return res.status == "ok" and res.program_ok


def _python_roots() -> list[str]:
    roots = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)}
    roots.add(str(Path(sys.executable).resolve().parent.parent))
    return sorted(r for r in roots if not r.startswith("/usr"))


def _command(iso: Isolation, uid: int, workdir: str, limits: Limits, fd: int) -> list[str]:
    py = [os.path.realpath(sys.executable), "-I", "-B", "-c", _HARNESS, str(fd)]
    drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs"]
    if iso.mode == "bwrap":
        cmd = ["bwrap", "--die-with-parent", "--new-session"]
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
        return cmd + ["--"] + (drop if iso.drop_uid else []) + py
    if iso.mode == "unshare":
        cmd = ["unshare", "--pid", "--fork", "--kill-child", "--net", "--ipc", "--uts"]
        if os.geteuid() != 0:
            cmd += ["--user", "--map-root-user"]
        return cmd + ["--"] + (drop if iso.drop_uid else []) + py
    return (drop if iso.drop_uid else []) + py


def _env(workdir: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": workdir,
        "TMPDIR": workdir,
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
    }


def _preexec(limits: Limits):
    def set_limits() -> None:  # runs in the child between fork and exec: keep it minimal
        cpu = max(1, int(limits.cpu_seconds))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_size_bytes, limits.file_size_bytes))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.nproc, limits.nproc))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
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
    isolation: str = "auto",
) -> RunResult:
    """Run ``program`` in the sandbox, then its tests.

    kind: "run" (program only, as ``__main__``), "humaneval" (``tests`` defines
        ``check(candidate)``, called with ``entry_point``), "asserts" (``tests`` is a list of
        assert statements, MBPP style), "script" (``tests`` is code with asserts).
    """
    payload = {
        "kind": kind,
        "program": program,
        "tests": tests,
        "entry_point": entry_point,
        "setup": setup,
    }
    static = _static_asserts(kind, tests)
    res = _run(detect_isolation(isolation), payload, limits or Limits(), static)
    return res


def _static_asserts(kind: str, tests: Any) -> dict[str, None]:
    """Ids of the asserts in the tests, as the harness numbers them (trusted, host side)."""
    import ast

    def ids(src: str, prefix: str) -> list[str]:
        try:
            n = sum(isinstance(node, ast.Assert) for node in ast.walk(ast.parse(src)))
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return [prefix + "0"]  # unparseable test: one failing assert
        return [f"{prefix}{i}" for i in range(n)]

    if kind == "asserts":
        return {i: None for k, src in enumerate(tests) for i in ids(str(src), f"a{k}.")}
    if kind in ("humaneval", "script"):
        return dict.fromkeys(ids(str(tests), "t"))
    return {}


def _run(iso: Isolation, payload: dict, limits: Limits, static: Any) -> RunResult:
    nonce = secrets.token_hex(16)
    uid = 100_000 + secrets.randbelow(800_000)
    data = json.dumps({**payload, "nonce": nonce}).encode()
    workdir = tempfile.mkdtemp(prefix="grpo-sandbox-")
    vr, vw = os.pipe()
    try:
        if iso.drop_uid:
            os.chown(workdir, uid, uid)
        os.chmod(workdir, 0o700)
        cwd = workdir if iso.mode != "bwrap" else "/"
        stderr_path = Path(tempfile.mkdtemp(prefix="grpo-sandbox-err-")) / "stderr"
        with open(stderr_path, "wb+") as err:
            t0 = time.monotonic()
            proc = subprocess.Popen(
                _command(iso, uid, workdir, limits, vw),
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err, cwd=cwd,
                env=_env(workdir if iso.mode != "bwrap" else "/tmp"), pass_fds=(vw,),
                start_new_session=True, preexec_fn=_preexec(limits),
            )  # fmt: skip
            os.close(vw)
            vw = -1
            chunks: list[bytes] = []
            reader = threading.Thread(target=_drain, args=(vr, chunks), daemon=True)
            reader.start()
            writer = threading.Thread(target=_feed, args=(proc, data), daemon=True)
            writer.start()
            timed_out = False
            try:
                proc.wait(timeout=limits.wall_seconds)
            except subprocess.TimeoutExpired:
                timed_out = True
            _kill_group(proc)
            proc.wait()
            reader.join(timeout=5)
            wall = time.monotonic() - t0
            err.seek(0)
            tail = err.read()[-_STDERR_TAIL:].decode("utf-8", "replace")
        shutil.rmtree(stderr_path.parent, ignore_errors=True)
    finally:
        for fd in (vr, vw):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)
    return _verdict(b"".join(chunks), nonce, static, timed_out, proc.returncode, wall, tail, limits)


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


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the whole process group (the pid namespace dies with its init)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _verdict(raw, nonce, static, timed_out, rc, wall, tail, limits) -> RunResult:
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
    asserts = [r for r in records if r[0] == "assert"]
    passed = sum(r[2] for r in asserts)
    total = len(asserts)
    tests_error = next((r[3] for r in records if r[0] == "tests" and not r[2]), None)
    if not finished or tests_error:  # asserts never reached count as failed
        total += sum(1 for i in static if i not in {r[1] for r in asserts})
    if timed_out:
        status, error = "timeout", f"timeout: killed after {limits.wall_seconds:g}s wall clock"
    elif finished:
        status, error = "ok", None
    elif rc is not None and (rc < 0 or rc > 128):  # bwrap/unshare relay a signal as 128+N
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
        error = "; ".join(parts) or None
    if error and "MemoryError" in tail and status != "ok":
        error += " (MemoryError)"
    return RunResult(status, passed, total, program_ok, error, rc, wall, tail, records)

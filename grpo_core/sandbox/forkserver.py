"""Warm tool sandboxes: python tool calls without a sandbox start and two interpreter starts
per call (``rollout.tool_sandbox: warm``, the default; ``fresh`` runs each call through
:func:`grpo_core.sandbox.run_program` as before).

A server (``_forkserver.py``) is started once inside the same isolation as a fresh call
(bwrap or namespaces: new pid, net, ipc, uts and mount namespaces, read-only ``/usr`` and
Python, a private size-limited tmpfs as ``/tmp``) and forks one call process per call, which
applies the candidate's rlimits, uid drop and seccomp filter and runs the program as a tool
call does (``_candidate.py``'s code). Each call's program and output pass through pipes the
server only hands on, never reads; the call's verdict is its exit status, which the server
reads and answers on a socket the call process does not hold. After each call every process
of the sandbox but the server is killed and reaped and ``/tmp`` wiped; a server that reports
``/tmp`` not clean, does not answer in time or ends is killed (its whole pid namespace) and
replaced, and each server is replaced after :data:`RESTART_EVERY` calls.

Servers are pooled per isolation and tmpfs size, as many as the tool calls run at once
(``ToolSpec.tool_workers``), one call at a time each. They are started from one long-lived thread
(bwrap's ``--die-with-parent`` and the namespaces launcher's parent-death signal follow the
thread that started them), die with this process (parent-death signals, SIGKILL included),
and are shut down at exit; every process of a server is reaped when it is closed
(:mod:`grpo_core.sandbox.reaper`).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import json
import os
import resource
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from grpo_core.sandbox import launcher, reaper
from grpo_core.sandbox.launcher import Limits, _rlimits
from grpo_core.sandbox.verdict import RunResult, ended

if TYPE_CHECKING:
    from grpo_core.sandbox.isolation import Isolation

SERVER = "_GRPO_NO_SERVE = True\n" + launcher._source(
    "_seccomp.py", "_wire.py", "_candidate.py", "_forkserver.py"
)
RESTART_EVERY = 256  # calls per server, then a fresh one (defence in depth)
_START_S = 30.0
_GRACE_S = 5.0  # the scorer's own deadline past the call's wall clock
_MAX_PROGRAM = 1 << 20  # a pipe's largest size: the program is written before the call starts
_MAX_REPLY = 4 << 20
_F_SETPIPE_SZ = 1031
_SERVER_RLIMITS = {"RLIMIT_CORE": (0, 0), "RLIMIT_NOFILE": (256, 256)}


class ServerGone(RuntimeError):
    """The server ended, or did not answer in time."""


def _preexec(parent: int):
    prctl = ctypes.CDLL(None).prctl  # loaded here: nothing is imported between fork and exec

    def setup() -> None:  # between fork and exec: die with the thread that starts us
        prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(125)
        for name, value in _SERVER_RLIMITS.items():
            resource.setrlimit(getattr(resource, name), value)

    return setup


class _Server:
    """One server: the launcher process, the sandbox's pid 1 (a pidfd) and the socket."""

    def __init__(self, iso: Isolation, tmp_bytes: int):
        self.calls, self.proc, self.pidfd, self.closed = 0, None, -1, False
        launcher._sweep_orphans()
        self.workdir = tempfile.mkdtemp(prefix=f"{launcher._WORKDIR_PREFIX}{os.getpid()}-")
        os.chmod(self.workdir, 0o700)
        self.err = tempfile.TemporaryFile(prefix="grpo-sandbox-err-")  # noqa: SIM115 (closed in close)
        self.sock, guest = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ir, iw = os.pipe()
        fd, bwrap = guest.fileno(), iso.mode == "bwrap"
        argv = ["-s", "-P", "-B", "-c"]  # the candidate's flags: PYTHONHASHSEED holds
        if bwrap:
            cmd = [*launcher.bwrap_prefix(iso, tmp_bytes, iw), launcher._python(), *argv]
            cmd += [SERVER, str(fd)]
        else:
            cfg = launcher.nsinit_config(self.workdir, None, fd, _SERVER_RLIMITS, tmp_bytes, 0)
            cmd = [launcher._python(), *argv, launcher._NSINIT + "\n" + SERVER, cfg]
        reaper.hold()  # released in close(): the pid-1, orphaned, comes back to be reaped
        try:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL if bwrap else iw,
                stderr=self.err,
                cwd="/",
                env=launcher._env("/tmp"),
                pass_fds=(fd, iw) if bwrap else (fd,),
                start_new_session=True,
                preexec_fn=_preexec(os.getpid()) if bwrap else None,
            )
            guest.close()
            os.close(iw)
            iw = -1
            self.pidfd = reaper.open_pid1(ir, self.proc, time.monotonic() + _START_S)
            ready = self._answer(time.monotonic() + _START_S)
        except BaseException:
            self.close()
            raise
        finally:
            guest.close()
            for f in (ir, iw):
                if f >= 0:
                    os.close(f)
        if ready != {"ready": True} or self.pidfd < 0:
            self.close()
            raise ServerGone(f"the tool sandbox did not start: {self.stderr_tail() or ready}")

    def stderr_tail(self) -> str:
        with contextlib.suppress(OSError, ValueError):
            self.err.seek(0)
            return self.err.read()[-launcher._STDERR_TAIL :].decode("utf-8", "replace").strip()
        return ""

    def _answer(self, deadline: float) -> dict | None:
        wait = deadline - time.monotonic()
        if wait <= 0 or not select.select([self.sock], [], [], wait)[0]:
            raise ServerGone("the tool sandbox did not answer in time")
        try:
            msg = self.sock.recv(65536)
        except OSError:
            msg = b""
        if not msg:
            raise ServerGone(f"the tool sandbox ended ({self.stderr_tail() or 'no message'})")
        return json.loads(msg)

    def alive(self) -> bool:
        """Idle and up: the server never writes unasked, and its sandbox's pid 1 runs."""
        return not select.select([self.sock, self.pidfd], [], [], 0)[0]

    def call(self, program: str, limits: Limits, output_chars: int) -> tuple[dict, bytes]:
        """Run one call: the server's answer (``rc``, ``timeout``, ``clean``) and the raw
        bytes the call process wrote on its reply pipe."""
        data = json.dumps(program).encode()
        if len(data) > _MAX_PROGRAM:
            raise ValueError(f"a tool call's program over {_MAX_PROGRAM >> 20} MiB")
        req = {"rlimits": _rlimits(limits), "wall": limits.wall_seconds,
               "output_chars": output_chars}  # fmt: skip
        pr, pw = os.pipe()
        rr, rw = os.pipe()
        try:
            if len(data) > 60_000:
                fcntl.fcntl(pw, _F_SETPIPE_SZ, _MAX_PROGRAM)
            os.write(pw, data)  # fits the pipe: nothing reads it before the call starts
            os.close(pw)
            pw = -1
            try:
                socket.send_fds(self.sock, [json.dumps(req).encode()], [pr, rw])
            except OSError as exc:
                raise ServerGone(f"the tool sandbox is gone ({exc})") from exc
        finally:
            for f in (pr, rw, pw):
                if f >= 0:
                    os.close(f)
        try:
            return self._collect(rr, time.monotonic() + limits.wall_seconds + _GRACE_S)
        finally:
            os.close(rr)
            self.calls += 1

    def _collect(self, rr: int, deadline: float) -> tuple[dict, bytes]:
        out, answer, open_ = bytearray(), None, True
        while answer is None or open_:
            wait = deadline - time.monotonic()
            ready = select.select([self.sock, rr] if open_ else [self.sock], [], [], max(0, wait))
            if not ready[0] and wait <= 0:
                raise ServerGone("the tool sandbox did not answer in time")
            if rr in ready[0]:
                chunk = os.read(rr, 65536)
                open_ = bool(chunk)
                if len(out) < _MAX_REPLY:
                    out += chunk
            if self.sock in ready[0]:
                answer = self._answer(deadline)
        return answer, bytes(out)

    def close(self) -> None:
        """Kill the sandbox (its pid 1: the kernel empties the pid namespace), reap it and
        the launcher."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.close()
        if self.proc is not None:
            reaper.stop(self.proc, self.pidfd)
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1
        shutil.rmtree(self.workdir, ignore_errors=True)
        self.err.close()
        reaper.release()


_STARTER: ThreadPoolExecutor | None = None  # the long-lived thread servers are started from


def _start(iso: Isolation, tmp_bytes: int) -> _Server:
    global _STARTER
    if _STARTER is None:
        _STARTER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpo-tool-sandbox")
    return _STARTER.submit(_Server, iso, tmp_bytes).result()


class Pool:
    """Servers of one isolation and tmpfs size; at most ``size`` at once, one call each."""

    def __init__(self, iso: Isolation, tmp_bytes: int):
        self.iso, self.tmp_bytes = iso, tmp_bytes
        self.idle: list[_Server] = []
        self.live, self.size, self.started = 0, 1, 0
        self.cond = threading.Condition()

    def _acquire(self, size: int) -> _Server:
        with self.cond:
            self.size = max(self.size, size)
            while not self.idle and self.live >= self.size:
                self.cond.wait()
            while self.idle:
                srv = self.idle.pop()
                if srv.alive():
                    return srv
                self.live -= 1
                srv.close()  # it ended while idle
            self.live += 1
        try:
            srv = _start(self.iso, self.tmp_bytes)
        except BaseException:
            self._release(None, keep=False)
            raise
        with self.cond:
            self.started += 1
        return srv

    def _release(self, srv: _Server | None, keep: bool) -> None:
        if srv is not None and not keep:
            srv.close()
        with self.cond:
            if keep and srv is not None:
                self.idle.append(srv)
            else:
                self.live -= 1
            self.cond.notify()

    def call(self, program: str, limits: Limits, output_chars: int, size: int):
        srv = self._acquire(size)
        keep = False
        try:
            answer, raw = srv.call(program, limits, output_chars)
            keep = answer.get("clean") is True and srv.calls < RESTART_EVERY
            return answer, raw
        finally:
            self._release(srv, keep)

    def close(self) -> None:
        with self.cond:
            idle, self.idle = self.idle, []
            self.live -= len(idle)
        for srv in idle:
            srv.close()


_POOLS: dict[tuple, Pool] = {}
_LOCK = threading.Lock()


def pool(iso: Isolation, tmp_bytes: int) -> Pool:
    with _LOCK:
        key = (iso, tmp_bytes)
        if key not in _POOLS:
            _POOLS[key] = Pool(iso, tmp_bytes)
        return _POOLS[key]


def shutdown_all() -> None:
    """Close every idle server (at exit; a benchmark between its arms)."""
    with _LOCK:
        pools = list(_POOLS.values())
    for p in pools:
        p.close()


atexit.register(shutdown_all)


def _forget_in_child() -> None:  # a forked scorer must not talk to its parent's servers
    for p in _POOLS.values():
        for srv in p.idle:
            with contextlib.suppress(OSError):
                srv.sock.close()
    _POOLS.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def run_tool(program: str, iso: Isolation, limits: Limits, workers: int = 1,
             output_chars: int = 4000) -> RunResult:  # fmt: skip
    """One python tool call on a warm server: the :class:`RunResult` the fresh path
    (``run_program(kind="tool")``) gives for the same program, field for field that the
    tool reads (``program_ok``, ``error``, ``output``)."""
    p = pool(iso, limits.workdir_bytes)
    t0 = time.monotonic()
    for attempt in (0, 1):
        try:
            answer, raw = p.call(program, limits, output_chars, workers)
            break
        except ServerGone as exc:  # gone before it took the call: one more, on a fresh one
            if attempt or "is gone" not in str(exc):
                return RunResult("error", error=f"sandbox: {exc}", wall_s=time.monotonic() - t0)
    return _result(answer, raw, limits, output_chars, time.monotonic() - t0)


def _result(answer: dict, raw: bytes, limits: Limits, output_chars: int, wall: float):
    """The fresh path's outcome, rule for rule (``_harness.py``'s tool branch and
    ``verdict.read_verdict``): the exit status decides, the reply carries the output."""
    rc = answer.get("rc")
    if answer.get("timeout"):
        error = f"timeout: killed after {limits.wall_seconds:g}s wall clock"
        return RunResult("timeout", error=error, returncode=rc, wall_s=wall)
    if b"\n" not in raw:  # no reply: the call process died first (a signal, os._exit)
        status, error = ended(rc, limits)
        return RunResult(status, error=error, returncode=rc, wall_s=wall)
    try:
        reply = json.loads(raw.split(b"\n", 1)[0])
    except ValueError:  # the fresh harness fails on a reply that is not JSON
        status, error = ended(1, limits)
        return RunResult(status, error=error, returncode=1, wall_s=wall)
    if type(reply) is not dict:  # nothing is recorded for it: not ok, no error text
        return RunResult("ok", returncode=rc, wall_s=wall)
    ok = rc == 0
    error = (
        None if ok else "program raised " + (str(reply.get("error") or "") or f"exit status {rc}")
    )
    output = str(reply.get("output") or "")[: output_chars + 100]
    return RunResult("ok", program_ok=ok, error=error, returncode=rc, wall_s=wall, output=output)

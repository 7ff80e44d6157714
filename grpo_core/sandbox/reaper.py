"""Ending a sandbox and reaping every process it started, also under a PID 1 that does not reap.

A sandbox is a launcher process (``bwrap``, or ``_nsinit.py`` for ``namespaces``; a child of
this process, in a session of its own) and the sandbox's pid-1, the launcher's child, whose
end empties the sandbox's pid namespace. :func:`open_pid1` holds the pid-1 through a pidfd;
:func:`stop` ends a run: the pid-1 is SIGKILLed first and its exit awaited while the launcher
still runs, so that the launcher reaps it and exits on its own, then the launcher's process
group is SIGKILLed and the launcher waited for.

bwrap's outer process still exits before its pid-1 whenever the program ends by itself (it
returns as soon as the pid-1 reports the exit status, without waiting for the pid-1), and any
launcher killed first leaves its pid-1 behind: that orphan would go to PID 1 of this process's
pid namespace, a zombie for good where that PID 1 does not reap (a container's entry point,
``unshare --pid --fork``: one per bwrap call). So while a sandbox of this process is up
(:func:`hold` .. :func:`release`), this process is a child subreaper
(``prctl(PR_SET_CHILD_SUBREAPER)``): the orphaned pid-1 comes back here, and :func:`stop`
reaps exactly it, through its pidfd (``waitid(P_PIDFD)``), never a child another part of this
process waits for. Side effect: an orphan of another descendant of this process that ends
while a sandbox is up also comes here, and stays a zombie of this process until it exits
(where PID 1 does not reap it would have been one anyway).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import subprocess
import threading
import time
from pathlib import Path

_PR_SET_CHILD_SUBREAPER = 36
_LAUNCHER_GRACE_S = 2.0  # for the launcher to see its pid-1's end and exit on its own
_LOCK = threading.Lock()
_HELD = 0  # sandboxes of this process that are up
_LIBC: ctypes.CDLL | None = None


def hold() -> None:
    """A sandbox starts: this process is a child subreaper until every one has ended."""
    global _HELD
    with _LOCK:
        if _HELD == 0:
            _subreaper(True)
        _HELD += 1


def release() -> None:
    """A sandbox has ended and been reaped (:func:`stop`)."""
    global _HELD
    with _LOCK:
        _HELD = max(0, _HELD - 1)
        if _HELD == 0:
            _subreaper(False)


def _subreaper(on: bool) -> None:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    _LIBC.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)  # best effort: Linux >= 3.4


def _forget_in_child() -> None:  # the flag is not inherited, nor are the parent's sandboxes
    global _HELD, _LOCK
    _HELD, _LOCK = 0, threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


def _stat(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` from the state on (state, ppid, pgrp, session, ...)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


def open_pid1(info_fd: int, proc: subprocess.Popen, deadline: float) -> int:
    """A pidfd on the sandbox's pid-1 (-1 in mode none, or if it already ended): the process
    whose pid the launcher (bwrap or _nsinit.py) reported, checked after the pidfd was opened
    to be the launcher's child, or an orphan of the launcher's session that came back here,
    so that a recycled pid is never signalled."""
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
    stat = _stat(pid)
    ppid, sid = (int(stat[1]), int(stat[3])) if stat else (None, None)
    # the launcher is not reaped yet: its pid, the session of its own, cannot be anyone else's
    if ppid != proc.pid and not (ppid == os.getpid() and sid == proc.pid):
        os.close(fd)  # already gone (and its pid possibly someone else's)
        return -1
    return fd


def stop(proc: subprocess.Popen, pidfd: int, contained: bool = True) -> None:
    """End the sandbox of launcher ``proc`` and reap all of it: SIGKILL its pid-1 (the kernel
    then kills its whole pid namespace) and await its exit, give the launcher a moment to
    reap it and exit, SIGKILL the launcher's process group, wait for the launcher, then reap
    the pid-1 where it was orphaned to this process (``contained``: a sandbox with a pid-1,
    not mode none)."""
    if pidfd >= 0:
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        select.select([pidfd], [], [], 10.0)  # readable once it exited, its namespace empty
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=_LAUNCHER_GRACE_S)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if pidfd >= 0:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)
    elif contained:
        _reap_session(proc.pid)


def _reap_session(sid: int) -> None:
    """Reap the children of this process in session ``sid``, a launcher's: a pid-1 that was
    not reported in time, orphaned here (the killpg above reached it, as it did the
    launcher). The launcher's pid stays taken while a process of its session exists."""
    me = os.getpid()
    for name in os.listdir("/proc"):
        stat = _stat(int(name)) if name.isdigit() else None
        if stat and stat[1] == str(me) and stat[3] == str(sid):
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(int(name), 0)

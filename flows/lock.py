"""One ``grpo run`` per workspace.

``runs/<run_name>/grpo.lock`` is held with ``fcntl.flock`` (exclusive, non-blocking) for as
long as a ``grpo run`` of that run name lives. It holds the owner's pid, host, start time and
command line, so a second run in the same folder stops at once with a message naming the
first. The kernel drops the lock when the owner's process dies, however it dies (SIGKILL
included): a lock file left behind is never stale, and nothing has to clean it up.
(Opening a fresh MLflow sqlite store is serialised separately: tasks/tracking/store.py.)
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

LOCK_NAME = "grpo.lock"


class WorkspaceBusy(RuntimeError):
    """Another live process holds the workspace's lock."""


@dataclass
class WorkspaceLock:
    path: Path
    fd: int
    thread: int
    depth: int = 1

    def release(self) -> None:
        self.depth -= 1
        if self.depth > 0:
            return
        _held.pop(self.path, None)
        with contextlib.suppress(OSError):
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)

    def __enter__(self) -> WorkspaceLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# locks this process holds, by lock file: flock conflicts between two descriptors of one
# process too, so a second acquire in the thread that holds it (the CLI, then the flow) nests
_held: dict[Path, WorkspaceLock] = {}
_held_guard = threading.Lock()


def _owner(path: Path) -> dict:
    """The owner record in the lock file; the owner writes it right after locking, so an
    empty file is read again for a moment."""
    for _ in range(40):
        try:
            text = path.read_text()
            if text.strip():
                return json.loads(text)
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    return {}


def _busy_message(run_name: str, shown: str, owner: dict) -> str:
    pid = owner.get("pid", "?")
    host = owner.get("host")
    on_host = f" on {host}" if host and host != socket.gethostname() else ""
    started = owner.get("started", "")
    try:
        when = datetime.fromisoformat(started).strftime("%H:%M")
    except ValueError:
        when = "?"
    return (
        f"run {run_name} (pid {pid}{on_host}, started {when}) is using {shown}; "
        "wait for it or use --set run_name=..."
    )


def _program() -> str:
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"
    return "grpo" if name in ("cli.py", "grpo") else name


def acquire_workspace(output_dir: str | Path, run_name: str) -> WorkspaceLock:
    """Lock ``<output_dir>/<run_name>`` for this process, or raise :class:`WorkspaceBusy`.

    The lock lives until :meth:`WorkspaceLock.release` or the end of the process."""
    root = Path(output_dir).resolve() / run_name
    shown = str(Path(output_dir) / run_name)
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_NAME
    with _held_guard:
        held = _held.get(path)
        if held is not None:
            if held.thread == threading.get_ident():
                held.depth += 1
                return held
            raise WorkspaceBusy(_busy_message(run_name, shown, _owner(path)))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise WorkspaceBusy(_busy_message(run_name, shown, _owner(path))) from None
        except BaseException:
            os.close(fd)
            raise
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.now().isoformat(timespec="seconds"),
            "command": shlex.join([_program(), *sys.argv[1:]]),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        lock = WorkspaceLock(path, fd, threading.get_ident())
        _held[path] = lock
        return lock

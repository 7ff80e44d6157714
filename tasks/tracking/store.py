"""Safe calls to an MLflow store: signal deferral around sqlite store calls, and the lock
that serialises opening a fresh sqlite store.

A Ctrl-C or SIGTERM landing inside a sqlite write leaves the database locked until its
traceback is freed, so calls to a sqlite store run with those signals held
(:func:`signals_deferred`, :func:`store_call`, :class:`Shielded`); a tracking server needs
no such care. The first open of a sqlite store creates its schema, one process at a time
(:func:`store_lock`).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import signal
import threading
from pathlib import Path

from mlflow.tracking import MlflowClient


@contextlib.contextmanager
def signals_deferred():
    """Hold Ctrl-C and SIGTERM until the block ends (main thread; elsewhere Python runs no
    signal handler anyway), then deliver them to the handlers that were there (Python's,
    Prefect's or the CLI's). The same signal a second time is not held. A signal landing
    inside a sqlite write would leave the interrupted statement open, and its lock held,
    until its traceback is freed: the runs could then not be ended KILLED."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    saved = {}

    def hold(num: int, frame) -> None:
        if num not in pending:
            pending.append(num)
            return
        pending.remove(num)  # twice: stop waiting
        handler = saved[num]
        if callable(handler):
            handler(num, frame)
        elif handler == signal.SIG_DFL:
            signal.signal(num, signal.SIG_DFL)
            os.kill(os.getpid(), num)

    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not None:  # None: installed outside Python, left alone
            saved[sig] = signal.signal(sig, hold)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        for sig in pending:
            os.kill(os.getpid(), sig)


def store_call(uri: str):
    """:func:`signals_deferred` around a call to a sqlite store; nothing for a tracking
    server (an interrupted HTTP request holds no lock, and a dead server's retries must stay
    interruptible)."""
    return signals_deferred() if uri.startswith("sqlite:") else contextlib.nullcontext()


class Shielded:
    """An ``MlflowClient`` whose calls run with :func:`signals_deferred` (sqlite stores)."""

    def __init__(self, client: MlflowClient) -> None:
        self._client = client
        self._uri = client.tracking_uri

    def __getattr__(self, name: str):
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        @functools.wraps(attr)
        def call(*args, **kwargs):
            with store_call(self._uri):
                return attr(*args, **kwargs)

        return call


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` tracking URI; None for any other store."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        return None
    rest = uri[len(prefix) :].split("?", 1)[0]
    return Path(rest) if rest and rest != ":memory:" else None


@contextlib.contextmanager
def store_lock(uri: str):
    """Hold ``<db>.lock`` (``flock``, blocking) while a sqlite store is opened: MLflow creates
    or migrates the schema on the first open, and two processes doing that at once fail on
    "table already exists" and can leave the migration half done. Other stores: no lock (a
    tracking server does its own schema work once)."""
    db = sqlite_path(uri)
    if db is None:
        yield
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(db.with_name(db.name + ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the only descriptor drops the lock

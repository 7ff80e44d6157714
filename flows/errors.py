"""How the ``grpo`` CLI reports the errors a user can fix: one line, exit code 2.

Known errors are ``grpo_core.errors.UserError`` (and any ``ValueError``: bad settings),
a reward that cannot run here (``RewardUnavailable``: no code sandbox), a missing file, a read-only folder or database, and a full disk. :func:`user_message` turns
one into a single line naming the file or setting and the fix; anything else is a bug and
keeps its traceback. Most are found by the pre-flight check (flows/preflight/) before
Prefect starts; for the rest, raised inside a flow or task, :func:`quiet_prefect_tracebacks`
stops Prefect's engine from logging a traceback for them (its one-line "Task run failed
with ..." stays, in the console and the UI), and the CLI prints the message last.

``GRPO_DEBUG=1`` keeps every traceback (the CLI re-raises).
"""

from __future__ import annotations

import errno
import logging
import os

from grpo_core.errors import UserError
from grpo_core.rewards.base import RewardUnavailable

EXIT_USER_ERROR = 2
# the loggers of Prefect's flow and task engines ("Encountered exception during execution",
# "Task run failed with exception ...", logged with the traceback)
PREFECT_RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# what safetensors (SafetensorError), torch.save (RuntimeError) and SQLite (MLflow's store)
# say about a full disk
_DISK_FULL_TEXT = (
    "No space left on device",
    "os error 28",
    "Disk quota exceeded",
    "database or disk is full",
)


def debug() -> bool:
    return os.environ.get("GRPO_DEBUG", "").lower() in ("1", "true", "yes")


def one_line(text: str) -> str:
    """``text`` on one line: its non-empty lines joined with '; '."""
    return "; ".join(line.strip() for line in str(text).splitlines() if line.strip())


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen and len(seen) < 20:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _os_message(exc: OSError) -> str | None:
    what = f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror else one_line(exc)
    if exc.errno in _DISK_FULL:
        return f"{what}; free some space or set output_dir to a folder on another disk"
    if exc.errno in _READ_ONLY:
        return f"{what}; make it writable or set output_dir to a writable folder"
    if isinstance(exc, FileNotFoundError):
        return what
    return None


def user_message(exc: BaseException) -> str | None:
    """The one-line message for a known error (looking through its causes), else None."""
    for e in _chain(exc):
        if isinstance(e, UserError | ValueError | RewardUnavailable):
            if "readonly database" in str(e):
                break  # an MLflow/SQLAlchemy error about a read-only sqlite file: below
            return one_line(e)
        if isinstance(e, OSError) and (msg := _os_message(e)):
            return msg
    for e in _chain(exc):  # a full disk reported by a library that is not an OSError
        text = str(e)
        if any(sign in text for sign in _DISK_FULL_TEXT):
            return (
                f"the disk is full ({one_line(text)[:200]}); free some space (or set "
                "output_dir / tracking.uri to another disk) and run the same command again: "
                "finished stages are reused"
            )
    for e in _chain(exc):
        if "attempt to write a readonly database" in str(e):
            return (
                "the MLflow database is read-only (attempt to write a readonly database); make "
                "the file and its folder writable or set tracking.uri to another store"
            )
    return None


class _StripKnownTracebacks(logging.Filter):
    """Drops the traceback from a Prefect engine record about a known error (the record's
    one-line message is kept)."""

    def filter(self, record: logging.LogRecord) -> bool:
        info = record.exc_info
        if info and info[1] is not None and user_message(info[1]) is not None:
            record.exc_info = None
            record.exc_text = None
        return True


_FILTER = _StripKnownTracebacks()


def quiet_prefect_tracebacks() -> None:
    """Install the filter on Prefect's run loggers (idempotent; works before Prefect is
    imported: its logging setup keeps a logger's filters)."""
    if debug():
        return
    for name in PREFECT_RUN_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)

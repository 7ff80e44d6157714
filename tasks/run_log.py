"""Helpers shared by the stage tasks: logging setup and timing."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager


def logger(name: str) -> logging.Logger | logging.LoggerAdapter:
    """Prefect's run logger inside a task/flow run (shown in the UI), else a plain logger."""
    try:
        from prefect.exceptions import MissingContextError
        from prefect.logging import get_run_logger

        try:
            return get_run_logger()
        except MissingContextError:
            pass
    except ImportError:  # pragma: no cover
        pass
    return logging.getLogger(name)


def pull(*paths) -> None:
    """``cluster.storage.pull``, each download said in the run's log (the Prefect UI)."""
    from cluster import storage

    for what in storage.pull(*paths):
        logger(__name__).info("pulled %s", what)


@contextmanager
def timer():
    t = {"start": time.perf_counter(), "seconds": 0.0}
    try:
        yield t
    finally:
        t["seconds"] = time.perf_counter() - t["start"]

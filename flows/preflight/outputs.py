"""Pre-flight checks of where the run writes: the tracking store (an MLflow server answers,
a sqlite file is a writable SQLite database, a local folder is writable) and the output
folders (writable, with free space)."""

from __future__ import annotations

import os
import shutil
import stat
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

from grpo_core.errors import UserError

HEALTH_TIMEOUT_S = 5.0
MIN_FREE_BYTES = 64 << 20
SQLITE_MAGIC = b"SQLite format 3\x00"


OTHER_STORES = {"postgresql", "mysql", "mssql", "databricks"}  # checked by MLflow itself


def check_tracking(uri: str) -> None:
    parsed = urlparse(uri)
    if parsed.scheme in ("http", "https"):
        probe_server(uri)
    elif parsed.scheme == "sqlite":
        check_sqlite(uri)
    elif parsed.scheme in ("", "file"):  # a local file store (mlruns folder)
        check_writable_dir(Path(parsed.path if parsed.scheme else uri), "tracking.uri")
    elif parsed.scheme.split("+")[0] not in OTHER_STORES:
        raise UserError(
            f"tracking.uri {uri}: unknown scheme {parsed.scheme!r}; MLflow takes sqlite:///"
            f"file.db, http(s)://host:port, a folder, or {', '.join(sorted(OTHER_STORES))}"
        )


def probe_server(uri: str, timeout: float = HEALTH_TIMEOUT_S) -> None:
    """``GET <uri>/health`` must answer 200 within ``timeout`` seconds (one try)."""
    url = uri.rstrip("/") + "/health"
    fix = "start it (infra/start-servers.sh) or set tracking.uri=sqlite:///mlflow.db"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            if r.status == 200:
                return
            reason = f"HTTP {r.status}"
    except urllib.error.HTTPError as e:
        reason = f"HTTP {e.code} from {url}: not an MLflow server?"
    except urllib.error.URLError as e:
        reason = str(e.reason)
    except (TimeoutError, OSError) as e:
        reason = str(e) or type(e).__name__
    if "timed out" in reason or reason == "TimeoutError":
        reason = f"no answer within {timeout:g} s"
    raise UserError(f"tracking.uri {uri}: no MLflow server answers ({reason}); {fix}")


def check_sqlite(uri: str) -> None:
    rest = uri[len("sqlite://") :].split("?", 1)[0]
    if not rest or rest in ("/", "/:memory:"):
        return
    path = Path(rest[1:] if rest.startswith("/") else rest)  # sqlite:///rel.db, sqlite:////abs
    fix = "or set tracking.uri to another store"
    if path.exists():
        if not path.is_file():
            raise UserError(f"tracking.uri {uri}: {path} is not a file")
        with open(path, "rb") as f:
            head = f.read(16)
        if head and head != SQLITE_MAGIC:
            raise UserError(f"tracking.uri {uri}: {path} is not an SQLite database; {fix}")
        if not _writable(path):
            raise UserError(
                f"tracking.uri {uri}: the MLflow database {path} is read-only; make it "
                f"writable {fix}"
            )
    folder = path.resolve().parent
    if not folder.is_dir():
        raise UserError(f"tracking.uri {uri}: folder {folder} does not exist; create it {fix}")
    check_writable_dir(folder, f"tracking.uri {uri}: the database's folder")


def _writable(path: Path) -> bool:
    """Writable by this process, and not marked read-only (no write bit at all: also for
    root, who may write anyway)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return False
    flags = os.W_OK | (os.X_OK if stat.S_ISDIR(mode) else 0)
    return os.access(path, flags) and bool(mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def check_writable_dir(path: Path, what: str) -> None:
    """``path`` (which may not exist yet) can be created and written: its nearest existing
    ancestor is a writable folder with some free space."""
    path = Path(path).absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    label = what if what.endswith(":") else f"{what} {path}:"
    if not existing.is_dir():
        raise UserError(f"{label} {existing} is a file, not a folder; choose another path")
    if not _writable(existing):
        raise UserError(
            f"{label} {existing} is read-only; make it writable or choose a writable folder"
        )
    free = shutil.disk_usage(existing).free
    if free < MIN_FREE_BYTES:
        raise UserError(
            f"{label} only {free >> 20} MiB free on its disk; free some space or choose a "
            "folder on another disk"
        )


def check_outputs(cfg) -> None:
    name = cfg.run_name
    if not name or "/" in name or os.sep in name or name in (".", ".."):
        raise UserError(f"run_name {name!r}: must be one folder name, e.g. run_name=demo")
    check_writable_dir(Path(cfg.output_dir), "output_dir")
    run_dir = Path(cfg.output_dir) / name
    if run_dir.exists():
        check_writable_dir(run_dir, "the run folder")

"""Pre-flight checks of where the run writes: the tracking store (an MLflow server answers,
a sqlite file is a writable SQLite database, a local folder is writable) and the output
folders (writable, with free space)."""

from __future__ import annotations

import base64
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
        probe_credentials(uri)
    elif parsed.scheme == "sqlite":
        check_sqlite(uri)
    elif parsed.scheme in ("", "file"):  # a local file store (mlruns folder)
        check_writable_dir(Path(parsed.path if parsed.scheme else uri), "tracking.uri")
    elif parsed.scheme.split("+")[0] not in OTHER_STORES:
        raise UserError(
            f"tracking.uri {uri}: unknown scheme {parsed.scheme!r}; MLflow takes sqlite:///"
            f"file.db, http(s)://host:port, a folder, or {', '.join(sorted(OTHER_STORES))}"
        )


def _get(url: str, authorization: str | None, timeout: float) -> int:
    """The HTTP status of ``GET url`` (with the ``Authorization`` header when given)."""
    req = urllib.request.Request(url)
    if authorization:
        req.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def probe_server(uri: str, timeout: float = HEALTH_TIMEOUT_S) -> None:
    """``GET <uri>/health`` must answer 200 within ``timeout`` seconds (one try)."""
    url = uri.rstrip("/") + "/health"
    fix = "start it (infra/start-servers.sh) or set tracking.uri=sqlite:///mlflow.db"
    try:
        status = _get(url, None, timeout)
        if status == 200:
            return
        reason = (
            f"HTTP {status}" if status < 400 else f"HTTP {status} from {url}: not an MLflow server?"
        )
    except urllib.error.URLError as e:
        reason = str(e.reason)
    except (TimeoutError, OSError) as e:
        reason = str(e) or type(e).__name__
    if "timed out" in reason or reason == "TimeoutError":
        reason = f"no answer within {timeout:g} s"
    raise UserError(f"tracking.uri {uri}: no MLflow server answers ({reason}); {fix}")


def _basic(credentials: str) -> str:
    return "Basic " + base64.b64encode(credentials.encode()).decode()


def probe_credentials(uri: str, timeout: float = HEALTH_TIMEOUT_S) -> None:
    """An MLflow server with its basic-auth app on (infra/start-servers.sh beyond loopback,
    or ``GRPO_AUTH``) answers its API only to a known user: a missing or wrong password stops
    the run here, in one line, not at the first logged metric."""
    user, password = (
        os.environ.get("MLFLOW_TRACKING_USERNAME"),
        os.environ.get("MLFLOW_TRACKING_PASSWORD"),
    )
    auth = _basic(f"{user}:{password}") if user and password else None
    url = uri.rstrip("/") + "/api/2.0/mlflow/experiments/search?max_results=1"
    try:
        status = _get(url, auth, timeout)
    except (urllib.error.URLError, OSError):
        return  # it answered /health a moment ago; MLflow's own retries take it from here
    if status == 401:
        given = "a wrong user or password" if auth else "no user and password"
        raise UserError(
            f"tracking.uri {uri}: the MLflow server asks for a user and password and got "
            f"{given}; set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (source the "
            "env.sh that infra/start-servers.sh wrote)"
        )
    if status == 403:
        raise UserError(
            f"tracking.uri {uri}: the MLflow server refuses this client (HTTP 403: the user "
            "lacks permission, or the host name is not among the server's --allowed-hosts)"
        )


def check_prefect_api(timeout: float = HEALTH_TIMEOUT_S) -> None:
    """A Prefect server the user configured (``PREFECT_API_URL``) that asks for a password
    (``PREFECT_SERVER_API_AUTH_STRING``) must get the right one (``PREFECT_API_AUTH_STRING``):
    else one line now, not a client traceback when the flow starts. Prefect Cloud (an API
    key) and unreachable servers are left to Prefect."""
    api = os.environ.get("PREFECT_API_URL")
    if not api or os.environ.get("PREFECT_API_KEY"):
        return
    creds = os.environ.get("PREFECT_API_AUTH_STRING")
    try:
        status = _get(api.rstrip("/") + "/admin/version", _basic(creds) if creds else None, timeout)
    except (urllib.error.URLError, OSError):
        return
    if status == 401:
        given = "a wrong one" if creds else "none (PREFECT_API_AUTH_STRING is unset)"
        raise UserError(
            f"PREFECT_API_URL {api}: the Prefect server asks for its USER:PASSWORD and got "
            f"{given}; set PREFECT_API_AUTH_STRING (source the env.sh that "
            "infra/start-servers.sh wrote)"
        )


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

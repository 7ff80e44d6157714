"""Shared run storage: the run folder mirrored to an ``fsspec`` URL (``storage.url``).

Every machine works in its own copy of the run folder (``<output_dir>/<run_name>``, at the
same absolute path on every node) and the store at ``<storage.url>/<run_name>`` is the copy
they share, as Ray Train's ``storage_path`` is for its checkpoints:

- a stage's outputs are uploaded when its cache record is written (``tasks/cache.py``),
  outputs first and the manifest last, so a manifest in the store means its outputs are
  there; a file store (``file://``, an NFS mount) gets each file under a temporary name and
  renamed, an object store (``s3://``, ``gs://``, ...) writes each object whole;
- a cache lookup that finds no manifest here reads the store's: when its key matches, the
  outputs are downloaded (each into a temporary name, then renamed) and verified against
  their recorded sha256 like any local output, so a machine that joins later reuses every
  finished stage and a half-uploaded output is recomputed, never trusted;
- a Ray worker pulls the inputs it is handed (checkpoints, scored rollouts) when its node
  lacks them, and a trainer rank uploads the checkpoint it writes (``tasks/update.py``).

The store is configured once per process (``configure``) and passed to the processes it
starts through the ``GRPO_STORAGE`` environment variable. With no ``storage.url`` every
function here is a no-op and nothing of ``fsspec`` is imported. Paths outside the run folder
(a user's data files, a hub model) are never mirrored."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from cluster.state import STATE
from grpo_core.contracts.io import atomic_path

STORAGE_ENV = "GRPO_STORAGE"
log = logging.getLogger(__name__)


class StorageError(RuntimeError):
    """The shared store could not be read or written; the message names the URL."""


class RunStore:
    """The run folder ``local`` and its shared copy at ``url``."""

    def __init__(self, url: str, local: str | Path, options: dict[str, Any] | None = None):
        import fsspec

        self.url = url.rstrip("/")
        self.local = Path(local).resolve()
        self.options = dict(options or {})
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **self.options)
        except (ImportError, ValueError) as e:
            raise StorageError(f"storage.url {self.url}: {e}") from e
        self.root = self.root.rstrip("/")
        # a file system with an atomic rename (file://, a mounted share) gets temporary names
        self.renames = "file" in _protocols(self.fs)
        # what this process uploaded or downloaded, by the local copy's stamp then: the same
        # stamp now is the same bytes, which the store already has
        self._synced: dict[str, tuple] = {}

    # -- paths ---------------------------------------------------------------------------
    def remote(self, path: str | Path) -> str | None:
        """The store's name for a path of the run folder; None for a path outside it."""
        try:
            rel = Path(path).resolve().relative_to(self.local)
        except ValueError:
            return None
        return "/".join([self.root, *rel.parts]) if rel.parts else self.root

    def url_of(self, path: str | Path) -> str:
        """A path's URL in the store (for messages)."""
        try:
            rel = Path(path).resolve().relative_to(self.local)
        except ValueError:
            return str(path)
        return f"{self.url}/{rel.as_posix()}"

    # -- upload --------------------------------------------------------------------------
    def publish(self, path: str | Path) -> None:
        """Upload a file or a directory of the run folder (a directory's files, and remove
        the store's files it no longer has)."""
        p = Path(path)
        remote = self.remote(p)
        if remote is None or not p.exists() or self.in_sync(p):
            return
        try:
            if p.is_dir():
                self._publish_dir(p, remote)
            else:
                self._put(p, remote)
        except OSError as e:
            raise StorageError(f"uploading {p} to {self.url_of(p)}: {e}") from e
        self.mark_synced(p)

    def mark_synced(self, path: str | Path) -> None:
        """Record that the store holds ``path`` as it is now (uploaded or downloaded here,
        or uploaded by a trainer rank)."""
        self._synced[str(Path(path).resolve())] = _stamp(Path(path))

    def in_sync(self, path: str | Path) -> bool:
        known = self._synced.get(str(Path(path).resolve()))
        return known is not None and known == _stamp(Path(path))

    def _publish_dir(self, p: Path, remote: str) -> None:
        names = sorted(
            f.relative_to(p).as_posix()
            for f in p.rglob("*")
            if f.is_file() and not _is_temporary(f.name)
        )
        for name in names:
            self._put(p / name, f"{remote}/{name}")
        stale = set(self._list(remote)) - set(names)
        for name in sorted(stale):
            self.fs.rm_file(f"{remote}/{name}")

    def _put(self, local: Path, remote: str) -> None:
        parent = remote.rsplit("/", 1)[0]
        self.fs.makedirs(parent, exist_ok=True)
        if not self.renames:
            self.fs.put_file(str(local), remote)
            return
        tmp = f"{parent}/.{remote.rsplit('/', 1)[1]}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            self.fs.put_file(str(local), tmp)
            self.fs.mv(tmp, remote)
        finally:
            if self.fs.exists(tmp):
                self.fs.rm_file(tmp)

    def remove(self, path: str | Path) -> None:
        """Delete a file or folder of the run folder from the store (a pruned checkpoint)."""
        remote = self.remote(path)
        if remote is None:
            return
        if self.fs.isdir(remote):
            self.fs.rm(remote, recursive=True)
        elif self.fs.isfile(remote):
            self.fs.rm_file(remote)

    # -- download ------------------------------------------------------------------------
    def read_text(self, path: str | Path) -> str | None:
        """A small file's text from the store (a manifest), None if it is not there."""
        remote = self.remote(path)
        if remote is None:
            return None
        self.fs.invalidate_cache(remote)  # another machine may have written it since
        try:
            with self.fs.open(remote, "rb") as f:
                return f.read().decode()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StorageError(f"reading {self.url_of(path)}: {e}") from e

    def pull(self, path: str | Path) -> bool:
        """Download a file or directory of the run folder that this machine lacks; True when
        it is here afterwards. An existing local copy is kept as it is."""
        p = Path(path)
        if p.exists():
            return True
        remote = self.remote(p)
        if remote is None:
            return False
        self.fs.invalidate_cache(remote)  # listings cached by the file system may be stale
        try:
            if self.fs.isdir(remote):
                names = self._list(remote)
                if not names:
                    return False
                self._get_dir(remote, names, p)
            elif self.fs.isfile(remote):
                with atomic_path(p) as tmp:
                    self.fs.get_file(remote, str(tmp))
            else:
                return False
        except OSError as e:
            raise StorageError(f"downloading {self.url_of(p)} to {p}: {e}") from e
        log.info("pulled %s from %s", p, self.url_of(p))  # tasks say it in the run's log
        self.mark_synced(p)
        return True

    def _get_dir(self, remote: str, names: list[str], p: Path) -> None:
        """A directory downloaded beside ``p`` and renamed into place, unless another process
        of this machine (the other trainer rank) put it there first: then that copy is kept,
        since it may already be reading it."""
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            for name in names:
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(f"{remote}/{name}", str(tmp / name))
            if not p.exists():
                with contextlib.suppress(OSError):  # lost the race: the winner's copy stays
                    os.rename(tmp, p)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _list(self, remote: str) -> list[str]:
        """Files under a store directory, relative to it (temporary names left out)."""
        if not self.fs.isdir(remote):
            return []
        prefix = remote.rstrip("/") + "/"
        out = []
        for f in self.fs.find(remote):
            name = f[len(prefix) :] if f.startswith(prefix) else f.rsplit("/", 1)[-1]
            if not _is_temporary(name.rsplit("/", 1)[-1]):
                out.append(name)
        return sorted(out)

    def as_env(self) -> str:
        return json.dumps({"url": self.url, "local": str(self.local), "options": self.options})


def _stamp(p: Path) -> tuple:
    """Size, modification and inode change time of a file, or of each file of a directory."""
    if p.is_file():
        st = p.stat()
        return (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return tuple(
        (f.relative_to(p).as_posix(), *_stamp(f)) for f in sorted(p.rglob("*")) if f.is_file()
    )


def _protocols(fs) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


def _is_temporary(name: str) -> bool:
    return name.startswith(".") and (".tmp-" in name or ".old-" in name)


def configure(url: str | None, local: str | Path, options: dict[str, Any] | None = None) -> None:
    """This process's store (None: no shared storage), kept in cluster/process.py's
    ``STATE``; child processes inherit it through ``GRPO_STORAGE``. Called by
    ``process.set_up`` (the run context)."""
    if not url:
        STATE.store, STATE.store_env = None, None
        os.environ.pop(STORAGE_ENV, None)
        return
    store = STATE.store
    if store is not None and (store.url, store.local, store.options) == (
        url.rstrip("/"),
        Path(local).resolve(),
        dict(options or {}),
    ):
        return  # the same store again (each stage command asks): keep what it knows
    STATE.store = RunStore(url, local, options)
    STATE.store_env = os.environ[STORAGE_ENV] = STATE.store.as_env()
    log.info("run folder %s is shared through %s", STATE.store.local, STATE.store.url)


def active() -> RunStore | None:
    """The configured store, or the one a parent process passed in ``GRPO_STORAGE``."""
    spec = os.environ.get(STORAGE_ENV)
    if spec != STATE.store_env:  # set (or cleared) by the process that started this one
        STATE.store_env = spec
        STATE.store = RunStore(**json.loads(spec)) if spec else None
    return STATE.store


def env() -> dict[str, str]:
    """Environment for worker processes (Ray actors): the store, when there is one."""
    store = active()
    return {STORAGE_ENV: store.as_env()} if store is not None else {}


def publish(*paths: str | Path) -> None:
    store = active()
    if store is not None:
        for p in paths:
            store.publish(p)


def pull(*paths: str | Path | None) -> list[str]:
    """Download each of ``paths`` this machine lacks from the shared store; the ones pulled,
    as ``"<path> from <url>"`` (tasks log them in the run: tasks/run_log.py ``pull``)."""
    store = active()
    if store is None:
        return []
    return [f"{p} from {store.url_of(p)}" for p in paths if p is not None and store.pull(p)]


def mark_synced(path: str | Path) -> None:
    store = active()
    if store is not None:
        store.mark_synced(path)


def remove(path: str | Path) -> None:
    store = active()
    if store is not None:
        store.remove(path)

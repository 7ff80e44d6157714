"""Which isolation the code sandbox runs programs under, chosen once per process.

The modes (``bwrap``, ``namespaces``, ``auto``, ``none``) and their guarantees are described in
:mod:`grpo_core.sandbox`. The request comes from the ``isolation=`` argument, else the
``GRPO_SANDBOX_ISOLATION`` environment variable (set by the pipeline's ``sandbox.isolation``),
else ``"auto"``. Each candidate mode is probed by really running a trivial program
(:mod:`grpo_core.sandbox.launcher`); when none works, :class:`SandboxUnavailable` names the fix
(fail closed). ``none`` is only ever used when named, and is logged as a warning.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from grpo_core.errors import RewardUnavailable
from grpo_core.sandbox.launcher import Limits, run_isolated

# the sandbox's logger (the name its log lines and docs/rewards.md have always used)
log = logging.getLogger("grpo_core.sandbox")

MODES = ("auto", "bwrap", "namespaces", "none")
ISOLATION_ENV = "GRPO_SANDBOX_ISOLATION"


class SandboxUnavailable(RewardUnavailable):
    """The requested isolation cannot run on this machine: executing rewards refuse to run."""


@dataclass(frozen=True)
class Isolation:
    mode: str  # "bwrap" | "namespaces" | "none"
    drop_uid: bool  # run as an unprivileged random uid (scorer is root)
    nproc_enforced: bool
    requested: str = "auto"

    @property
    def contained(self) -> bool:
        """The full guarantee set (filesystem, network, signals, environment, cleanup)."""
        return self.mode in ("bwrap", "namespaces")

    def describe(self) -> str:
        how = {
            "bwrap": "bubblewrap namespaces",
            "namespaces": "Linux namespaces (built in)",
            "none": "rlimits only, NOT isolated",
        }[self.mode]
        return f"{self.mode} ({how}; requested {self.requested})"


def requested_isolation(isolation: str | None = None) -> str:
    """The isolation asked for: ``isolation``, else ``$GRPO_SANDBOX_ISOLATION``, else auto."""
    name = isolation or os.environ.get(ISOLATION_ENV) or "auto"
    if name not in MODES:
        where = "" if isolation else f" (from ${ISOLATION_ENV})"
        raise ValueError(f"sandbox isolation {name!r}{where}: expected one of {', '.join(MODES)}")
    return name


def detect_isolation(requested: str | None = None) -> Isolation:
    """The isolation to use for ``requested`` (``auto``: the strongest that works here),
    probed once per process by really running a program; raises :class:`SandboxUnavailable`
    naming the fix when it cannot run."""
    name = requested_isolation(requested)
    path = os.environ.get("PATH")
    return _detect(name, _which("bwrap", path), _which("setpriv", path), os.geteuid())


@functools.lru_cache(maxsize=64)
def _which(program: str, path: str | None) -> str | None:
    """``shutil.which`` for one ``PATH`` value (every tool call asks: ~0.1 ms of stat calls
    each time otherwise); another ``PATH`` looks again."""
    return shutil.which(program, path=path)


@functools.cache
def _detect(requested: str, bwrap: str | None, setpriv: str | None, euid: int) -> Isolation:
    root = euid == 0
    reasons: dict[str, str] = {}
    for mode in ["bwrap", "namespaces"] if requested == "auto" else [requested]:
        if mode == "bwrap" and bwrap is None:
            reasons[mode] = "bubblewrap is not installed (no bwrap on PATH)"
            continue
        if mode == "bwrap" and root and setpriv is None:
            reasons[mode] = "setpriv (util-linux) is missing: the program would run as root"
            continue
        if mode == "none":
            drop = root and setpriv is not None and _world_readable_python()
            iso = Isolation(mode, drop, nproc_enforced=not root or drop, requested=requested)
        else:
            iso = Isolation(mode, root, nproc_enforced=True, requested=requested)
        why = _probe(iso)
        if why is None:
            _log_choice(iso, reasons)
            return iso
        reasons[mode] = why
    raise SandboxUnavailable(_unavailable_message(requested, reasons))


def _log_choice(iso: Isolation, reasons: dict[str, str]) -> None:
    skipped = "".join(f"; {m} unavailable: {why}" for m, why in reasons.items())
    if iso.mode == "none":
        log.warning(
            "code sandbox: isolation %s, set on purpose: programs run with rlimits only; they "
            "can read and write what uid %s can, use the network and signal that uid's "
            "processes%s. Use it only on a machine dedicated to scoring.",
            iso.describe(),
            "(random, unprivileged)" if iso.drop_uid else os.geteuid(),
            "" if iso.nproc_enforced else ", and RLIMIT_NPROC is not enforced (root)",
        )
    else:
        log.info("code sandbox: isolation %s%s", iso.describe(), skipped)


def _unavailable_message(requested: str, reasons: dict[str, str]) -> str:
    why = "; ".join(f"{mode}: {reason}" for mode, reason in reasons.items())
    return (
        f"code sandbox: cannot run untrusted programs with isolation {requested!r} on this "
        f"machine ({why}). Fix: install bubblewrap (Debian/Ubuntu: apt-get install "
        "bubblewrap; plus util-linux's setpriv when scoring as root), or score as root / where "
        "user namespaces are allowed (isolation 'namespaces'), or run scoring on a machine "
        "that can (docs/rewards.md). To run without isolation on purpose, set the sandbox "
        "isolation to 'none' (config sandbox.isolation=none, GRPO_SANDBOX_ISOLATION=none, or "
        "the reward's sandbox_isolation='none'): the program can then read and write what the "
        "scorer's user can and use the network."
    )


def _world_readable_python() -> bool:
    path = Path(sys.executable).resolve()
    for p in [path, *path.parents]:
        mode = p.stat().st_mode
        if not mode & (stat.S_IXOTH if p != path else stat.S_IROTH | stat.S_IXOTH):
            return False
    return True


def _probe(iso: Isolation) -> str | None:
    """None if a trivial program runs under ``iso``, else why not."""
    try:
        res = run_isolated(iso, {"kind": "run", "program": "x = 1"}, Limits(wall_seconds=20), {})
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    if res.status == "ok" and res.program_ok:
        return None
    tail = res.stderr_tail.strip().splitlines()
    return (tail[-1] if tail else res.error or res.status)[:300]

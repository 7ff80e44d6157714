"""Run untrusted Python programs against tests, isolated, with an unforgeable verdict.

Isolation modes (``isolation=``, or the ``GRPO_SANDBOX_ISOLATION`` environment variable, which
the pipeline's ``sandbox.isolation`` setting sets; default ``"auto"``):

- ``bwrap`` (Debian package ``bubblewrap``, plus ``setpriv`` from util-linux when the scorer
  is root): new pid, net, ipc, uts (and cgroup) namespaces, a read-only view of only ``/usr``
  and the Python installation, a private size-limited tmpfs as the working directory and
  ``/tmp``, nothing else of the host filesystem.
- ``namespaces`` (no external tool: ``_nsinit.py`` calls ``unshare``/``mount`` through the C
  library; needs root, or unprivileged user namespaces): the same guarantees built by hand,
  see ``_nsinit.py``. Python may live in root's home folder: its folder is bound read-only into
  the new root with traversable parents, so the uid drop works.
- ``auto``: ``bwrap`` if it works here, else ``namespaces``, else :class:`SandboxUnavailable`
  (fail closed: the message names the fix).
- ``none``, only when named: rlimits, a process group and (root, with ``setpriv`` and a Python
  readable by other users) a uid drop. The program can read and write whatever that uid can,
  use the network and signal that uid's processes. Logged as a warning.

Guarantees of ``bwrap`` and ``namespaces`` (tests/rewards/test_sandbox.py runs every hostile
program class under each mode the machine has): no write outside the private tmpfs, no
network, no signal to any host process, neither the scorer's environment nor any host
``/proc/<pid>/environ`` readable, nothing left running once the verdict is returned (the
sandbox's pid-1 is killed and its exit waited for through a pidfd), nor a zombie, also under
a PID 1 that does not reap, nothing outliving a scorer that dies (parent-death signals, in
every window of a start), CPU and memory capped
(``RLIMIT_CPU``, ``RLIMIT_AS`` of the program's one process, ``RLIMIT_NPROC`` for the random
uid, tmpfs size), no nested namespace. When the scorer is root the program runs as
a random unprivileged uid: root ignores ``RLIMIT_NPROC``.

Always: own session/process group, ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE``,
``RLIMIT_NOFILE``, ``RLIMIT_NPROC``, ``RLIMIT_CORE=0``, a wall-clock timeout, a scrubbed
environment (only ``PATH``, ``LANG``, ``HOME``, ``TMPDIR``).

The program runs in a candidate process of its own (``_candidate.py``), one process (a seccomp
filter refuses new processes and namespaces, ``_seccomp.py``); the tests run in the harness
(``_harness.py``), against proxies that call the program by value and receive only plain
values (``_wire.py``). The verdict comes only from a pipe the harness holds, one JSON record
per assert run, each with a per-run nonce the candidate process never has; credit is per
assert statement of the tests that exercise the candidate (``credit.py``), one that never ran
counting as failed. Exit codes and output are never trusted.

Layout: :mod:`grpo_core.sandbox.isolation` chooses the mode (probed once per process),
:mod:`grpo_core.sandbox.launcher` starts one program under it and cleans up,
:mod:`grpo_core.sandbox.reaper` ends a sandbox and reaps every process it started,
:mod:`grpo_core.sandbox.verdict` reads the verdict into a :class:`RunResult`. This module is
the public entry: :func:`run_program` and the names callers use.
"""

from __future__ import annotations

from typing import Any

from grpo_core.sandbox import credit
from grpo_core.sandbox.isolation import (
    ISOLATION_ENV,
    MODES,
    Isolation,
    SandboxUnavailable,
    detect_isolation,
    requested_isolation,
)
from grpo_core.sandbox.launcher import Limits, run_isolated
from grpo_core.sandbox.verdict import RunResult

__all__ = [
    "ISOLATION_ENV",
    "MODES",
    "Isolation",
    "Limits",
    "RunResult",
    "SandboxUnavailable",
    "detect_isolation",
    "requested_isolation",
    "run_program",
]


def run_program(
    program: str,
    *,
    kind: str = "run",
    tests: Any = None,
    entry_point: str | None = None,
    setup: str = "",
    limits: Limits | None = None,
    isolation: str | None = None,
) -> RunResult:
    """Run ``program`` in the sandbox, then its tests.

    kind: "run" (program only, as ``__main__``), "tool" (program only, as ``__main__``, what
        it prints returned as ``RunResult.output``: grpo_core/engines/environments.py), "humaneval"
        (``tests`` defines
        ``check(candidate)``, called with ``entry_point``), "asserts" (``tests`` is a list of
        assert statements, MBPP style), "script" (``tests`` is code with asserts).
    isolation: see the module doc; ``None``: ``$GRPO_SANDBOX_ISOLATION`` or ``"auto"``.
    Only the asserts that exercise the candidate (``credit.analyse``) count.
    """
    counted, candidates = credit.analyse(kind, tests, entry_point, setup)
    payload = {
        "kind": kind,
        "program": program,
        "tests": tests,
        "entry_point": entry_point,
        "setup": setup,
        "candidates": sorted(candidates),
    }
    return run_isolated(detect_isolation(isolation), payload, limits or Limits(), counted)

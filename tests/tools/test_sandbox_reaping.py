"""Every process a sandbox starts is reaped, and dies with its scorer, also under a PID 1
that does not reap (a container's entry point; here ``unshare --pid --fork --mount-proc``
with tests/tools/reaping_driver.py as PID 1): calls leave no zombie (bwrap left one per
call), and a scorer SIGKILLed while its sandbox starts leaves no process running (races made
1 s wide on purpose: a scorer that dies before bwrap runs, a launcher that dies before its
init asked to die with it)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from rewards.sandbox_programs import isolation_or_skip, run_as_pid_1

ROOT = Path(__file__).resolve().parents[2]
DRIVER = str(Path(__file__).with_name("reaping_driver.py"))
ISOLATIONS = ["bwrap", "namespaces"]


def in_own_pid_namespace(tmp: Path, isolation: str, *args: str) -> object:
    """Run the driver as PID 1 of a new pid namespace; its JSON answer. ``tmp``: the scorers'
    temporary folder (a killed one leaves its sandbox folders behind, named by a pid that
    means nothing outside the namespace)."""
    isolation_or_skip(isolation)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp)}
    proc = run_as_pid_1([sys.executable, DRIVER, *args], env, timeout=300)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1])


@pytest.mark.parametrize("path", ["code-fresh", "tool-fresh", "tool-warm"])
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_thirty_calls_leave_no_zombie_under_a_pid_1_that_does_not_reap(isolation, path, tmp_path):
    """30 calls, three of them timed out: no zombie while the scorer runs nor once it has
    exited (its warm servers closed at exit), nothing left running."""
    res = in_own_pid_namespace(tmp_path, isolation, "calls", path, isolation, "30")
    assert res == {"rc": 0, "zombies_during": 0, "zombies_after": 0, "alive_after": []}


FRESH_TRIALS = {  # (window made wide, SIGKILL this many s after the call began)
    "bwrap": [["launcher", 0.3], ["none", 0.0], ["none", 0.05]],
    "namespaces": [["init", 0.3], ["none", 0.0], ["none", 0.05]],
}
WARM_TRIALS = [["launcher", 0.3], ["init", 0.3], ["none", 0.0], ["none", 0.1]]


@pytest.mark.parametrize("path", ["code-fresh", "tool-fresh", "tool-warm"])
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_scorer_killed_while_its_sandbox_starts_leaves_nothing_running(isolation, path, tmp_path):
    """A fresh sandbox outlived its scorer when the scorer died before bwrap set its
    parent-death signal, or the namespaces launcher died before its init set its own; a
    warm server already died with it in both windows (kept here as a guard)."""
    trials = WARM_TRIALS if path == "tool-warm" else FRESH_TRIALS[isolation]
    trials = [t for t in trials if t[0] != ("init" if isolation == "bwrap" else "launcher")]
    trials_json = json.dumps(trials)
    report = in_own_pid_namespace(tmp_path, isolation, "kills", path, isolation, trials_json)
    assert [left for _, _, left in report["trials"]] == [[]] * len(trials), report

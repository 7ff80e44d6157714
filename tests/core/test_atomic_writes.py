"""``grpo_core.contracts.io.atomic_path`` after a kill mid-write (issue 44): the temporaries of a process
that is gone are removed by the next write of the same target, and a previous version moved
aside just before the kill is put back, never lost."""

from __future__ import annotations

import os
import subprocess

from grpo_core.contracts.io import atomic_path


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_temporaries_of_a_killed_writer_are_swept(tmp_path):
    target = tmp_path / "checkpoint"
    dead = _dead_pid()
    leftover = tmp_path / f".checkpoint.tmp-{dead}-abcd1234"
    (leftover / "sub").mkdir(parents=True)
    mine = tmp_path / f".checkpoint.tmp-{os.getpid()}-live0000"  # a writer still running
    mine.mkdir()
    other = tmp_path / ".other.tmp-1-x"
    other.mkdir()
    with atomic_path(target) as tmp:
        tmp.mkdir()
        (tmp / "f").write_text("new")
    assert (target / "f").read_text() == "new"
    assert not leftover.exists()
    assert mine.exists() and other.exists()


def test_a_version_moved_aside_before_a_kill_is_put_back(tmp_path):
    target = tmp_path / "checkpoint"
    aside = tmp_path / f".checkpoint.old-{_dead_pid()}-abcd1234"
    aside.mkdir()
    (aside / "f").write_text("previous")
    try:
        with atomic_path(target):
            raise RuntimeError("this write fails")
    except RuntimeError:
        pass
    assert (target / "f").read_text() == "previous"  # restored, not swept
    assert not aside.exists()

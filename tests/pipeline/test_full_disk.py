"""A disk that fills up mid-run: a checkpoint write and an SQLite (MLflow store) write on a
real full filesystem (a 2 MiB tmpfs) end in one line that says the disk is full, and nothing
half-written is left. Needs root to mount the tmpfs (skipped otherwise)."""

from __future__ import annotations

import errno
import os
import sqlite3
import subprocess

import pytest

from flows.errors import user_message


@pytest.fixture
def full_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_checkpoint_on_a_full_disk_is_one_line_and_not_kept(full_disk, tiny_checkpoint):
    from grpo_core.training.checkpoint import load_checkpoint, save_checkpoint

    model, tok = load_checkpoint(tiny_checkpoint)
    with open(full_disk / "ballast", "wb") as f:  # leave ~64 KiB: less than the weights
        f.write(b"\0" * ((2 << 20) - (64 << 10)))
    out = full_disk / "ckpt"
    with pytest.raises(OSError) as info:
        save_checkpoint(model, tok, out)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(out)
    message = user_message(info.value)
    assert message is not None and "\n" not in message
    assert str(out) in message and "free some space" in message
    assert sorted(p.name for p in full_disk.iterdir()) == ["ballast"]  # nothing half-written


def test_an_sqlite_write_on_a_full_disk_is_one_line(full_disk):
    db = sqlite3.connect(full_disk / "mlflow.db")
    db.execute("create table t (x blob)")
    with pytest.raises(sqlite3.OperationalError) as info:  # "database or disk is full"
        for _ in range(100):
            db.execute("insert into t values (?)", (b"\0" * (256 << 10),))
            db.commit()
    message = user_message(info.value)
    assert message is not None and "\n" not in message and "disk is full" in message

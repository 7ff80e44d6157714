"""A run folder moved or copied elsewhere works on its own files: cache records hold paths
relative to the run folder, and the cheap stamp includes the inode change time (an edit whose
mtime was restored with ``touch -r`` is hashed, not trusted)."""

import os
import shutil

import pytest
from tests_support import TINY_OVERRIDES as TINY

from flows.config import load_config
from tasks import cache
from tasks.workspace import Workspace


def _record(ws: Workspace) -> tuple[str, str]:
    out = ws.scored("rl_1", 0)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(b"scored rows")
    ckpt = ws.checkpoint("rl_1")
    result = {"scored": str(out), "checkpoint": str(ckpt), "data": "/elsewhere/rl.jsonl"}
    cache.record(out, "k1", result)
    return str(out), str(ckpt)


def test_copied_and_moved_run_folder_resolve_to_their_own_files(tmp_path):
    ws = Workspace.create(tmp_path / "x", "demo")
    out, _ = _record(ws)
    assert '"$run_path"' in cache.manifest_path(out).read_text()  # no absolute path inside

    shutil.copytree(tmp_path / "x", tmp_path / "y", copy_function=shutil.copy2)
    Workspace(ws.root).scored("rl_1", 0).write_bytes(b"other rowss")  # the original changes
    copy = Workspace.create(tmp_path / "y", "demo")
    hit = cache.lookup(copy.scored("rl_1", 0), "k1")
    assert hit == {
        "scored": str(copy.scored("rl_1", 0)),
        "checkpoint": str(copy.checkpoint("rl_1")),
        "data": "/elsewhere/rl.jsonl",  # outside the run folder: as recorded
    }
    assert cache.lookup(ws.scored("rl_1", 0), "k1") is None  # the changed original: a miss

    os.rename(tmp_path / "y", tmp_path / "z")
    moved = Workspace.create(tmp_path / "z", "demo")
    assert cache.lookup(moved.scored("rl_1", 0), "k1")["scored"] == str(moved.scored("rl_1", 0))


def test_restored_mtime_does_not_hide_an_edit(tmp_path):
    ws = Workspace.create(tmp_path, "demo")
    out, _ = _record(ws)
    st = os.stat(out)
    with open(out, "r+b") as f:  # same size, other bytes
        f.write(b"S")
    os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))  # touch -r: the mtime as before
    assert os.stat(out).st_mtime_ns == st.st_mtime_ns
    hashed = cache.STATS["hash_checks"]
    assert cache.lookup(out, "k1") is None
    assert cache.STATS["hash_checks"] == hashed + 1


@pytest.mark.slow
def test_pipeline_in_a_copied_then_moved_folder_reuses_its_own_files(
    prefect_harness, tmp_path, tracking_uri
):
    """cp -a of a finished run, the original's scored file changed, the copy rerun: every
    stage reused, from the copy's files; then the copy moved and rerun: the same."""
    from flows.r1 import r1_pipeline

    def run(folder):
        cfg = load_config(
            None, [*TINY, f"output_dir={tmp_path / folder}", f"tracking.uri={tracking_uri}"]
        )
        return r1_pipeline(cfg)

    run("x")
    shutil.copytree(tmp_path / "x", tmp_path / "y", symlinks=True, copy_function=shutil.copy2)
    original = Workspace(tmp_path / "x" / "demo")
    scored = original.scored("rl_1", 1)
    scored.write_bytes(scored.read_bytes()[:-8] + b"\0" * 8)  # the original's file is spoiled

    def outputs(folder):
        root = tmp_path / folder / "demo"
        return {
            str(f.relative_to(root)): f.stat().st_mtime_ns
            for f in root.rglob("*")
            if f.suffix in (".parquet", ".safetensors")
            or f.name == "sft.jsonl"
            and "data" not in f.parts
        }  # (data/*.jsonl: the demo data, written again by every run)

    def check(folder):
        before = outputs(folder)
        summary = run(folder)
        assert summary["workspace"] == str(tmp_path / folder / "demo")
        for stage in summary["stages"]:
            assert stage["checkpoint"].startswith(str(tmp_path / folder)), stage
        assert outputs(folder) == before  # every stage reused: no output written again

    check("y")
    os.rename(tmp_path / "y", tmp_path / "z")
    check("z")

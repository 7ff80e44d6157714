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


def test_checkpoint_info_names_run_files_relative_to_the_checkpoint(tiny_checkpoint, tmp_path):
    """checkpoint_info.json records ``scored`` and a LoRA checkpoint's ``lora_base`` relative
    to the checkpoint when they are in its run folder (issue 44): a moved run folder still
    finds its adapter's base; a path outside the run folder stays absolute."""
    import json
    import shutil

    from grpo_core.config.stages import LoraConfig
    from grpo_core.training.checkpoint import load_checkpoint, save_checkpoint
    from grpo_core.training.lora import attach_adapter, saved_base

    run = tmp_path / "runs" / "demo"
    (run / "rl_1").mkdir(parents=True)
    (run / ".grpo-run").write_text("")
    base = run / "cold_start_sft"
    shutil.copytree(tiny_checkpoint, base)
    model, tok = load_checkpoint(base)
    model = attach_adapter(model, LoraConfig(r=4, alpha=8))
    scored = run / "rl_1" / "iter_0000" / "scored.parquet"
    info = {"scored": str(scored), "lora_base": str(base), "lora_base_policy_id": "b",
            "elsewhere": str(tmp_path / "data.jsonl")}  # fmt: skip
    ckpt = save_checkpoint(model, tok, run / "rl_1" / "checkpoint", info=info)
    recorded = json.loads((ckpt / "checkpoint_info.json").read_text())
    assert recorded["scored"] == "rl_1/iter_0000/scored.parquet"
    assert recorded["lora_base"] == "cold_start_sft"
    assert recorded["paths_relative_to"] == "run folder"
    assert recorded["elsewhere"] == str(tmp_path / "data.jsonl")  # not a recorded path key
    # the stage's final checkpoint is linked under checkpoints/ (tasks/workspace.py): same run
    shutil.copytree(ckpt, run / "checkpoints" / "rl_1")
    moved = tmp_path / "moved"
    shutil.move(str(run), str(moved))
    assert saved_base(moved / "rl_1" / "checkpoint") == (str(moved / "cold_start_sft"), "b")
    assert saved_base(moved / "checkpoints" / "rl_1") == (str(moved / "cold_start_sft"), "b")
    # outside any run folder: absolute, as before
    out = save_checkpoint(model, tok, tmp_path / "loose", info=info)
    assert json.loads((out / "checkpoint_info.json").read_text())["lora_base"] == str(base)

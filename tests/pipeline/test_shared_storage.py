"""Shared run storage (cluster/storage.py): the run folder mirrored to an fsspec URL, so a
machine that lacks a finished stage's outputs downloads and verifies them instead of
recomputing. Stores: ``memory://`` and ``file://`` here, a real S3-compatible server on
localhost (moto's) with ``s3fs`` for the whole pipeline (tests/pipeline/test_shared_s3.py)."""

from __future__ import annotations

import json
import shutil

import pytest

from cluster import storage
from tasks import cache


@pytest.fixture(params=["memory", "file"])
def store_url(request, tmp_path):
    if request.param == "memory":
        from fsspec.implementations.memory import MemoryFileSystem

        yield f"memory://{tmp_path.name}/runs/demo"
        MemoryFileSystem.store.clear()
        MemoryFileSystem.pseudo_dirs[:] = [""]
    else:
        yield f"file://{tmp_path / 'store'}/runs/demo"


@pytest.fixture
def run_dir(tmp_path, store_url):
    local = tmp_path / "node_a" / "runs" / "demo"
    local.mkdir(parents=True)
    storage.configure(store_url, local)
    yield local
    storage.configure(None, local)


def _checkpoint(folder):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "qwen2"}')
    (folder / "model.safetensors").write_bytes(b"w" * 1000)
    (folder / "trainer_state.pt").write_bytes(b"s" * 10)
    return folder


def _store_files(store):
    prefix = store.root + "/"
    return sorted(f[len(prefix) :] for f in store.fs.find(store.root))


def test_publish_then_pull_gives_back_files_and_directories(run_dir):
    store = storage.active()
    data = run_dir / "data" / "rl.jsonl"
    data.parent.mkdir()
    data.write_text('{"prompt": "1+1"}\n')
    ckpt = _checkpoint(run_dir / "checkpoints" / "base")
    storage.publish(data, ckpt)
    assert _store_files(store) == [
        "checkpoints/base/config.json",
        "checkpoints/base/model.safetensors",
        "checkpoints/base/trainer_state.pt",
        "data/rl.jsonl",
    ]
    saved = {p: p.read_bytes() for p in (data, *ckpt.iterdir())}
    shutil.rmtree(run_dir)  # a machine that never had the run folder
    storage.pull(data, ckpt)
    assert {p: p.read_bytes() for p in saved} == saved
    assert not [p for p in run_dir.rglob("*") if ".tmp-" in p.name]


def test_a_republished_directory_drops_the_files_it_no_longer_has(run_dir):
    store = storage.active()
    ckpt = _checkpoint(run_dir / "it" / "checkpoint")
    storage.publish(ckpt)
    (ckpt / "trainer_state.pt").unlink()  # pruned trainer state
    storage.publish(ckpt)
    assert _store_files(store) == ["it/checkpoint/config.json", "it/checkpoint/model.safetensors"]
    storage.remove(run_dir / "it" / "checkpoint" / "config.json")
    assert _store_files(store) == ["it/checkpoint/model.safetensors"]


def test_an_unchanged_path_is_not_uploaded_again(run_dir):
    store = storage.active()
    ckpt = _checkpoint(run_dir / "it" / "checkpoint")
    storage.publish(ckpt)
    remote = store.remote(ckpt / "model.safetensors")
    store.fs.pipe_file(remote, b"changed behind our back")  # shows whether it is rewritten
    storage.publish(ckpt)
    assert store.fs.cat_file(remote) == b"changed behind our back"
    (ckpt / "model.safetensors").write_bytes(b"v" * 1000)  # new bytes, new stamp
    storage.publish(ckpt)
    assert store.fs.cat_file(remote) == b"v" * 1000


def test_paths_outside_the_run_folder_are_not_mirrored(run_dir, tmp_path):
    store = storage.active()
    user_file = tmp_path / "my_data.jsonl"
    user_file.write_text("{}\n")
    storage.publish(user_file)
    assert store.remote(user_file) is None and _store_files(store) == []
    assert storage.active().pull(tmp_path / "missing.jsonl") is False


def test_a_local_copy_is_kept_as_it_is(run_dir):
    f = run_dir / "eval" / "rl_1.parquet"
    f.parent.mkdir()
    f.write_text("store copy")
    storage.publish(f)
    f.write_text("local copy")
    storage.pull(f)
    assert f.read_text() == "local copy"


class Stage:
    """A stage body writing its output file and a checkpoint directory; counts its runs."""

    def __init__(self, run_dir):
        self.output = run_dir / "rl_1" / "iter_0000" / "scored.parquet"
        self.ckpt = run_dir / "rl_1" / "iter_0000" / "checkpoint"
        self.calls = 0

    def __call__(self) -> dict:
        self.calls += 1
        self.output.parent.mkdir(parents=True, exist_ok=True)
        self.output.write_text(f"run {self.calls}")
        if self.ckpt.exists():
            shutil.rmtree(self.ckpt)
        _checkpoint(self.ckpt)
        return {"path": str(self.output), "value": float(self.calls)}

    def run(self, key="k1"):
        return cache.cached("score", self.output, key, self, outputs=[self.ckpt])


def test_a_machine_without_the_outputs_reuses_them_from_the_store(run_dir):
    stage = Stage(run_dir)
    first = stage.run()
    store = storage.active()
    files = _store_files(store)
    assert "rl_1/iter_0000/scored.parquet.stage.json" in files
    assert "rl_1/iter_0000/checkpoint/model.safetensors" in files

    shutil.rmtree(run_dir)  # node B: same store, empty run folder
    again = stage.run()
    assert stage.calls == 1, "a finished stage in the store was recomputed"
    assert again == {**first, "cached": True}
    assert stage.output.read_text() == "run 1"
    assert (stage.ckpt / "model.safetensors").read_bytes() == b"w" * 1000
    # the pulled outputs were hashed and their stamps recorded: the next lookup trusts them
    before = dict(cache.STATS)
    assert stage.run()["cached"] is True
    assert cache.STATS["stamp_hits"] == before["stamp_hits"] + 2


def test_another_key_in_the_store_is_not_reused(run_dir):
    stage = Stage(run_dir)
    stage.run("k1")
    shutil.rmtree(run_dir)
    assert stage.run("k2")["cached"] is False
    assert stage.calls == 2
    manifest = json.loads(storage.active().read_text(cache.manifest_path(stage.output)))
    assert manifest["key"] == "k2"  # the new record replaced the old one in the store


def test_an_output_changed_in_the_store_is_recomputed_not_trusted(run_dir, caplog):
    stage = Stage(run_dir)
    stage.run()
    store = storage.active()
    # a half-finished upload by another machine: the old manifest, different bytes
    store.fs.pipe_file(store.remote(stage.output), b"half a file")
    shutil.rmtree(run_dir)
    with caplog.at_level("WARNING"):
        assert stage.run()["cached"] is False
    assert "scored.parquet changed since it was written" in caplog.text
    assert stage.calls == 2
    assert store.fs.cat_file(store.remote(stage.output)) == b"run 2"


def test_a_local_hit_missing_from_the_store_is_uploaded(run_dir, tmp_path):
    stage = Stage(run_dir)
    storage.configure(None, run_dir)  # finished before the store was configured
    stage.run()
    storage.configure(f"file://{tmp_path / 'later'}/runs/demo", run_dir)
    assert stage.run()["cached"] is True
    files = _store_files(storage.active())
    assert "rl_1/iter_0000/scored.parquet.stage.json" in files
    assert "rl_1/iter_0000/checkpoint/config.json" in files


def test_child_processes_inherit_the_store(run_dir):
    env = storage.env()
    assert set(env) == {storage.STORAGE_ENV}
    spec = json.loads(env[storage.STORAGE_ENV])
    assert spec["local"] == str(run_dir.resolve())
    assert storage.RunStore(**spec).url == storage.active().url


def test_an_unknown_protocol_names_the_setting():
    with pytest.raises(storage.StorageError, match="storage.url nosuch://x"):
        storage.RunStore("nosuch://x", "/tmp")

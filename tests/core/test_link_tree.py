"""``grpo_core.contracts.io.link_tree``: a directory copy whose files are hard links (a stage's final
checkpoint shares its last iteration's files), with a real copy where links cannot be made."""

import os

import pytest

from grpo_core.contracts.io import link_tree


def _tree(root):
    (root / "adapter").mkdir(parents=True)
    (root / "model.safetensors").write_bytes(b"w" * 1000)
    (root / "adapter" / "adapter_config.json").write_text("{}")
    return root


def test_files_are_links_and_the_tree_is_the_same(tmp_path):
    src = _tree(tmp_path / "iter_0003")
    dst = link_tree(src, tmp_path / "final")
    for rel in ("model.safetensors", "adapter/adapter_config.json"):
        assert (dst / rel).read_bytes() == (src / rel).read_bytes()
        assert (dst / rel).stat().st_ino == (src / rel).stat().st_ino
    (src / "model.safetensors").unlink()  # pruning the iteration keeps the final file
    assert (dst / "model.safetensors").read_bytes() == b"w" * 1000


def test_a_copy_where_no_link_can_be_made(tmp_path, monkeypatch):
    def no_links(a, b):
        raise OSError(18, "Invalid cross-device link")

    src = _tree(tmp_path / "a")
    monkeypatch.setattr(os, "link", no_links)
    dst = link_tree(src, tmp_path / "b")
    assert (dst / "model.safetensors").read_bytes() == b"w" * 1000
    assert (dst / "model.safetensors").stat().st_ino != (src / "model.safetensors").stat().st_ino


def test_an_existing_destination_is_refused(tmp_path):
    src = _tree(tmp_path / "a")
    (tmp_path / "b").mkdir()
    with pytest.raises(FileExistsError):
        link_tree(src, tmp_path / "b")

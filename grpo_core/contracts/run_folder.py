"""A run folder's root and the paths recorded relative to it.

``tasks/workspace.py`` marks a run folder's root with :data:`RUN_MARKER`. Records that name
files of the run (the stage cache, ``checkpoint_info.json``) hold those paths relative to
that root, so a moved run folder, or a copy of a checkpoint under ``checkpoints/``, still
finds them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

RUN_MARKER = ".grpo-run"  # in a run folder's root (tasks/workspace.py writes it)
RUN_PATH = "$run_path"  # a recorded path relative to its run folder: {"$run_path": "rel"}
INFO_PATHS = ("scored", "lora_base")  # checkpoint_info.json entries that name files
RELATIVE_TO = "paths_relative_to"  # the entry that says what the relative ones are relative to


def find_run_folder(path: str | Path) -> str | None:
    """The nearest folder at or above ``path`` holding :data:`RUN_MARKER`, or None."""
    here = os.path.abspath(path)
    while True:
        if os.path.exists(os.path.join(here, RUN_MARKER)):
            return here
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def info_paths_relative(info: dict, checkpoint: Path) -> dict:
    """``info`` with each path of :data:`INFO_PATHS` inside the checkpoint's run folder
    recorded relative to that folder (and ``paths_relative_to: run folder``); paths outside
    the run folder stay absolute (:func:`info_path` resolves both)."""
    run = find_run_folder(checkpoint)
    if run is None:
        return info
    out = dict(info)
    for key in INFO_PATHS:
        value = out.get(key)
        if isinstance(value, str) and os.path.isabs(value):
            norm = os.path.normpath(value)
            if norm.startswith(run + os.sep):
                out[key] = os.path.relpath(norm, run)
                out[RELATIVE_TO] = "run folder"
    return out


def info_path(checkpoint: str | Path, value: str) -> str:
    """A path that ``checkpoint_info.json`` records, as a path to use: relative ones are
    relative to the run folder holding ``checkpoint``."""
    if os.path.isabs(value):
        return value
    run = find_run_folder(checkpoint)
    return os.path.normpath(os.path.join(run, value)) if run else value


def run_root(path: str | Path) -> str:
    """The run folder a stage output belongs to: the nearest folder above ``path`` holding
    the marker ``Workspace.create`` writes (``.grpo-run``), else ``path``'s own folder."""
    folder = os.path.dirname(os.path.abspath(path))
    return find_run_folder(folder) or folder


def portable(value: Any, root: str) -> Any:
    """``value`` (a recorded result) with every absolute path inside the run folder ``root``
    as ``{"$run_path": <relative path>}``: a moved or copied run folder resolves them to its
    own files (:func:`localised`). Paths outside it (a user's data file) stay as they are."""
    if isinstance(value, dict):
        return {k: portable(v, root) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [portable(v, root) for v in value]
    if isinstance(value, str) and os.path.isabs(value):
        norm = os.path.normpath(value)
        if norm == root or norm.startswith(root + os.sep):
            return {RUN_PATH: os.path.relpath(norm, root)}
    return value


def localised(value: Any, root: str) -> Any:
    """The inverse of :func:`portable`, against this run folder."""
    if isinstance(value, dict):
        if len(value) == 1 and isinstance(value.get(RUN_PATH), str):
            return os.path.normpath(os.path.join(root, value[RUN_PATH]))
        return {k: localised(v, root) for k, v in value.items()}
    if isinstance(value, list):
        return [localised(v, root) for v in value]
    return value

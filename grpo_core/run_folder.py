"""A run folder's root and the paths recorded relative to it.

``tasks/workspace.py`` marks a run folder's root with :data:`RUN_MARKER`. Records that name
files of the run (the stage cache, ``checkpoint_info.json``) hold those paths relative to
that root, so a moved run folder, or a copy of a checkpoint under ``checkpoints/``, still
finds them.
"""

from __future__ import annotations

import os
from pathlib import Path

RUN_MARKER = ".grpo-run"  # in a run folder's root (tasks/workspace.py writes it)
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

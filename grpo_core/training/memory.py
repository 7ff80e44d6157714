"""Peak memory of a stage, in GiB: ``torch.cuda.max_memory_allocated`` on a GPU (reset when the
stage starts); on a CPU the process's resident-set high-water mark, reset at the start where
Linux allows it (``/proc/self/clear_refs``) and read from ``/proc/self/status`` (``VmHWM``),
else ``resource.getrusage().ru_maxrss`` (the process's peak since it started)."""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch


def _reset_rss_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _rss_peak_gib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB (bytes on macOS)
    return peak / (2**30 if sys.platform == "darwin" else 2**20)


class PeakMemory:
    """``with PeakMemory(device) as mem: ...``; then ``mem.gib``."""

    def __init__(self, device=None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.gib = 0.0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_rss_peak()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.gib = torch.cuda.max_memory_allocated(self.device) / 2**30
        else:
            self.gib = _rss_peak_gib()

"""Checkpoints written off the critical path: the trainer goes on while a thread writes.

:meth:`CheckpointWriter.submit` takes a CPU copy of the weights and of the trainer state at
once (the next optimizer step changes both in place), then a single background thread writes
them through ``save_checkpoint``: into a temporary folder, hashed, renamed into place. A
process killed mid-write leaves a hidden temporary and the previous kept state, never a
half-written checkpoint under the real name. :meth:`drain` waits for every queued write and
raises the first failure; callers drain before they read a checkpoint that may be queued and
at the end of a stage. The copies are what this costs: one CPU copy of the weights and
optimizer state per kept checkpoint, held until it is written. The thread runs at a lower
priority than the trainer (``WRITER_NICE``): on a GPU machine it uses CPU cores that would
idle, on a CPU-only one the cycles training leaves.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)
WRITER_NICE = 10  # the writer thread's niceness (Linux: per thread)


def cpu_copy(obj):
    """``obj`` (a tensor, or dicts / lists / tuples of them) with every tensor copied to the
    CPU: a snapshot that later in-place updates do not change."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(cpu_copy(v) for v in obj)
    return obj


class CheckpointWriter:
    """One background thread that writes the checkpoints submitted to it, in order."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._errors: list[BaseException] = []
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.pending: set[Path] = set()

    def submit(
        self,
        out_dir: str | Path,
        model,
        tokenizer,
        *,
        weights: dict,
        trainer_state: dict | None,
        info: dict | None,
        expected_id: str,
        on_done: Callable[[Path], None] | None = None,
    ) -> None:
        """Queue ``save_checkpoint(model, tokenizer, out_dir, ...)`` of CPU copies of
        ``weights`` and ``trainer_state`` (taken now); ``on_done(out_dir)`` runs in the
        writer thread once the checkpoint is in place (publishing it to a shared store)."""
        job = (
            Path(out_dir),
            model,
            tokenizer,
            cpu_copy(weights),
            cpu_copy(trainer_state),
            info,
            expected_id,
            on_done,
        )
        with self._lock:
            self.pending.add(Path(out_dir))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="checkpoint-writer", daemon=True
                )
                self._thread.start()
        self._queue.put(job)

    def _run(self) -> None:
        from grpo_core.training.checkpoint import save_checkpoint

        # below the trainer's threads: on a machine whose cores all train (a CPU run), the
        # writes take the cycles training leaves, instead of slowing the next step
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        while True:
            job = self._queue.get()
            out, model, tokenizer, weights, state, info, expected, on_done = job
            try:
                save_checkpoint(
                    model,
                    tokenizer,
                    out,
                    trainer_state=state,
                    info=info,
                    state_dict=weights,
                    expected_id=expected,
                )
                if on_done is not None:
                    on_done(out)
            except BaseException as e:  # reported by drain(), in the caller's thread
                log.error("%s: background checkpoint write failed: %s", out, e)
                self._errors.append(e)
            finally:
                with self._lock:
                    self.pending.discard(out)
                self._queue.task_done()

    def drain(self) -> None:
        """Wait for every queued write; raise the first that failed (once)."""
        self._queue.join()
        if self._errors:
            first, self._errors = self._errors[0], []
            raise RuntimeError(f"a background checkpoint write failed: {first}") from first

    def is_pending(self, out_dir: str | Path) -> bool:
        with self._lock:
            return Path(out_dir) in self.pending

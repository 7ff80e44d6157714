"""The rollout engine in a process of its own, for ``rl.async_level`` > 0 on one machine.

With ``cluster.backend: local`` an RL stage that overlaps generation with the update
(flows/rl_schedule.py) samples here: a child process (``spawn``) that holds the engine and a
model of the stage's architecture, with ``cluster.rollout.num_cpus`` torch threads, while the
trainer keeps the rest of the cores. The schedule names which policy samples each
iteration; when it does, the trainer's weights of that moment are frozen into a
:class:`Snapshot` (a copy of the state dict in shared memory, taken between two updates), and
the child loads it before its first request for that policy. Requests are answered in
order, one at a time; each says when the child started and finished generating
(``time.monotonic``, the same clock in both processes), from which the stage reports the
engine's idle time.

The child ends when the parent closes it (at the latest when the parent exits), and on its
own when the parent's end of the pipe closes or the parent is gone (a watcher thread: a
SIGKILLed ``grpo`` does not leave it sampling). A request that fails comes
back as :class:`EngineProcessError` with the child's traceback; the child stays up for the
next one.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from cluster.engines_here import engine_for, sample_here

log = logging.getLogger(__name__)


class EngineProcessError(RuntimeError):
    """A request the engine process could not answer (its traceback is the message)."""


@dataclass
class Snapshot:
    """A policy's weights as the schedule named them, for the engine process.

    ``checkpoint``: a folder with the policy's architecture and tokenizer (the stage's
    initial checkpoint), where the child builds its model; ``state``: the weights, copied in
    shared memory (:func:`pack`). It stands in for the policy in ``Local.sample``
    (``model`` None: the weights are not sampled here)."""

    checkpoint: Path
    policy_id: str
    tokenizer: Any
    config: Any
    state: dict
    dtype: str | None = None  # the sampling model's, set by the child's first answer
    model: None = None


def snapshot(policy, source: str | Path, policy_id: str | None = None) -> Snapshot:
    """``policy``'s weights (a handle on them: tasks/policies/trainer.py) copied now into shared memory, named
    ``policy_id`` (default: the policy's); its tokenizer copied too (the trainer thread
    keeps using the original)."""
    state = pack(dict(_state(policy)))
    return Snapshot(
        checkpoint=Path(source),
        policy_id=policy_id or policy.policy_id,
        tokenizer=copy.deepcopy(policy.tokenizer),
        config=policy.model.config,
        state=state,
    )


def _state(policy):
    from grpo_core.training import lora

    model = policy.model
    if lora.is_peft(model):
        return lora.merged_state_dict(model).items()
    return model.state_dict().items()


def pack(state: dict) -> dict:
    """``state`` in one shared-memory buffer per dtype (a state dict of hundreds of tensors
    would otherwise pass one file descriptor each): ``{"buffers": {dtype: flat tensor},
    "entries": [(name, dtype, offset, shape)]}``."""
    import torch

    sizes: dict = {}
    for v in state.values():
        sizes[v.dtype] = sizes.get(v.dtype, 0) + v.numel()
    buffers = {dt: torch.empty(n, dtype=dt).share_memory_() for dt, n in sizes.items()}
    offsets, entries = dict.fromkeys(sizes, 0), []
    with torch.no_grad():
        for name, v in state.items():
            at, n = offsets[v.dtype], v.numel()
            buffers[v.dtype][at : at + n].copy_(v.detach().reshape(-1))
            entries.append((name, v.dtype, at, tuple(v.shape)))
            offsets[v.dtype] = at + n
    return {"buffers": buffers, "entries": entries}


def unpack(packed: dict) -> dict:
    """The state dict :func:`pack` packed, as views of its buffers."""
    out = {}
    for name, dtype, at, shape in packed["entries"]:
        n = 1
        for d in shape:
            n *= d
        out[name] = packed["buffers"][dtype][at : at + n].view(shape)
    return out


class EngineProcess:
    """The parent's handle on the child: :meth:`sample` sends one request and waits."""

    def __init__(self, threads: int, model_section: dict) -> None:
        self.threads = max(1, int(threads))
        self.model_section = model_section
        self._lock = threading.Lock()
        self._proc = self._conn = None
        self._holds: str | None = None  # policy_id of the weights the child has
        self.served = threading.local()  # .span: (start, end) of this thread's last request
        import atexit
        import multiprocessing.util  # noqa: F401  its exit hook is registered before ours

        atexit.register(self.close)  # before multiprocessing joins its non-daemon children

    def _start(self) -> None:
        import torch.multiprocessing as mp  # its pickler sends tensors as shared memory

        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        # not a daemon: vLLM may start workers of its own there (its multiprocessing
        # engine, tensor parallelism), which a daemonic process may not; closed at exit
        # (__init__) before multiprocessing joins its children (atexit runs LIFO).
        self._proc = ctx.Process(
            target=serve,
            args=(child, self.threads, self.model_section, os.getpid()),
            name="grpo-engine",
        )
        self._proc.start()
        child.close()
        self._conn, self._holds = parent, None
        log.info("started the engine process (pid %d, %d threads)", self._proc.pid, self.threads)

    def sample(self, snap: Snapshot, prompt_ids, request) -> list:
        """``request`` (a ``grpo_core.engines.turns.SampleRequest``) on ``snap``'s weights."""
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self._start()
            message = {
                "source": str(snap.checkpoint),
                "policy_id": snap.policy_id,
                "state": None if self._holds == snap.policy_id else snap.state,
                "prompt_ids": prompt_ids,
                "request": request,
            }
            try:
                self._conn.send(message)
                reply = self._conn.recv()
            except (EOFError, OSError) as e:  # the child died mid-request
                self._close_locked()
                raise EngineProcessError(
                    f"the engine process died during {request.desc}: {e}"
                ) from e
            if reply["error"]:
                self._holds = None  # a failure may leave the weights half loaded
                raise EngineProcessError(f"{request.desc} in the engine process:\n{reply['error']}")
            self._holds = snap.policy_id
            snap.dtype = reply["dtype"]
            self.served.span = (reply["start"], reply["end"])
            return reply["samples"]

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if self._proc is None:
            return
        with contextlib.suppress(OSError, ValueError):
            self._conn.send(None)
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()
        self._proc = self._conn = self._holds = None


def serve(conn, threads: int, model_section: dict, parent: int | None = None) -> None:
    """The child: answer sampling requests until told to stop or the parent (pid ``parent``)
    is gone."""
    import torch

    from cluster.state import load_policies_with
    from grpo_core.config.model import ModelConfig
    from grpo_core.engines import WarmEngines

    # a terminal's Ctrl-C reaches the whole process group: the parent stops the run and says
    # so in one line; this process ends with it (EOF, or the parent watch), without a
    # KeyboardInterrupt traceback of its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent or os.getppid())
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    load_policies_with(ModelConfig(**model_section))
    engines, held = WarmEngines(), {}
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            break
        if request is None:
            break
        try:
            reply = _answer(engines, held, request)
        except Exception:
            reply = {"error": traceback.format_exc()}
        try:
            conn.send(reply)
        except OSError:  # the parent died while this request ran: nobody to answer
            break
    engines.close()


def _die_with_parent(parent: int, every: float = 1.0) -> None:
    """End this process soon after the parent is gone, even in the middle of a request (the
    pipe's end of file is only seen between requests): a watcher thread checks that the
    parent is still the one that started it. Not ``PR_SET_PDEATHSIG``: that fires when the
    parent *thread* that started the child ends, and the stage's threads come and go.
    ``parent``: the pid the parent gave (it may have died while this process was starting)."""

    def watch() -> None:
        while True:
            time.sleep(every)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch, name="grpo-engine-parent-watch", daemon=True).start()


def _answer(engines, held: dict, req: dict) -> dict:
    """One request: the model of ``source`` (built once), the snapshot's weights when they
    came with it, then the engine's samples."""
    from grpo_core.training.checkpoint import dtype_name, load_checkpoint

    source, request = req["source"], req["request"]
    fresh = source not in held
    if fresh:
        held.clear()  # one architecture at a time
        held[source] = load_checkpoint(source, **request.load_options)
    model, tokenizer = held[source]
    if fresh and request.engine != "hf":
        # a kept engine starts from the checkpoint's weights, not the snapshot's: started
        # here under an id of its own, it is synced to the snapshot's below
        saved = SimpleNamespace(checkpoint=Path(source), policy_id=f"{source} (as saved)",
                                model=model, tokenizer=tokenizer)  # fmt: skip
        engine_for(engines, saved, request.engine, request.engine_options, check_sync=False)
    if req["state"] is not None:
        model.load_state_dict(unpack(req["state"]), strict=True)
    model.eval()
    policy = SimpleNamespace(
        checkpoint=Path(source), policy_id=req["policy_id"], model=model, tokenizer=tokenizer
    )
    start = time.monotonic()
    samples = sample_here(engines, policy, req["prompt_ids"], request)
    end = time.monotonic()
    return {"error": None, "samples": samples, "start": start, "end": end,
            "dtype": dtype_name(model)}  # fmt: skip

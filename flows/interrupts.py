"""Ctrl-C and SIGTERM for ``grpo``: stop the current step, record the run as interrupted,
print one line, exit 130 (SIGINT) or 143 (SIGTERM).

How it works with Prefect (3.x): inside a flow run, Prefect's engine installs its own SIGTERM
handler (``prefect.utilities.engine.capture_sigterm``), which raises ``TerminationSignal`` in
the main thread; Ctrl-C raises ``KeyboardInterrupt`` there. Either way the engine sets the
flow run (and the running task and subflow runs) to Crashed, runs the flow's ``on_crashed``
hooks (flows/r1.py ends the open MLflow runs KILLED) and re-raises. For SIGTERM it then puts
back the handler it found and sends the signal again, so that handler runs too: with
Python's default one the process would die there, before its exit hooks (the temporary
Prefect server would be left behind). :func:`install` puts ours there first; it lets
Prefect's exception go on, and outside a flow it raises :class:`Interrupted`. The CLI catches
all three at the top (:func:`finish`); the files written so far are whole (every output is
written atomically), so rerunning the same command resumes from them.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import types
from pathlib import Path


class Interrupted(BaseException):
    """SIGTERM received outside a flow run (a BaseException, like KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _termination_signal() -> type | None:
    exceptions = sys.modules.get("prefect.exceptions")
    return getattr(exceptions, "TerminationSignal", None)


def _on_sigterm(signum: int, frame) -> None:
    termination = _termination_signal()
    if termination is not None and isinstance(sys.exception(), termination):
        return  # Prefect handing the signal back while its TerminationSignal unwinds the flow
    raise Interrupted(signum)


def install() -> None:
    """SIGTERM raises :class:`Interrupted` (Ctrl-C keeps raising ``KeyboardInterrupt``), and
    a stop that Python swallowed is sent again (:func:`_on_unraisable`). Call from the main
    thread before the flow starts."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    if sys.unraisablehook is not _on_unraisable:
        global _previous_unraisable
        _previous_unraisable = sys.unraisablehook
        sys.unraisablehook = _on_unraisable


_previous_unraisable = sys.unraisablehook
RESEND_DELAY_S = 0.05


def _on_unraisable(unraisable) -> None:
    """A signal's exception (``KeyboardInterrupt``, :class:`Interrupted`, Prefect's
    ``TerminationSignal``) raised while Python ran a ``__del__``, a weakref callback or a GC
    pass is printed as "Exception ignored" and dropped: the run would go on as if never
    stopped (seen under load: a SIGTERM landing in asyncio's ``_SelectorTransport.__del__``).
    Send the same signal again, from a thread a moment later, so the handler raises it in
    ordinary code; again if that one is swallowed too. Other exceptions go to the previous
    hook."""
    exc = unraisable.exc_value
    signum = signal_of(exc) if isinstance(exc, BaseException) else None
    if signum is None:
        _previous_unraisable(unraisable)
        return
    logging.getLogger(__name__).warning(
        "%s arrived where Python ignores exceptions (%s): sending it again",
        signal.Signals(signum).name,
        getattr(unraisable.object, "__qualname__", None) or type(unraisable.object).__name__,
    )
    timer = threading.Timer(RESEND_DELAY_S, os.kill, (os.getpid(), signum))
    timer.daemon = True
    timer.start()


def signal_of(exc: BaseException) -> int | None:
    """The signal that ``exc`` stands for, or None when it is an ordinary error."""
    if isinstance(exc, KeyboardInterrupt):
        return signal.SIGINT
    if isinstance(exc, Interrupted):
        return exc.signum
    termination = _termination_signal()
    if termination is not None and isinstance(exc, termination):
        return exc.signal
    return None


def _frames(exc: BaseException | None) -> list[types.FrameType]:
    """The frames ``exc`` went through (outermost first), then those of the exception it
    was raised while handling (Prefect's TerminationSignal, for an Interrupted)."""
    out, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            out.append(tb.tb_frame)
            tb = tb.tb_next
        exc = exc.__context__
    return out


_PROJECT = str(Path(__file__).resolve().parents[1])


def where(exc: BaseException) -> str:
    """The step the pipeline was in when ``exc`` stopped it, from the frames of the stage
    code it passed through: ``rl_1 iteration 3``, ``cold_start_sft``, ``final_evaluation``
    (the stage's name alone while Prefect starts its flow); ``start-up`` before the first
    stage."""
    found = "start-up"
    for frame in _frames(exc):
        if not frame.f_code.co_filename.startswith(_PROJECT):
            continue
        name, local = frame.f_code.co_name, frame.f_locals
        if name == "timed" and frame.f_code.co_filename.endswith("r1.py"):
            # the recipe's step, named before its flow's own code runs (a signal that lands
            # while Prefect starts the subflow still names the stage), refined by inner frames
            found = local["name"] if isinstance(local.get("name"), str) else found
        elif name == "_finish" and frame.f_code.co_filename.endswith("r1.py"):
            found = "model registration"
        elif name == "final_evaluation":
            found = "final_evaluation"
        elif name == "rl_stage" and isinstance(local.get("stage"), str):
            it = local.get("it")
            found = local["stage"] + (f" iteration {it}" if isinstance(it, int) else "")
        elif name == "sft_stage" and isinstance(local.get("stage"), str):
            found = local["stage"]
        elif name in ("prepare", "rejection_sampling") and "tasks" in frame.f_code.co_filename:
            found = name
    return found


def finish(exc: BaseException, *, stop_server=None, step: str | None = None) -> int | None:
    """At the top of a command that ``exc`` ended: end the MLflow runs this process left
    open (KILLED for a signal, FAILED for an error). For a signal, print one line and return
    the exit code (128 + signal); for an error return None (the caller re-raises).

    From here on a second Ctrl-C or SIGTERM exits at once (``stop_server`` first)."""
    signum = signal_of(exc)
    if signum is not None:

        def hard_exit(num: int, frame) -> None:
            if stop_server is not None:
                stop_server()
            os._exit(128 + num)

        signal.signal(signal.SIGINT, hard_exit)
        signal.signal(signal.SIGTERM, hard_exit)
    run_states = sys.modules.get("tasks.tracking.run_states")
    if run_states is not None:
        run_states.end_open_runs("FAILED" if signum is None else "KILLED")
    if signum is None:
        return None
    name = signal.Signals(signum).name
    # the line below is the last word: Prefect's background services log while the
    # interpreter exits, and not all under "prefect" (its events worker logs to the logger
    # "EventsWorker": "Still processing items"), so all logging stops here
    logging.disable(logging.CRITICAL)
    print(
        f"grpo: interrupted ({name}) during {step or where(exc)}; rerun the same command to resume",
        file=sys.stderr,
        flush=True,
    )
    return 128 + signum

"""The candidate process: runs INSIDE the sandbox as ``python -s -P -B -c <_seccomp.py + _wire.py +
this file's text> <request fd> <reply fd>``, started by the harness (``_harness.py``). Stdlib
only.

This is the only process that runs the model's program. It holds nothing that decides a
verdict: no nonce, no verdict pipe, no test. Before it reads the program it locks itself
(``_seccomp.py``: no new process, no namespace, no tracing, dies with the harness). Then:

0. once locked, it says ``{"ready": true}`` (or why the lock failed), before any program code;
1. the first request is ``{"program", "main", "names"}``: the program runs. For ``code_runs``
   (as ``__main__``) there is no reply: the process exits 0 when the program ran without
   raising, else 1, and the harness reads that exit status from outside (the program holds the
   reply pipe and could forge a reply on it). Otherwise the reply says whether it raised and
   what each name of ``names``
   (the names the tests take from the program) is: ``"callable"``, a plain value, or why not.
   With ``"capture": N`` (a tool call, grpo_core/engines/environments.py) the program runs as
   ``__main__`` with its stdout and stderr kept in memory (the first N characters), the
   reply carries them as ``"output"``, and the process ends, 0 when the program ran without
   raising, else 1 (the harness reads whether the call failed from that status, not from the
   reply): an observation, not a verdict;
2. each further request ``{"name", "args", "kwargs"}`` calls that name with the decoded
   arguments; the reply carries the result as a plain value (``_wire.py``: an object of the
   program's, a numpy object array, a generator are refused), or the exception's type name
   and message, and the list/dict/set arguments as the call left them (a test may check an
   in-place change).

Whatever the program does to this process (patch this code, forge replies, exit), the harness
only ever receives plain data on its pipe, and decides every assert itself.
"""

import builtins as _builtins
import hashlib as _hashlib
import random as _random
import sys as _sys


def _message(exc):
    try:
        text = str(exc)
        return (type(exc).__name__ + (": " + text if text else ""))[:300]
    except BaseException:
        return "?"


def _describe(ns, names):
    out = {}
    for name in names:
        if name not in ns:
            out[name] = {"missing": True}
        elif callable(ns[name]):
            out[name] = {"callable": True}
        else:
            try:
                out[name] = {"value": wire_encode(ns[name])}  # noqa: F821 (_wire.py)
            except BaseException as exc:
                out[name] = {"refused": _message(exc)}
    return out


def _mutable_args(args):
    out = {}
    for i, a in enumerate(args):
        if type(a) in (list, dict, set):
            try:
                out[str(i)] = wire_encode(a)  # noqa: F821
            except BaseException:  # noqa: SIM105 (no contextlib import in the sandbox)
                continue
    return out


class _Capture:
    """A stdout/stderr that keeps the first ``limit`` characters written to it."""

    def __init__(self, limit):
        self.parts, self.left, self.dropped = [], limit, 0

    def write(self, text):
        text = str(text)
        self.parts.append(text[: max(0, self.left)])
        self.dropped += max(0, len(text) - max(0, self.left))
        self.left -= len(text)
        return len(text)

    def flush(self):
        pass

    def value(self):
        out = "".join(self.parts)
        return out + (f"\n... ({self.dropped} more characters)" if self.dropped else "")


def _seed_call(program):
    """A tool call's random numbers are a function of the call: ``random`` (and numpy's global
    generator, when the program names numpy) seeded from the program's text, as the hash seed
    is fixed, so a seeded rerun that samples the same call gets the same output."""
    digest = _hashlib.sha256(program.encode("utf-8", "backslashreplace")).digest()
    seed = int.from_bytes(digest[:8], "big")
    _random.seed(seed)
    if "numpy" in program:
        try:
            import numpy

            numpy.random.seed(seed % (1 << 32))
        except BaseException:  # not installed or not importable here: nothing to seed
            pass


def _exec_program(first, named_main, capture):
    """Run ``first["program"]`` (then dropped from ``first``) in a fresh namespace, as
    ``__main__`` when ``named_main``, with stdout and stderr going to ``capture`` when given:
    ``(ok, error, namespace)``. The warm tool sandbox's call process runs programs through
    this same function (``_forkserver.py``)."""
    ns = {"__name__": "__main__" if named_main else "__candidate__", "__builtins__": _builtins}
    if capture is not None:
        _sys.stdout = _sys.stderr = capture
        _seed_call(first["program"])
    ok, error = True, ""
    try:
        code = compile(first["program"], "<program>", "exec")
        del first["program"]
        exec(code, ns)
    except SystemExit as exc:
        ok = exc.code is None or (type(exc.code) is int and exc.code == 0)
        error = "" if ok else _message(exc)
    except BaseException as exc:
        ok, error = False, _message(exc)
    return ok, error, ns


def _serve():
    req, rep = int(_sys.argv[1]), int(_sys.argv[2])
    send = wire_send  # noqa: F821
    try:
        set_pdeathsig_kill()  # noqa: F821 (_seccomp.py)
        seccomp_lock(processes=False)  # noqa: F821
    except OSError as exc:
        send(rep, {"setup": f"sandbox setup failed: seccomp: {exc}"})
        return
    send(rep, {"ready": True})  # before any program code: the harness can trust this one
    reader = WireReader(req)  # noqa: F821
    first = reader.read()
    if not isinstance(first, dict):
        return
    main = first.get("main") is True
    exit_now = os._exit  # noqa: F821 (_seccomp.py's os) taken before the program can patch it
    capture = first.get("capture")
    capture = _Capture(int(capture)) if type(capture) is int else None
    ok, error, ns = _exec_program(first, main or capture is not None, capture)
    if capture is not None:  # a tool call: what it printed; whether it raised is the exit
        send(rep, {"ok": ok, "error": error, "output": capture.value()})  # status (a reply
        exit_now(0 if ok else 1)  # the program forged on the pipe cannot change it)
    if main:  # code_runs: the verdict is this process's exit status, which the harness reads
        if error:  # from outside (a reply the program forged on the pipe counts for nothing)
            _sys.stderr.write("grpo-candidate: " + error + "\n")
            _sys.stderr.flush()
        exit_now(0 if ok else 1)
    send(rep, {"ok": ok, "error": error, "names": _describe(ns, first.get("names") or [])})
    while (request := reader.read()) is not None:
        try:
            name = request["name"]
            if name not in ns:
                raise NameError(f"name {name!r} is not defined")
            fn = ns[name]
            args = wire_decode(request["args"])  # noqa: F821
            kwargs = wire_decode(request["kwargs"])  # noqa: F821
            value = fn(*args, **kwargs)
            reply = {"ok": True, "value": wire_encode(value), "args": _mutable_args(args)}  # noqa: F821
        except BaseException as exc:
            reply = {"ok": False, "type": type(exc).__name__, "error": _message(exc)}
        try:
            send(rep, reply)
        except (TypeError, ValueError) as exc:  # e.g. a float key JSON cannot hold
            send(rep, {"ok": False, "type": "TypeError", "error": _message(exc)})


if not globals().get("_GRPO_NO_SERVE"):  # the warm tool sandbox takes the functions only
    _serve()

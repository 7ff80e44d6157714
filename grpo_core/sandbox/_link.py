"""The harness's side of the candidate process (``_harness.py``): runs INSIDE the sandbox, its
text placed after ``_seccomp.py`` and ``_wire.py`` and before ``_harness.py`` in the harness's
``python -I -B -c`` text (grpo_core/sandbox/launcher.py). Stdlib only.

:class:`_Link` starts the candidate process (``_candidate.py``, a fresh interpreter) and
talks to it over two pipes in ``_wire.py``'s encoding; :class:`Remote` is a name of the
program the tests call, sent to the candidate by value, its answer (or its exception, as a
builtin type or :class:`CandidateError`) decoded here; :class:`Refused` stands for a name
whose value cannot cross.
"""

import builtins
import os
import subprocess
import sys


class CandidateError(Exception):
    """An exception the candidate raised that is not a builtin ``Exception`` type here."""


class CandidateGone(Exception):
    """The candidate process ended: no call can be answered."""


class _Link:
    def __init__(self, code):
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        self.proc = subprocess.Popen(
            # -s -P: -I without -E, so that PYTHONHASHSEED (the launcher's clean environment
            # sets it, and nothing else of Python's) fixes str/bytes hashing: set order and
            # hash() are the same in a run and its resume
            [sys.executable, "-s", "-P", "-B", "-c", code, str(req_r), str(rep_w)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            pass_fds=(req_r, rep_w),
        )
        os.close(req_r)
        os.close(rep_w)
        self.req, self.reader, self.gone = req_w, WireReader(rep_r), None  # noqa: F821
        self.on_gone = None

    def ready(self):
        """The candidate's first word, sent once locked and before any program code runs:
        ``{"ready": True}`` or ``{"setup": why}``; None when it died first."""
        try:
            return self.reader.read()
        except OSError:
            return None

    def run_main(self, message):
        """``code_runs``: send the program and wait for the candidate's exit status (its
        verdict; nothing it writes on the reply pipe is read)."""
        try:  # noqa: SIM105 (stdlib only here, as the rest of the sandbox's code)
            wire_send(self.req, message)  # noqa: F821 (_wire.py)
        except OSError:
            pass
        return self.proc.wait()

    def ask(self, message):
        if self.gone is not None:
            raise CandidateGone(self.gone)
        try:
            wire_send(self.req, message)  # noqa: F821 (_wire.py)
            reply = self.reader.read()
        except OSError:
            reply = None
        if reply is None:
            rc = self.proc.wait()
            self.gone = f"the candidate process ended (exit status {rc})"
            if self.on_gone:
                self.on_gone(rc)
            raise CandidateGone(self.gone)
        return reply

    def close(self):
        try:
            os.close(self.req)
            self.proc.kill()
            self.proc.wait()
        except OSError:
            pass


# raised from a candidate call these would end an iteration of the tests' own code (``map``,
# a generator, ``next`` with a default): they arrive as a plain failure instead (as PEP 479
# turns a StopIteration inside a generator into a RuntimeError)
_ENDS_ITERATION = ("StopIteration", "StopAsyncIteration", "GeneratorExit")


def _exception(reply):
    name, text = str(reply.get("type")), str(reply.get("error"))
    if name in _ENDS_ITERATION:
        return CandidateError(f"the program raised {text}")
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(text.split(": ", 1)[1] if ": " in text else "")
        except Exception:
            pass
    return CandidateError(text)


def _apply_mutations(args, changed):
    for i, enc in changed.items():
        orig, new = args[int(i)], wire_decode(enc)  # noqa: F821
        if type(orig) is not type(new):
            continue
        if type(orig) is list:
            orig[:] = new
        else:
            orig.clear()
            orig.update(new)


class Remote:
    """A function of the program, called in the candidate process by value."""

    def __init__(self, link, name):
        self._link, self._name = link, name

    def __call__(self, *args, **kwargs):
        message = {
            "name": self._name,
            "args": wire_encode(list(args)),  # noqa: F821
            "kwargs": {"dict": {k: wire_encode(v) for k, v in kwargs.items()}},  # noqa: F821
        }
        reply = self._link.ask(message)
        if reply.get("ok") is not True:
            raise _exception(reply)
        value = wire_decode(reply.get("value"))  # noqa: F821
        # arguments cross by value; the call's changes to them come back only when it returns
        # None, Python's sign of an in-place function (list.sort, random.shuffle): a function
        # that empties its argument and returns [] cannot make the test compare [] with []
        if value is None and type(reply.get("args")) is dict:
            _apply_mutations(args, reply["args"])
        return value

    def __repr__(self):
        return f"<the program's {self._name}>"


class Refused:
    """A name of the program whose value cannot cross (an object, a class instance...)."""

    def __init__(self, name, why):
        self._why = f"the program's {name!r} is not a plain value: {why}"

    def _refuse(self, *args, **kwargs):
        raise TypeError(self._why)

    __call__ = __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __bool__ = _refuse
    __len__ = __iter__ = __contains__ = __getitem__ = __hash__ = _refuse

    def __getattr__(self, name):
        self._refuse()

    def __repr__(self):
        return f"<{self._why}>"

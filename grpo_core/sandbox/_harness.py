"""The trusted harness: runs INSIDE the sandbox as ``python -I -B -c <_seccomp.py + _wire.py +
this file's text> <verdict_fd>``. Stdlib only.

It reads a JSON payload from stdin (program, tests, nonce, the candidate process's code),
closes stdin (and exits if the scorer is already gone: ``_scorer_gone``), and starts the
**candidate process** (``_candidate.py``, a fresh interpreter: nothing of this process's
memory, no nonce and no verdict pipe reach it). The model's program runs only there. The
tests run here, in this process, against proxies: every name the tests take from the program
(``credit.analyse``) is a :class:`Remote` whose call sends the arguments to the candidate
process and returns its answer decoded as plain builtin values (``_wire.py``), or a plain
value the program defined. Every assert is decided here on those
values, and only this process writes to the verdict pipe, one JSON line per event:
``[nonce, kind, id, ok, message]``. Records of a forked child are dropped (pid check);
records without the nonce are ignored by the scorer.

The harness is not dumpable (the candidate process, same uid in some modes, cannot trace it
or open its /proc files) and locks itself with seccomp once the candidate runs (no new
process or namespace). When the candidate process dies (``os._exit``, a signal, a limit),
every later call fails, and its exit status is reported (``"candidate"`` record) so the
scorer can say why.
"""

import ast
import builtins
import json
import os
import select
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


def _read_payload():
    """The JSON payload from stdin; stdin is then closed (fd 0 reopened on /dev/null)."""
    raw = sys.stdin.buffer.read()
    os.close(0)
    os.open(os.devnull, os.O_RDONLY)
    payload = json.loads(raw)
    del raw
    return payload


def _emitter(fd, nonce, pid):
    """The one writer of the verdict pipe: ``emit(kind, id, ok, message)`` writes a record
    with the nonce; in a forked child (another pid) it writes nothing."""

    def emit(kind, ident, ok, message="", limit=300):
        if os.getpid() != pid:
            return
        line = json.dumps(
            [nonce, kind, ident, ok is True, str(message)[:limit]], separators=(",", ":")
        )
        try:
            os.write(fd, (line + "\n").encode("utf-8", "replace"))
        except OSError:
            return

    return emit


def _exc_message(exc):
    text = str(exc)
    return (type(exc).__name__ + (": " + text if text else ""))[:300]


def _checker(emit):
    """``_grpo_check(id, thunk)``: one assert, passed only when the thunk returns a true
    value without raising."""

    def check(ident, thunk):
        try:
            ok = bool(thunk()) is True
        except Exception as exc:
            emit("assert", ident, False, _exc_message(exc))
            return
        emit("assert", ident, ok, "" if ok else "assertion failed")

    return check


def _is_nan(v):
    return type(v) is float and v != v


def _ne(a, b):
    if (a is None) != (b is None):
        return False  # a stub's None is not "anything but 3"
    if _is_nan(a) or _is_nan(b):
        return False  # nor is a NaN: it compares unequal to everything, itself included
    return a != b


_ORDER = {"Lt": lambda a, b: a < b, "LtE": lambda a, b: a <= b,
          "Gt": lambda a, b: a > b, "GtE": lambda a, b: a >= b}  # fmt: skip


def _order(op, a, b):
    """``a <op> b`` under ``assert not``: None (no credit: ``_not`` passes only False) when
    an operand is NaN, whose every ordering is False: ``not (f() > 3)`` and ``not (f() < 3)``
    would both pass for a program that returns NaN."""
    if _is_nan(a) or _is_nan(b):
        return None
    return _ORDER[op](a, b)


def _not(value):
    """``assert not X`` passes only for a real false bool: a stub's ``None`` (or ``0``,
    ``[]``) is not the answer ``False``."""
    return value is False


def _compile_tests(payload, kind):
    """``([(id, code or error message), ...], error)``: the setup and the tests compiled with
    their asserts rewritten. An ``asserts`` entry that does not compile is its own failed
    assert; any other failure is ``error`` (every test fails with it)."""
    tests = []
    try:
        if payload.get("setup"):
            tests.append((None, compile(payload["setup"], "<setup>", "exec")))
        sources = (
            [(f"a{i}.", s) for i, s in enumerate(payload["tests"])]
            if kind == "asserts"
            else [("t", payload["tests"])]
        )
        for prefix, src in sources:
            ident = f"{prefix}0" if kind == "asserts" else None
            try:
                tree = _Rewrite(prefix).visit(ast.parse(src))
                ast.fix_missing_locations(tree)
                tests.append((ident, compile(tree, "<tests>", "exec")))
            except Exception as exc:
                if ident is None:
                    raise
                tests.append((ident, _exc_message(exc)))
    except Exception as exc:
        return tests, _exc_message(exc)
    return tests, None


def _start_candidate(payload, names, emit):
    """Start the candidate process, lock this one, and load the program there. Returns the
    link and the candidate's first reply (``None`` when it died before answering)."""
    link = _Link(payload["candidate_code"])
    link.on_gone = lambda rc: emit("candidate", "", False, str(rc))
    try:
        seccomp_lock(processes=False)  # noqa: F821
    except OSError as exc:
        _setup_failed(f"seccomp: {exc}")
    emit("start", "", True)
    ready = link.ready()
    if ready is not None and "setup" in ready:
        _setup_failed(str(ready["setup"]).split(": ", 1)[-1])
    if payload["kind"] == "run":  # code_runs: the exit status, observed from here
        rc = link.run_main({"program": payload.pop("program"), "main": True, "names": []})
        link.gone = f"the candidate process ended (exit status {rc})"
        emit("program", "", rc == 0, "" if rc == 0 else f"the program failed (exit status {rc})")
        if rc < 0:  # killed by a signal (CPU limit, memory, its own kill): say which
            link.on_gone(rc)
        return link, None
    if payload["kind"] == "tool":  # a tool call: its output is an observation, not a verdict
        limit = int(payload.get("output_chars") or 4000)
        message = {"program": payload.pop("program"), "main": False, "names": [], "capture": limit}
        try:
            reply = link.ask(message)
        except CandidateGone:
            reply = None
        if type(reply) is dict:
            # whether it ran is the candidate's exit status, read from outside: the program
            # holds the reply pipe and could forge {"ok": true} on it before raising
            rc = link.proc.wait()
            error = "" if rc == 0 else str(reply.get("error") or "") or f"exit status {rc}"
            emit("program", "", rc == 0, error)
            emit("output", "", True, str(reply.get("output") or ""), limit=limit + 100)
        return link, None
    try:
        first = link.ask({"program": payload["program"], "main": False, "names": names})
    except CandidateGone:
        first = None
    del payload["program"]
    if first is not None and type(first) is not dict:  # the program wrote on the reply pipe
        emit("program", "", False, "the program's first reply is not a message")
        link.gone, first = "the program wrote on its reply pipe", None
    if first is not None:
        emit("program", "", first.get("ok") is True, str(first.get("error") or ""))
    return link, first


def _tests_namespace(link, names, first, emit):
    """The tests' globals: the helpers the rewritten asserts call, and each name the tests
    take from the program as a :class:`Remote`, a plain value or a :class:`Refused`."""
    helpers = {"_grpo_check": _checker(emit), "_grpo_ne": _ne, "_grpo_not": _not,
               "_grpo_order": _order}  # fmt: skip
    tns = {"__name__": "__tests__", "__builtins__": builtins, **helpers}
    described = first.get("names") if first is not None else None
    for name in names:
        info = described.get(name) if type(described) is dict else None
        if type(info) is not dict or "callable" in info:
            tns[name] = Remote(link, name)  # a dead candidate: every call fails
        elif "value" in info:
            try:
                tns[name] = wire_decode(info["value"])  # noqa: F821
            except Exception as exc:
                tns[name] = Refused(name, _exc_message(exc))
        elif "refused" in info:
            tns[name] = Refused(name, info["refused"])
    return tns


def _run_tests(tests, tests_error, tns, payload, link, emit):
    """Run the setup and the tests in ``tns``: a failing ``asserts`` entry is that assert's
    failure; any other exception is a ``tests`` failure, and no later test runs."""
    try:
        if tests_error is not None:
            raise RuntimeError(tests_error)
        for ident, compiled in tests:
            if type(compiled) is str:  # an assert entry that does not compile
                emit("assert", ident, False, compiled)
                continue
            try:
                exec(compiled, tns)
            except Exception as exc:
                if ident is None:
                    raise
                emit("assert", ident, False, _exc_message(exc))
            if ident is not None:  # every execution of this entry's asserts is in
                emit("source", ident[: ident.index(".") + 1], True)
        entry = payload.get("entry_point")
        if entry and payload["kind"] == "humaneval":
            tns["check"](tns.get(entry, Remote(link, entry)))
        if payload["kind"] != "asserts":
            emit("source", "t", True)
    except Exception as exc:
        emit("tests", "", False, _exc_message(exc))


def _scorer_gone(fd):
    """Nobody holds the verdict pipe's read end: the scorer died. Its launcher then died with
    it (parent-death signal), possibly before this sandbox's pid-1 (bwrap's, which does not
    check) asked to die with the launcher: nothing would end this run."""
    poll = select.poll()
    poll.register(fd, 0)  # POLLERR is always reported: a pipe with no reader left
    return bool(poll.poll(0))


def _harness():
    fd = int(sys.argv[1])
    payload = _read_payload()
    if _scorer_gone(fd):
        os._exit(125)
    emit = _emitter(fd, payload.pop("nonce"), os.getpid())
    set_not_dumpable()  # noqa: F821 (_seccomp.py)
    kind = payload["kind"]
    plain = kind in ("run", "tool")  # a program run without tests
    tests, tests_error = _compile_tests(payload, kind) if not plain else ([], None)
    names = list(payload.get("candidates") or ())
    link, first = _start_candidate(payload, names, emit)
    if not plain:
        tns = _tests_namespace(link, names, first, emit)
        _run_tests(tests, tests_error, tns, payload, link, emit)
    link.close()
    emit("done", "", True)


def _setup_failed(why):
    os.write(2, f"sandbox setup failed: {why}\n".encode())
    os._exit(125)


class _Rewrite(ast.NodeTransformer):
    """``assert X`` -> ``_grpo_check(id, lambda: X')`` where X' has ``a != b`` ->
    ``_grpo_ne(a, b)`` and, at the top, ``not Y`` -> ``_grpo_not(Y)`` (``Y`` one ordering
    comparison: ``_grpo_not(_grpo_order(op, a, b))``). Ids: the prefix and the
    assert's index in visiting order (depth-first, source order), as ``credit.py`` counts."""

    def __init__(self, prefix):
        self.prefix, self.count = prefix, 0

    def visit_Assert(self, node):
        test = node.test
        negated = isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)
        test = _NeRewrite().visit(test.operand if negated else test)
        if negated:
            test = _ordered(test)
            test = ast.Call(ast.Name("_grpo_not", ast.Load()), [test], [])
        ident = self.prefix + str(self.count)
        self.count += 1
        call = ast.Call(
            func=ast.Name("_grpo_check", ast.Load()),
            args=[ast.Constant(ident), ast.Lambda(_no_args(), test)],
            keywords=[],
        )
        return ast.copy_location(ast.Expr(call), node)


class _NeRewrite(ast.NodeTransformer):
    def visit_Compare(self, node):
        self.generic_visit(node)
        if len(node.ops) != 1 or not isinstance(node.ops[0], ast.NotEq):
            return node
        call = ast.Call(ast.Name("_grpo_ne", ast.Load()), [node.left, node.comparators[0]], [])
        return ast.copy_location(call, node)


def _ordered(node):
    """``a < b`` (one ordering operator) -> ``_grpo_order("Lt", a, b)``: see :func:`_order`."""
    if not isinstance(node, ast.Compare) or len(node.ops) != 1:
        return node
    op = type(node.ops[0]).__name__
    if op not in _ORDER:
        return node
    args = [ast.Constant(op), node.left, node.comparators[0]]
    return ast.copy_location(ast.Call(ast.Name("_grpo_order", ast.Load()), args, []), node)


def _no_args():
    return ast.arguments(
        posonlyargs=[], args=[], vararg=None, kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[]
    )


_harness()

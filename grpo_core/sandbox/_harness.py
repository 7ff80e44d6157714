"""The trusted harness: runs INSIDE the sandbox as ``python -I -B -c <_seccomp.py + _wire.py +
_link.py + this file's text> <verdict_fd>``. Stdlib only.

It reads a JSON payload from stdin (program, tests, nonce, the candidate process's code),
closes stdin (and exits if the scorer is already gone: ``_scorer_gone``), and starts the
**candidate process** (``_candidate.py``, a fresh interpreter: nothing of this process's
memory, no nonce and no verdict pipe reach it). The model's program runs only there. The
tests run here, in this process, against proxies: every name the tests take from the program
(``credit.analyse``) is a ``Remote`` (``_link.py``) whose call sends the arguments to the candidate
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
import sys


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
    link = _Link(payload["candidate_code"])  # noqa: F821 (_link.py)
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
        except CandidateGone:  # noqa: F821 (_link.py)
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
    except CandidateGone:  # noqa: F821 (_link.py)
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
            # a dead candidate: every call fails
            tns[name] = Remote(link, name)  # noqa: F821 (_link.py)
        elif "value" in info:
            try:
                tns[name] = wire_decode(info["value"])  # noqa: F821
            except Exception as exc:
                tns[name] = Refused(name, _exc_message(exc))  # noqa: F821 (_link.py)
        elif "refused" in info:
            tns[name] = Refused(name, info["refused"])  # noqa: F821 (_link.py)
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
            tns["check"](tns.get(entry, Remote(link, entry)))  # noqa: F821 (_link.py)
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

"""Runs INSIDE the sandbox (``python -I -B -c <this file's text> <verdict_fd>``). Stdlib only.

It reads a JSON payload from stdin (program, tests, nonce), closes stdin, compiles the program
and the tests (every ``assert`` rewritten to record its own outcome), runs the program, then
the tests, and writes one JSON line per event to the verdict pipe: ``[nonce, kind, id, ok,
message]``. The scorer trusts nothing else: not the exit code, not stdout. A program that exits
early (``sys.exit``, ``os._exit``, an ``atexit`` hook, a signal) simply leaves asserts
unrecorded, and those count as failed. Records from a forked child are dropped (pid check),
and records without the nonce are ignored by the scorer.

Against a program that tampers with the process it shares with the harness:
- everything of the harness lives in the scope of ``_harness()`` (``import __main__`` finds
  no nonce, no verdict fd, no check function); the tests run in their own namespace, with a
  copy of the builtins taken before the program ran (patched builtins do not reach them) and
  with the check functions the program's ``globals()`` does not contain;
- the tests are parsed, rewritten and compiled before the program runs (patching ``ast`` or
  ``compile`` changes nothing); the harness uses builtins and C functions captured at start
  (patching ``bool``, ``type``, ``exec``, ``json`` or ``os.write`` changes nothing);
- only plain builtin values (or numpy's own C types) decide an assert, checked by identity:
  an object whose ``__eq__``/``__bool__`` always says yes fails, whatever its ``__module__``
  or metaclass claims.
What remains (documented in docs/rewards.md): a program that digs the harness's objects out of
the interpreter's memory (``gc``, frames, ``/proc/self/mem``) could forge a pass.
"""

import ast
import builtins
import json.encoder
import os
import secrets
import sys


def _harness():
    fd = int(sys.argv[1])
    raw = sys.stdin.buffer.read()
    os.close(0)
    os.open(os.devnull, os.O_RDONLY)  # fd 0 again, now empty: stdin cannot be re-read
    payload = json.loads(raw)
    del raw
    nonce = payload.pop("nonce")
    pid = os.getpid()
    write, getpid, escape = os.write, os.getpid, json.encoder.encode_basestring_ascii
    pristine = dict(builtins.__dict__)  # the tests' builtins: a copy the program never sees
    b_type, b_bool, b_str, b_id, b_all = type, bool, str, id, all
    b_exec, b_compile, b_zip = exec, compile, zip
    base_exc, system_exit, os_error = BaseException, SystemExit, OSError
    tuple_t, dict_t = tuple, dict
    plain_ids = frozenset(
        id(t)
        for t in (bool, int, float, complex, str, bytes, type(None), list, tuple, dict, set)
        + (frozenset,)
    )
    seq_ids = frozenset(id(t) for t in (list, tuple, set, frozenset))
    type_flags = type.__dict__["__flags__"].__get__
    type_module = type.__dict__["__module__"].__get__
    heap_type = 1 << 9  # Py_TPFLAGS_HEAPTYPE: every class defined in Python code

    def emit(kind, ident, ok, message=""):
        if getpid() != pid:  # a forked child of the program does not speak for the run
            return
        if b_type(message) is not b_str:
            message = "?"
        line = "".join(
            ['["', nonce, '","', kind, '","', ident, '",', "true" if ok is True else "false"]
            + [",", escape(message), "]\n"]
        )
        try:
            write(fd, line.encode("utf-8", "replace"))
        except os_error:  # closed by the program: its asserts simply go unrecorded
            return

    def msg(exc):
        try:
            name = b_type(exc).__name__
            text = b_str(exc)
            out = "".join([name, ": " if text else "", text])
        except base_exc:
            out = "?"
        return out[:300] if b_type(out) is b_str else "?"

    def numpy_type(t):
        """numpy's own C types (ndarray, numpy scalars): static types whose module is numpy."""
        try:
            return b_type(t) is type and not type_flags(t) & heap_type and type_module(t) == "numpy"
        except base_exc:
            return False

    def plain(value, depth=0):
        """Only builtin values (recursively, bounded) may decide an assert: a program-defined
        object whose __eq__/__bool__ always says yes must not pass the tests."""
        t = b_type(value)
        if b_id(t) not in plain_ids:
            return numpy_type(t)  # numpy scalars/arrays from np.isclose etc.
        if depth > 20:
            return False
        if b_id(t) in seq_ids:
            return b_all(plain(v, depth + 1) for v in value)
        if t is dict_t:
            return b_all(plain(k, depth + 1) and plain(v, depth + 1) for k, v in value.items())
        return True

    def check(ident, thunk):
        try:
            value = thunk()
            ok = plain(value) and b_bool(value) is True
        except base_exc as exc:  # SystemExit/KeyboardInterrupt from the candidate: a fail
            emit("assert", ident, False, msg(exc))
            return
        emit("assert", ident, ok, "" if ok else "assertion failed")

    def eq(a, b):
        if not (plain(a) and plain(b)):
            return False
        return a == b

    def ne(a, b):
        if not (plain(a) and plain(b)) or (a is None) != (b is None):
            return False  # a stub's None is not "anything but 3"
        return a != b

    class NotPlain(Exception):
        pass

    def plain_or_fail(value):
        """A value from the candidate, used in an assert: builtin (or numpy) values only."""
        if plain(value):
            return value
        raise NotPlain(f"the candidate gave a {b_type(value).__name__}, not a builtin value")

    def not_(value):
        """``assert not X`` passes only for a real false bool: a stub's ``None`` (or ``0``,
        ``[]``) is not the answer ``False``."""
        t = b_type(value)
        if t is bool or numpy_type(t):
            return not value
        return False

    kind = payload["kind"]
    token = secrets.token_hex(8)
    names = tuple_t(f"_grpo_{n}_{token}" for n in ("check", "eq", "ne", "not", "plain"))
    helpers = dict_t(b_zip(names, (check, eq, ne, not_, plain_or_fail), strict=True))
    candidates = frozenset(payload.get("candidates") or ())

    def rewrite(source, prefix):
        tree = _Rewrite(names, prefix, candidates).visit(ast.parse(source))
        ast.fix_missing_locations(tree)
        return b_compile(tree, "<tests>", "exec")

    # compile everything before the program runs: it cannot patch how tests are compiled
    tests, tests_error = [], None
    if kind != "run":
        try:
            if payload.get("setup"):
                tests.append((None, b_compile(payload["setup"], "<setup>", "exec")))
            if kind == "asserts":
                for i, src in enumerate(payload["tests"]):
                    try:
                        tests.append((f"a{i}.0", rewrite(src, f"a{i}.")))
                    except base_exc as exc:
                        tests.append((f"a{i}.0", msg(exc)))
            else:
                tests.append((None, rewrite(payload["tests"], "t")))
        except base_exc as exc:
            tests_error = msg(exc)
    entry = payload.get("entry_point")
    ns = {"__name__": "__main__" if kind == "run" else "__candidate__", "__builtins__": builtins}
    emit("start", "", True)
    try:
        code = b_compile(payload["program"], "<program>", "exec")
    except base_exc as exc:
        emit("program", "", False, msg(exc))
        code = None
    del payload
    if code is not None:
        try:
            b_exec(code, ns)
        except system_exit as exc:
            try:
                clean = exc.code is None or (b_type(exc.code) is int and exc.code == 0)
            except base_exc:
                clean = False
            emit("program", "", clean, msg(exc))
        except base_exc as exc:
            emit("program", "", False, msg(exc))
        else:
            emit("program", "", True)
    if kind != "run":
        tns = dict_t(ns)  # the program's names, then the tests' own builtins and helpers
        tns["__builtins__"] = dict_t(pristine)
        tns["__name__"] = "__tests__"
        tns.update(helpers)
        try:
            if tests_error is not None:
                raise RuntimeError(tests_error)
            for ident, compiled in tests:
                if b_type(compiled) is b_str:  # an assert entry that does not compile
                    emit("assert", ident, False, compiled)
                    continue
                try:
                    b_exec(compiled, tns)
                except base_exc as exc:
                    if ident is None:
                        raise
                    emit("assert", ident, False, msg(exc))
            if entry and kind == "humaneval":
                tns["check"](ns[entry])
        except base_exc as exc:
            emit("tests", "", False, msg(exc))
    emit("done", "", True)


class _Rewrite(ast.NodeTransformer):
    """``assert X`` -> ``CHECK(id, lambda: X')`` where X' has ``a == b`` -> ``EQ(a, b)``,
    ``a != b`` -> ``NE(a, b)``, at the top ``not Y`` -> ``NOT(Y)``, and every value from the
    candidate (a call of a candidate name, a candidate-derived variable) -> ``PLAIN(value)``."""

    def __init__(self, names, prefix, candidates):
        self.names, self.prefix, self.count, self.candidates = names, prefix, 0, candidates

    def visit_Assert(self, node):
        test = _PlainRewrite(self.names[4], self.candidates).visit(node.test)
        negated = isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)
        test = _EqRewrite(self.names).visit(test.operand if negated else test)
        if negated:
            test = ast.Call(ast.Name(self.names[3], ast.Load()), [test], [])
        ident = self.prefix + str(self.count)
        self.count += 1
        call = ast.Call(
            func=ast.Name(self.names[0], ast.Load()),
            args=[ast.Constant(ident), ast.Lambda(_no_args(), test)],
            keywords=[],
        )
        return ast.copy_location(ast.Expr(call), node)


class _PlainRewrite(ast.NodeTransformer):
    def __init__(self, plain_name, candidates):
        self.plain_name, self.candidates = plain_name, candidates

    def wrap(self, node):
        call = ast.Call(ast.Name(self.plain_name, ast.Load()), [node], [])
        return ast.copy_location(call, node)

    def visit_Call(self, node):
        func = node.func
        if isinstance(func, ast.Name):  # f(...): the function itself is not a value
            node.args = [self.visit(a) for a in node.args]
            node.keywords = [self.visit(k) for k in node.keywords]
        else:
            self.generic_visit(node)
        return (
            self.wrap(node) if isinstance(func, ast.Name) and func.id in self.candidates else node
        )

    def visit_Attribute(self, node):  # math.pi, np.isclose: a module is not a value
        if not isinstance(node.value, ast.Name):
            node.value = self.visit(node.value)
        return node

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Load) and node.id in self.candidates:
            return self.wrap(node)
        return node

    def visit_Lambda(self, node):  # its body runs later, outside this assert's check
        return node


class _EqRewrite(ast.NodeTransformer):
    def __init__(self, names):
        self.names = names

    def visit_Compare(self, node):
        self.generic_visit(node)
        if len(node.ops) != 1 or type(node.ops[0]) not in (ast.Eq, ast.NotEq):
            return node
        name = self.names[1] if isinstance(node.ops[0], ast.Eq) else self.names[2]
        call = ast.Call(ast.Name(name, ast.Load()), [node.left, node.comparators[0]], [])
        return ast.copy_location(call, node)


def _no_args():
    return ast.arguments(
        posonlyargs=[], args=[], vararg=None, kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[]
    )


_harness()

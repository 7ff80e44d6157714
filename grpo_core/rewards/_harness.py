"""Runs INSIDE the sandbox (``python -I -B -c <this file's text> <verdict_fd>``). Stdlib only.

It reads a JSON payload from stdin (program, tests, nonce), closes stdin, runs the program,
then the tests with every ``assert`` rewritten to record its own outcome, and writes one JSON
line per event to the verdict pipe: ``[nonce, kind, id, ok, message]``. The scorer trusts
nothing else: not the exit code, not stdout. A program that exits early (``sys.exit``,
``os._exit``, an ``atexit`` hook, a signal) simply leaves asserts unrecorded, and those count
as failed. Records from a forked child are dropped (pid check), and records without the
nonce are ignored by the scorer.
"""

import ast
import builtins
import contextlib
import json
import os
import secrets
import sys

_FD = int(sys.argv[1])
_RAW = sys.stdin.buffer.read()
os.close(0)
os.open(os.devnull, os.O_RDONLY)  # fd 0 again, now empty: stdin cannot be re-read
_PAYLOAD = json.loads(_RAW)
del _RAW
_NONCE = _PAYLOAD.pop("nonce")
_PID = os.getpid()
_write, _getpid, _dumps = os.write, os.getpid, json.dumps
_SAFE_TYPES = (bool, int, float, complex, str, bytes, type(None), list, tuple, dict, set, frozenset)


def _msg(exc):
    try:
        text = str(exc)
    except BaseException:
        text = "?"
    return (type(exc).__name__ + (": " + text if text else ""))[:300]


def _emit(kind, ident, ok, message=""):
    if _getpid() != _PID:  # a forked child of the program does not speak for the run
        return
    line = _dumps([_NONCE, kind, ident, ok is True, message]) + "\n"
    with contextlib.suppress(OSError):
        _write(_FD, line.encode("utf-8", "replace"))


def _plain(value, depth=0):
    """Only builtin values (recursively, bounded) may decide an assert: a program-defined
    object whose __eq__/__bool__ always says yes must not pass the tests."""
    if type(value) not in _SAFE_TYPES:
        return type(value).__module__ == "numpy"  # numpy scalars/arrays from np.isclose etc.
    if depth > 20:
        return False
    if type(value) in (list, tuple, set, frozenset):
        return all(_plain(v, depth + 1) for v in value)
    if type(value) is dict:
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())
    return True


def _eq(a, b):
    if not (_plain(a) and _plain(b)):
        return False
    return a == b


def _check(ident, thunk):
    try:
        value = thunk()
        ok = _plain(value) and bool(value)
    except BaseException as exc:  # SystemExit/KeyboardInterrupt from the candidate: a fail
        _emit("assert", ident, False, _msg(exc))
        return
    _emit("assert", ident, ok, "" if ok else "assertion failed")


class _Rewrite(ast.NodeTransformer):
    """``assert X`` -> ``CHECK(id, lambda: X')`` where X' has ``a == b`` -> ``EQ(a, b)``."""

    def __init__(self, check_name, eq_name, prefix):
        self.check_name, self.eq_name, self.prefix, self.count = check_name, eq_name, prefix, 0

    def visit_Assert(self, node):
        test = _EqRewrite(self.eq_name).visit(node.test)
        ident = self.prefix + str(self.count)
        self.count += 1
        call = ast.Call(
            func=ast.Name(self.check_name, ast.Load()),
            args=[ast.Constant(ident), ast.Lambda(_no_args(), test)],
            keywords=[],
        )
        return ast.copy_location(ast.Expr(call), node)


class _EqRewrite(ast.NodeTransformer):
    def __init__(self, eq_name):
        self.eq_name = eq_name

    def visit_Compare(self, node):
        self.generic_visit(node)
        if len(node.ops) != 1 or type(node.ops[0]) not in (ast.Eq, ast.NotEq):
            return node
        call = ast.Call(ast.Name(self.eq_name, ast.Load()), [node.left, node.comparators[0]], [])
        if isinstance(node.ops[0], ast.NotEq):
            call = ast.UnaryOp(ast.Not(), call)
        return ast.copy_location(call, node)


def _no_args():
    return ast.arguments(
        posonlyargs=[], args=[], vararg=None, kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[]
    )


def _run_tests(source, ns, prefix, names):
    tree = _Rewrite(names[0], names[1], prefix).visit(ast.parse(source))
    ast.fix_missing_locations(tree)
    exec(compile(tree, "<tests>", "exec"), ns)


def _main():
    kind = _PAYLOAD["kind"]
    token = secrets.token_hex(8)
    names = ("_grpo_check_" + token, "_grpo_eq_" + token)
    ns = {"__name__": "__main__" if kind == "run" else "__candidate__", "__builtins__": builtins}
    _emit("start", "", True)
    try:
        code = compile(_PAYLOAD["program"], "<program>", "exec")
    except BaseException as exc:
        _emit("program", "", False, _msg(exc))
        code = None
    if code is not None:
        try:
            exec(code, ns)
        except SystemExit as exc:
            _emit("program", "", exc.code in (None, 0), "SystemExit: " + str(exc.code))
        except BaseException as exc:
            _emit("program", "", False, _msg(exc))
        else:
            _emit("program", "", True)
    if kind != "run":
        ns[names[0]], ns[names[1]] = _check, _eq
        try:
            if _PAYLOAD.get("setup"):
                exec(compile(_PAYLOAD["setup"], "<setup>", "exec"), ns)
            if kind == "asserts":
                for i, src in enumerate(_PAYLOAD["tests"]):
                    try:
                        _run_tests(src, ns, f"a{i}.", names)
                    except BaseException as exc:
                        _emit("assert", f"a{i}.0", False, _msg(exc))
            else:
                _run_tests(_PAYLOAD["tests"], ns, "t", names)
                entry = _PAYLOAD.get("entry_point")
                if entry:
                    ns["check"](ns[entry])
        except BaseException as exc:
            _emit("tests", "", False, _msg(exc))
    _emit("done", "", True)


_main()

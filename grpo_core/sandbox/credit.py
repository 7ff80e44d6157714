"""Which asserts of a test count for partial credit: those that exercise the candidate.

Decided on the scorer's side, from the test source alone (the program cannot influence it).
An assert counts when its condition uses, directly or through test variables derived from
it, a *candidate name*:

- the ``entry_point`` and the parameters of ``check`` (HumanEval: ``check(candidate)``);
- every name the tests use without defining it and that is not a builtin: it can only come
  from the program (MBPP's ``assert add(1, 2) == 3``; HumanEval's helper ``poly`` that the
  prompt defines).

Derived values: a test variable assigned (``=``, ``+=``, ``for ... in``, ``with ... as``,
``:=``) from an expression using a candidate name, a container mutated with one
(``out.append(candidate(x))``, ``d[k] = candidate(x)``), a variable passed to a call made
for its effect (``sort_in_place(xs)`` as a statement: it may change ``xs`` in place), and
the parameters of a test-defined function called with one. ``assert True`` or ``assert 1 == 1`` counts for nothing: it would be
free credit for a program that does nothing.

Assert ids follow the harness's numbering (``_harness.py``: depth-first, in source order; a
prefix per test source).
"""

from __future__ import annotations

import ast
import builtins
from collections.abc import Iterable
from typing import Any

_BUILTINS = frozenset(dir(builtins))


def counted_asserts(
    kind: str, tests: Any, entry_point: str | None = None, setup: str = ""
) -> dict[str, None]:
    """Ids (ordered, as dict keys) of the asserts that count, as the harness numbers them.

    An unparseable test source counts as one failing assert (``<prefix>0``)."""
    return analyse(kind, tests, entry_point, setup)[0]


def analyse(
    kind: str, tests: Any, entry_point: str | None = None, setup: str = ""
) -> tuple[dict[str, None], set[str]]:
    """``(counted assert ids, candidate names)``: the names whose values come from the
    program (the harness requires those values, where an assert uses them, to be plain
    builtin values: an object with a rigged ``__sub__``/``__eq__`` cannot pass
    ``abs(candidate(x) - y) < eps``)."""
    if kind == "asserts":
        sources = [(f"a{k}.", str(src)) for k, src in enumerate(tests or [])]
    elif kind in ("humaneval", "script"):
        sources = [("t", str(tests))]
    else:
        return {}, set()
    trees: list[tuple[str, ast.Module | None]] = []
    for prefix, src in sources:
        try:
            trees.append((prefix, ast.parse(src)))
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            trees.append((prefix, None))
    parsed = [t for _, t in trees if t is not None]
    try:
        setup_tree = ast.parse(setup) if setup else None
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        setup_tree = None
    tainted = _candidate_names(parsed, setup_tree, entry_point if kind == "humaneval" else None)
    tainted = _propagate(parsed, tainted)
    out: dict[str, None] = {}
    for prefix, tree in trees:
        if tree is None:
            out[prefix + "0"] = None
            continue
        for i, node in enumerate(_asserts_in_order(tree)):
            if _names(node.test) & tainted:
                out[f"{prefix}{i}"] = None
    return out, tainted


def _asserts_in_order(tree: ast.AST) -> list[ast.Assert]:
    """Asserts in ``ast.NodeTransformer`` visiting order (the harness's numbering)."""
    found: list[ast.Assert] = []

    class Visitor(ast.NodeVisitor):
        def visit_Assert(self, node: ast.Assert) -> None:  # the harness does not recurse
            found.append(node)

    Visitor().visit(tree)
    return found


def _names(node: ast.AST | None) -> set[str]:
    if node is None:
        return set()
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _bound(trees: Iterable[ast.AST]) -> set[str]:
    """Every name the tests (or setup) bind anywhere."""
    out: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
                out.add(node.id)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                out.add(node.name)
            elif isinstance(node, ast.arg):
                out.add(node.arg)
            elif isinstance(node, ast.alias):
                out.add((node.asname or node.name).split(".")[0])
            elif isinstance(node, ast.ExceptHandler | ast.MatchAs | ast.MatchStar) and node.name:
                out.add(node.name)
            elif isinstance(node, ast.Global | ast.Nonlocal):
                out.update(node.names)
    return out


def _candidate_names(trees: list[ast.Module], setup: ast.Module | None, entry: str | None):
    used = set().union(*(_names(t) for t in trees)) if trees else set()
    bound = _bound([*trees, *([setup] if setup else [])])
    names = {n for n in used - bound if n not in _BUILTINS}
    if entry:
        names.add(entry)
    for tree in trees:  # check(candidate): the harness calls it with the entry point
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == "check":
                names.update(a.arg for a in [*node.args.posonlyargs, *node.args.args][:1])
    return names


def _base_name(target: ast.AST) -> list[str]:
    """Names a store to ``target`` changes: ``x``, ``x[i]``/``x.a`` (x), tuples, starred."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Subscript | ast.Attribute | ast.Starred):
        return _base_name(target.value)
    if isinstance(target, ast.Tuple | ast.List):
        return [n for elt in target.elts for n in _base_name(elt)]
    return []


def _propagate(trees: list[ast.Module], tainted: set[str]) -> set[str]:
    tainted = set(tainted)
    functions: dict[str, list[str]] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                a = node.args
                params = [p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]]
                params += [p.arg for p in (a.vararg, a.kwarg) if p]
                functions.setdefault(node.name, []).extend(params)
    imported = {
        (a.asname or a.name).split(".")[0]
        for tree in trees
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for a in node.names
    }
    edges: list[tuple[set[str], list[str]]] = []  # (names used, names that then derive)
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                edges.append((_names(node.value), [n for t in node.targets for n in _base_name(t)]))
            elif isinstance(node, ast.AugAssign | ast.AnnAssign) and node.value is not None:
                edges.append((_names(node.value), _base_name(node.target)))
            elif isinstance(node, ast.For | ast.AsyncFor | ast.comprehension):
                edges.append((_names(node.iter), _base_name(node.target)))
            elif isinstance(node, ast.withitem) and node.optional_vars is not None:
                edges.append((_names(node.context_expr), _base_name(node.optional_vars)))
            elif isinstance(node, ast.NamedExpr):
                edges.append((_names(node.value), _base_name(node.target)))
            elif isinstance(node, ast.Call):
                args = set().union(
                    *(_names(a) for a in node.args), *(_names(k.value) for k in node.keywords)
                )
                if isinstance(node.func, ast.Attribute):  # out.append(candidate(x))
                    receiver = [n for n in _base_name(node.func.value) if n not in imported]
                    edges.append((args, receiver))  # (math.fabs(...) changes no module)
                elif isinstance(node.func, ast.Name) and node.func.id in functions:
                    edges.append((args, functions[node.func.id]))
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
                call = node.value  # called for its effect: sort_in_place(xs) changes xs
                if isinstance(call.func, ast.Name):
                    changed = [n for a in call.args for n in _base_name(a) if n not in imported]
                    edges.append(({call.func.id}, changed))
    changed = True
    while changed:
        changed = False
        for used, derived in edges:
            if used & tainted and not tainted.issuperset(derived):
                tainted.update(derived)
                changed = True
    return tainted

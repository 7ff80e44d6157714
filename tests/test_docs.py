"""The docs name the code as it is: every reference in README.md and docs/*.md to a repository
file, to a name in a file (``path/file.py: name``) or to a dotted name (``grpo_core.x.y``)
resolves, and the README's notebook example runs.

Names are resolved by reading the source with ``ast`` (nothing is imported, so a reference
into a module that needs vLLM or Ray is checked on a machine without them): a name resolves
when the file defines it at top level (def, class, assignment, import) or as a member of a
class it defines; a name a module imports is followed to where it is defined."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGES = ("grpo_core", "tasks", "flows", "cluster")
# the folders and files a path in the docs may start with (a path elsewhere, runs/... or
# .grpo-servers/..., is one a run or a script makes)
TOP = (*PACKAGES, "configs", "infra", "benchmarks", "tests", "docs")
# examples of a user's own code, not files of this repository
PLACEHOLDERS = {"file.py", "path/file.py", "path/to/envs.py", "my_rewards.py"}
# folders scripts write into when they run (benchmarks' --out)
GENERATED = ("benchmarks/out/",)

FENCE = re.compile(r"^(```|~~~)")
SPAN = re.compile(r"`([^`]+)`")
# path/file.py: name (or path/file.py:name), the name a dotted chain
FILE_NAME = re.compile(r"((?:[\w.-]+/)*[\w.-]+\.py):\s*([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
TOPS, PKGS = "|".join(TOP), "|".join(PACKAGES)
PATH = re.compile(rf"(?<![\w./-])((?:{TOPS})(?:/[\w.-]+)*/?)")
DOTTED = re.compile(rf"^((?:{PKGS})(?:\.[A-Za-z_]\w*)+)(?:\(.*\))?$")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


# -- reading the docs --------------------------------------------------------------------


def _blocks(text: str):
    """(first line, text, is_code, language) of each paragraph and code block; code is a
    fenced block or a paragraph indented four spaces."""
    lines = text.split("\n")
    i, out = 0, []
    while i < len(lines):
        line = lines[i]
        if FENCE.match(line.strip()):
            lang, start, i = line.strip()[3:].strip(), i + 1, i + 1
            while i < len(lines) and not FENCE.match(lines[i].strip()):
                i += 1
            out.append((start + 1, "\n".join(lines[start:i]), True, lang))
            i += 1
        elif not line.strip():
            i += 1
        else:
            start = i
            while i < len(lines) and lines[i].strip() and not FENCE.match(lines[i].strip()):
                i += 1
            para = lines[start:i]
            code = all(p.startswith("    ") for p in para) and not para[0].lstrip().startswith("-")
            out.append((start + 1, "\n".join(para), code, ""))
    return out


def _line(block_line: int, block: str, offset: int) -> int:
    return block_line + block.count("\n", 0, offset)


def references(text: str):
    """(line, kind, reference) of every reference in a doc's ``text``: kind is
    ``file-name``, ``path``, ``link`` or ``dotted``."""
    refs = []
    for first, block, code, lang in _blocks(text):
        if code and lang == "python":
            refs += [(first + n - 1, "dotted", r) for n, r in _python_imports(block)]
        spans = [] if code else [(m.start(1), m.group(1)) for m in SPAN.finditer(block)]
        for start, span in spans:
            for m in FILE_NAME.finditer(span):
                refs.append((_line(first, block, start + m.start()), "file-name", m.groups()))
            d = DOTTED.match(span.strip())
            if d:
                refs.append((_line(first, block, start), "dotted", d.group(1)))
        # file.py:name without a space, outside backticks too
        if not code:
            masked = SPAN.sub(lambda m: " " * len(m.group(0)), block)
            for m in re.finditer(r"((?:[\w.-]+/)*[\w-]+\.py):([A-Za-z_]\w*)", masked):
                refs.append((_line(first, block, m.start()), "file-name", m.groups()))
            for m in LINK.finditer(block):
                refs.append((_line(first, block, m.start(1)), "link", m.group(1)))
        for m in PATH.finditer(block):
            refs.append((_line(first, block, m.start(1)), "path", m.group(1)))
    return refs


def _python_imports(code: str):
    """(line in the block, dotted name) of each ``from package.module import name``."""
    try:
        tree = ast.parse(code)
    except SyntaxError:  # a signature or a sketch, not a program
        return []
    out = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").split(".")[0] in PACKAGES
        ):
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


# -- resolving names in the source ------------------------------------------------------


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _module_file(dotted: str) -> Path | None:
    base = ROOT / dotted.replace(".", "/")
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _members(body) -> dict[str, ast.AST]:
    """Name -> the node that binds it, for the statements of a module or class body
    (``if``/``try`` blocks included)."""
    out: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        out[n.id] = node
        elif isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for a in node.names:
                out[(a.asname or a.name).split(".")[0]] = node
        elif isinstance(node, ast.If | ast.Try):
            inner = [*node.body, *node.orelse, *getattr(node, "finalbody", [])]
            for h in getattr(node, "handlers", []):
                inner += h.body
            out.update(_members(inner))
    return out


def _class_members(cls: ast.ClassDef, path: Path) -> dict[str, ast.AST]:
    """A class's members, its bases' (those defined in the repository) included."""
    out: dict[str, ast.AST] = {}
    for base in cls.bases:
        if isinstance(base, ast.Name):
            found = _lookup(path, base.id)
            if found and isinstance(found[1], ast.ClassDef):
                out.update(_class_members(found[1], found[0]))
    out.update(_members(cls.body))
    # self.x = ... in __init__ / __post_init__
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name in ("__init__", "__post_init__"):
            for n in ast.walk(node):
                if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                    out.setdefault(n.attr, n)
    return out


def _lookup(path: Path, name: str, depth: int = 0) -> tuple[Path, ast.AST] | None:
    """Where the top-level ``name`` of ``path`` is defined, following imports of the
    repository's packages; a name imported from elsewhere resolves to the import."""
    if depth > 10:
        return None
    node = _members(_tree(path).body).get(name)
    if node is None:
        sub = _module_file(_dotted_of(path) + "." + name) if path.name == "__init__.py" else None
        return (sub, _tree(sub)) if sub else None
    if isinstance(node, ast.ImportFrom):
        module = node.module or ""
        if node.level:
            pkg = _dotted_of(path).split(".")
            pkg = pkg[: len(pkg) - node.level + (path.name == "__init__.py")]
            module = ".".join([*pkg, module] if module else pkg)
        for a in node.names:
            if (a.asname or a.name) == name:
                sub = _module_file(f"{module}.{a.name}")
                if sub:
                    return sub, _tree(sub)
                src = _module_file(module)
                if src and module.split(".")[0] in PACKAGES:
                    return _lookup(src, a.name, depth + 1)
    if isinstance(node, ast.Import):
        for a in node.names:
            if a.asname == name and (sub := _module_file(a.name)):
                return sub, _tree(sub)
    return path, node


def _dotted_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def resolve(path: Path, chain: list[str]) -> str | None:
    """None when ``chain`` (name, then class members) resolves in ``path``; else why not."""
    found = _lookup(path, chain[0])
    if found is None:
        return f"{path.relative_to(ROOT)} defines no {chain[0]!r}"
    where, node = found
    for attr in chain[1:]:
        if isinstance(node, ast.Module):
            found = _lookup(where, attr)
            if found is None:
                return f"{where.relative_to(ROOT)} defines no {attr!r}"
            where, node = found
        elif isinstance(node, ast.ClassDef):
            members = _class_members(node, where)
            if attr not in members:
                return f"class {node.name} ({where.relative_to(ROOT)}) has no {attr!r}"
            node = members[attr]
            # a field typed by a class of the repository: its members next (config sections)
            if isinstance(node, ast.AnnAssign) and isinstance(node.annotation, ast.Name):
                typed = _lookup(where, node.annotation.id)
                if typed and isinstance(typed[1], ast.ClassDef):
                    where, node = typed
        else:
            return None  # an attribute of a value (an instance, an import): not checked
    return None


def check_dotted(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] == "cluster" and _lookup(ROOT / "cluster/__init__.py", parts[1]) is None:
        # a key of the config's cluster: section (cluster.rollout.weight_sync)
        return resolve(ROOT / "cluster/config.py", ["ClusterConfig", *parts[1:]])
    for n in range(len(parts), 0, -1):
        path = _module_file(".".join(parts[:n]))
        if path:
            return resolve(path, parts[n:]) if parts[n:] else None
    return f"no module {parts[0]}"


def check_file_name(file: str, name: str) -> str | None:
    if file in PLACEHOLDERS:
        return None
    candidates = [ROOT / file] if "/" in file else sorted(ROOT.glob(f"*/**/{file}"))
    candidates = [c for c in candidates if c.is_file() and ".venv" not in c.parts]
    if not candidates:
        return f"no file {file}"
    reasons = [resolve(c, name.split(".")) for c in candidates]
    return None if None in reasons else "; ".join(r for r in reasons if r)


def check_path(path: str) -> str | None:
    if path.startswith(GENERATED):
        return None
    target = ROOT / path.rstrip(".")
    return None if target.exists() else f"no such file or folder {path}"


def problems(doc: Path, text: str | None = None) -> list[str]:
    """One line per reference of ``doc`` (its ``text``: default, the file's) that does not
    resolve: file:line, the reference, why."""
    out = []
    for line, kind, ref in references(doc.read_text() if text is None else text):
        if kind == "file-name":
            why, shown = check_file_name(*ref), f"{ref[0]}: {ref[1]}"
        elif kind == "dotted":
            why, shown = check_dotted(ref), ref
        elif kind == "link":
            if re.match(r"\w+://|mailto:", ref):
                continue
            why = None if (doc.parent / ref).exists() else f"no such file {ref}"
            shown = ref
        else:
            why, shown = check_path(ref), ref
        if why:
            out.append(f"{doc.relative_to(ROOT)}:{line}: `{shown}`: {why}")
    return out


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_reference_resolves(doc):
    found = problems(doc)
    assert not found, "broken references:\n" + "\n".join(found)


def test_the_checker_catches_drift():
    doc = ROOT / "docs" / "_drift_probe.md"
    text = (
        "See `grpo_core/algorithm/iteration.py: sample` and `grpo_core/algorithm/iteration.py:"
        " no_such_step`,\n`grpo_core.algorithm.iteration.RLUpdate.history`, "
        "`grpo_core.algorithm.iteration.nope`,\n`tasks/no_such.py` and `docs/algorithm.md`.\n"
    )
    found = problems(doc, text)
    assert [f.split(": ", 1)[0] for f in found] == ["docs/_drift_probe.md:1",
                                                     "docs/_drift_probe.md:2",
                                                     "docs/_drift_probe.md:3"]  # fmt: skip
    assert "no_such_step" in found[0] and "nope" in found[1] and "tasks/no_such.py" in found[2]


# -- the README's notebook example -------------------------------------------------------


def readme_snippet() -> str:
    """The python block of the README's section "One iteration"."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## One iteration", 1)[1].split("\n## ", 1)[0]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_readme_iteration_runs_on_a_fresh_install(tmp_path):
    """In a fresh process, from an empty folder: no run folder, no checkpoint."""
    script, cwd = tmp_path / "iteration.py", tmp_path / "cwd"
    script.write_text(readme_snippet())
    cwd.mkdir()
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(cwd.iterdir()) == []  # it wrote no run folder, no checkpoint

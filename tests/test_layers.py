"""The import rules of docs/architecture.md ("Layers and import rules"), read from the source
of every module (imports inside functions included): each folder imports only the floors
below it, and grpo_core works in a notebook without Prefect, MLflow, Ray or fsspec."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> the project folders and services it must never import
NEVER = {
    "grpo_core": {"tasks", "flows", "cluster", "prefect", "prefect_ray", "mlflow", "ray", "fsspec"},
    "cluster": {"tasks", "flows", "prefect", "mlflow"},
    "tasks": {"flows"},
}


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level module) of every absolute import in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module.split(".")[0]))
    return out


@pytest.mark.parametrize("folder", sorted(NEVER))
def test_each_floor_imports_only_the_floors_below(folder):
    found = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line, module in _imports(path)
        if module in NEVER[folder]
    ]
    assert not found, "\n".join(found)


# grpo_core's rooms, lowest first: a module imports only rooms below its own (or its own).
# docs/architecture.md ("Rooms inside grpo_core") says what each holds.
ROOMS = [
    "errors",
    "registry",
    "contracts",
    "config",
    "sandbox",
    "rewards",
    "logprobs",
    "training",
    "engines",
    "algorithm",
    "demo",
]
# The few imports that go up a floor, each inside a function (never at import time), with why.
UPWARD = {
    # the typed optimizer settings build their torch objects only when training starts
    ("config", "training"),
}


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "grpo_core" and len(parts) > 1 and parts[1] in ROOMS else None


def _core_imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, imported grpo_core module, at import time?) of every import in ``path``; imports
    under ``if TYPE_CHECKING:`` are annotations only and skipped."""
    out = []

    def walk(nodes, top: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
                continue
            if isinstance(node, ast.Import):
                out.extend((node.lineno, a.name, top) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module == "grpo_core":
                out.extend((node.lineno, f"grpo_core.{a.name}", top) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                out.append((node.lineno, node.module, top))
            inside = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for field in ("body", "orelse", "finalbody", "handlers"):
                children = getattr(node, field, None)
                if isinstance(children, list):
                    walk(children, top and not inside)

    walk(ast.parse(path.read_text(), str(path)).body, True)
    return out


def _upward_imports(root: Path = ROOT) -> list[tuple[str, str, str, bool]]:
    """(where, from room, to room, at import time?) of every import that goes up a floor."""
    found = []
    for path in sorted((root / "grpo_core").rglob("*.py")):
        rel = path.relative_to(root)
        own = _room(".".join(rel.with_suffix("").parts))
        for line, module, top in _core_imports(path):
            target = _room(module)
            if own and target and ROOMS.index(target) > ROOMS.index(own):
                found.append((f"{rel}:{line} imports {module}", own, target, top))
    return found


def test_every_grpo_core_module_is_in_a_room():
    rooms = {p.name.removesuffix(".py") for p in (ROOT / "grpo_core").iterdir()}
    rooms -= {"__init__", "__pycache__"}
    assert rooms == set(ROOMS), f"rooms not in ROOMS: {rooms - set(ROOMS)}"


def test_grpo_core_rooms_import_only_the_rooms_below():
    found = _upward_imports()
    at_import = [where for where, _, _, top in found if top]
    assert not at_import, "imports up a floor at import time:\n" + "\n".join(at_import)
    unexplained = [where for where, a, b, _ in found if (a, b) not in UPWARD]
    assert not unexplained, "imports up a floor (add a reason to UPWARD or move):\n" + "\n".join(
        unexplained
    )
    assert len(UPWARD) <= 3


def test_the_checker_sees_an_upward_import(tmp_path):
    """The rule reads real source: a module of a low room importing a higher one is caught."""
    fake = tmp_path / "grpo_core" / "contracts"
    fake.mkdir(parents=True)
    (tmp_path / "grpo_core" / "algorithm").mkdir()
    (fake / "bad.py").write_text("from grpo_core.algorithm.update import grpo_update\n")
    (fake / "lazy.py").write_text("def f():\n    from grpo_core import engines\n")
    found = _upward_imports(tmp_path)
    assert [(a, b, top) for _, a, b, top in found] == [
        ("contracts", "algorithm", True),
        ("contracts", "engines", False),
    ]

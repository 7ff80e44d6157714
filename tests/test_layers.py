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

"""No tensor is made on the host by accident where it may meet a model's outputs (issue 40).

On a CPU every tensor is on the same device, so a ``torch.zeros(shape)`` that later meets a
CUDA tensor passes every CPU test and crashes the first GPU run (it did: the old log-probs of
the live rows and the engine correction's sampling log-probs). This walks the source of
``grpo_core``, ``tasks`` and ``cluster`` and fails on any tensor factory called without
``device=`` and any ``.cpu()``, unless the function is in ``ALLOWED`` with the reason it is
safe. The ``*_like`` factories take their device from their argument and are not listed.
A new entry needs a reason a reviewer can check: host data that crosses in
``UpdateBatch.to`` (``grpo_core/algorithm/update.py``), a value read back as Python numbers, or a copy
meant for the host (checkpoints, hashes, shared memory).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("grpo_core", "tasks", "cluster")
FACTORIES = {
    "zeros", "ones", "full", "empty", "arange", "tensor", "as_tensor", "randn", "rand",
    "randint", "randperm", "eye", "linspace", "from_numpy",
}  # fmt: skip

HOST_DATA = "host data read from a file or a table; the update moves it in UpdateBatch.to"
ALLOWED = {
    "grpo_core/algorithm/batch.py::build_batch": HOST_DATA,
    "grpo_core/rewards/scoring.py::reward_matrix": "rewards of host-side reward functions",
    "grpo_core/training/sft.py::collate": "host batch; the SFT loop moves it with .to(model.device)",
    "grpo_core/algorithm/losses.py::micro_batch_counts": "only for an empty list, which has no device",
    "grpo_core/training/distributed.py::fill_missing_gradients": "flags built on the host, moved to "
    "the collective's device, read back as a Python list",
    "grpo_core/training/distributed.py::broadcast_parameters": "copies back into host-resident state",
    "grpo_core/training/distributed.py::row_share": "row bounds read back as Python ints",
    "grpo_core/training/fsdp.py::agree": "forward counts read back as a Python list",
    "grpo_core/training/fsdp.py::full_state_dict": "the unsharded weights for a checkpoint on the host",
    "grpo_core/training/weights_id.py::state_dict_id": "bytes for a content hash",
    "cluster/engine_process.py::pack": "shared-memory buffer the engine process maps",
    "cluster/weight_bus.py::nbytes": "a 0-d tensor for its element size",
    "cluster/rollout_workers.py::sync": "weights put in Ray's object store (host memory)",
}


def _findings() -> list[str]:
    found = []
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            tree = ast.parse(path.read_text(), filename=rel)
            for func, call in _calls(tree):
                what = _unplaced(call)
                if what and f"{rel}::{func}" not in ALLOWED:
                    found.append(f"{rel}:{call.lineno} in {func}: {what}")
    return found


def _calls(tree: ast.AST):
    """``(enclosing function name, call)`` of every call; ``<module>`` outside functions."""

    def visit(node: ast.AST, func: str):
        for child in ast.iter_child_nodes(node):
            name = func
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = child.name
            if isinstance(child, ast.Call):
                yield name, child
            yield from visit(child, name)

    yield from visit(tree, "<module>")


def _unplaced(call: ast.Call) -> str | None:
    fn = call.func
    if not isinstance(fn, ast.Attribute):
        return None
    if (
        isinstance(fn.value, ast.Name)
        and fn.value.id == "torch"
        and fn.attr in FACTORIES
        and not any(k.arg == "device" for k in call.keywords)
    ):
        return f"torch.{fn.attr}(...) without device="
    if fn.attr == "cpu" and not call.args and not call.keywords:
        return ".cpu()"
    return None


def test_no_tensor_factory_without_a_device():
    found = _findings()
    assert not found, (
        "tensors made without a device where they may meet a model's outputs (pass "
        "device= of the data they meet, or add the function to ALLOWED with why it is "
        "safe):\n" + "\n".join(found)
    )


def test_every_allowed_entry_still_exists():
    """A stale allow-list entry would silently allow a new factory in a reused name."""
    missing = []
    for key in ALLOWED:
        rel, func = key.split("::")
        tree = ast.parse((REPO / rel).read_text())
        if not any(_unplaced(call) for f, call in _calls(tree) if f == func):
            missing.append(key)
    assert not missing, f"ALLOWED entries with nothing to allow: {missing}"


def test_the_guard_sees_a_factory_without_a_device():
    tree = ast.parse("def f(x):\n    return x + torch.zeros(3)\n")
    assert [_unplaced(c) for _, c in _calls(tree)] == ["torch.zeros(...) without device="]
    tree = ast.parse("def f(x):\n    return torch.zeros(3, device=x.device).cpu()\n")
    assert [_unplaced(c) for _, c in _calls(tree)] == [".cpu()", None]

"""Name -> function registries (advantage estimators, policy losses, rewards).

Modelled on verl's ``register_adv_est``: registering a taken name raises, and looking up
an unknown name raises an error that lists the valid ones.

A registry may carry one declaration per name beside the function (``spec``: a dataclass
whose fields are given as keywords to ``register``/``add``), so everything the pipeline
needs to know about an entry is said where it is registered: a reward's data columns and
answer extraction, whether a loss is zero at a zero advantage. ``spec(name)`` reads it
without importing the function: an entry may be registered as ``"module:attribute"``,
imported on the first ``get`` (so a config can check its names without loading torch).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """A named table of functions of one kind (``kind`` is used in error messages), each
    with an instance of ``spec`` (its declared fields; defaults when none were given)."""

    def __init__(self, kind: str, spec: type | None = None) -> None:
        self.kind = kind
        self.spec_type = spec
        self._table: dict[str, F | str] = {}
        self._specs: dict[str, Any] = {}

    def register(self, name: str, *, replace: bool = False, **fields: Any) -> Callable[[F], F]:
        """Decorator: ``@REGISTRY.register("grpo")``. A taken name raises unless ``replace``;
        ``fields`` are the entry's declaration (the registry's ``spec``)."""

        def deco(fn: F) -> F:
            self.add(name, fn, replace=replace, **fields)
            return fn

        return deco

    def add(self, name: str, fn: F | str, *, replace: bool = False, **fields: Any) -> None:
        """Register ``fn`` (or ``"module:attribute"``, imported on the first ``get``)."""
        if not replace and name in self._table and self._table[name] is not fn:
            taken = self._table[name]
            if not (isinstance(fn, str) and isinstance(taken, str) and fn == taken):
                raise ValueError(f"{self.kind} {name!r} is already registered")
        if fields and self.spec_type is None:
            raise TypeError(f"{self.kind} registrations take no fields (got {sorted(fields)})")
        spec = self.spec_type(**fields) if self.spec_type is not None else None
        self._table[name] = fn
        self._specs[name] = spec

    def remove(self, name: str) -> None:
        """Forget ``name`` (a test's own registration); unknown names are ignored."""
        self._table.pop(name, None)
        self._specs.pop(name, None)

    def get(self, name: str) -> F:
        if name not in self._table:
            raise self._unknown(name)
        fn = self._table[name]
        if isinstance(fn, str):
            fn = self._table[name] = _import(fn)
        return fn

    def spec(self, name: str) -> Any:
        """The declaration ``name`` was registered with (the spec's defaults when it gave
        none); ``None`` for a registry without a spec. Unknown names raise as ``get``."""
        if name not in self._table:
            raise self._unknown(name)
        spec = self._specs.get(name)
        if spec is None and self.spec_type is not None:
            spec = self.spec_type()
        return spec

    def check(self, name: str) -> str:
        """``name`` if registered, else the ``ValueError`` of ``get`` (for validators)."""
        if name not in self._table:
            raise self._unknown(name)
        return name

    def _unknown(self, name: object) -> ValueError:
        valid = ", ".join(sorted(self._table)) or "(none)"
        return ValueError(f"unknown {self.kind} {name!r}; valid names: {valid}")

    def names(self) -> list[str]:
        return sorted(self._table)

    def __contains__(self, name: object) -> bool:
        return name in self._table

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._table))


def _import(target: str) -> Any:
    """The object ``"package.module:attribute"`` names (the attribute may be dotted)."""
    module_name, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj

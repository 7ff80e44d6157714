"""Name -> function registries (advantage estimators, policy losses, rewards).

Modelled on verl's ``register_adv_est``: registering a taken name raises, and looking up
an unknown name raises an error that lists the valid ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """A named table of functions of one kind (``kind`` is used in error messages)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._table: dict[str, F] = {}

    def register(self, name: str, *, replace: bool = False) -> Callable[[F], F]:
        """Decorator: ``@REGISTRY.register("grpo")``. A taken name raises unless ``replace``."""

        def deco(fn: F) -> F:
            self.add(name, fn, replace=replace)
            return fn

        return deco

    def add(self, name: str, fn: F, *, replace: bool = False) -> None:
        if not replace and name in self._table and self._table[name] is not fn:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._table[name] = fn

    def get(self, name: str) -> F:
        try:
            return self._table[name]
        except KeyError:
            valid = ", ".join(sorted(self._table)) or "(none)"
            raise ValueError(f"unknown {self.kind} {name!r}; valid names: {valid}") from None

    def names(self) -> list[str]:
        return sorted(self._table)

    def __contains__(self, name: object) -> bool:
        return name in self._table

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._table))

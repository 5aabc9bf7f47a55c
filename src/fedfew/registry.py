"""Name -> implementation registries (datasets, models, algorithms).

Every implementation lives in its own module whose file name equals its config value
(``algorithm=fedavg`` -> ``fedfew/algorithms/fedavg.py``). Modules register themselves with
:meth:`Registry.register`; :meth:`Registry.get` imports the package's modules on first use so
that no central list (or if/elif ladder) of names is needed.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Callable


class Registry:
    """A mapping from config value to implementation, filled by a package's modules.

    Args:
        kind: what is registered ("dataset", "model", "algorithm"), used in messages.
        package: dotted package whose modules register themselves when imported.
    """

    def __init__(self, kind: str, package: str) -> None:
        self.kind = kind
        self.package = package
        self._entries: dict[str, Any] = {}
        self._loaded = False

    def register(self, name: str) -> Callable[[Any], Any]:
        """Decorator: ``@REGISTRY.register("name")`` on a class or function."""

        def deco(obj: Any) -> Any:
            if name in self._entries and self._entries[name] is not obj:
                raise ValueError(f"{self.kind} '{name}' is registered twice")
            self._entries[name] = obj
            return obj

        return deco

    def _load(self) -> None:
        if self._loaded:
            return
        pkg = importlib.import_module(self.package)
        for info in pkgutil.iter_modules(pkg.__path__):
            if not info.name.startswith("_"):
                importlib.import_module(f"{self.package}.{info.name}")
        self._loaded = True

    def names(self) -> list[str]:
        """Sorted registered names."""
        self._load()
        return sorted(self._entries)

    def get(self, name: str) -> Any:
        """The implementation registered as ``name``.

        Raises:
            ValueError: unknown name; the message lists the available ones.
        """
        self._load()
        if name not in self._entries:
            raise ValueError(
                f"unknown {self.kind} '{name}'; available: {', '.join(self.names())} "
                f"(set `{self.kind}=<one of these>`)"
            )
        return self._entries[name]

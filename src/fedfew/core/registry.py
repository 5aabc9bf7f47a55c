"""Name -> implementation registries (datasets, models, algorithms).

Every implementation lives in its own module whose file name equals its config value
(``algorithm=fedavg`` -> ``fedfew/algorithms/fedavg.py``). Modules register themselves with
:meth:`Registry.register`; :meth:`Registry.get` imports the package's modules on first use so
that no central list (or if/elif ladder) of names is needed.
"""
from __future__ import annotations

import ast
import difflib
import importlib
import importlib.util
import pkgutil
from pathlib import Path
from typing import Any, Callable, Iterable


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
            raise ValueError(unknown_name(self.kind, name, self.names()))
        return self._entries[name]


def unknown_name(kind: str, name: str, available: Iterable[str]) -> str:
    """The message for a ``kind`` (algorithm, dataset, ...) that does not exist: the closest
    available names (:func:`difflib.get_close_matches`), every available one, and how to set it.

    >>> unknown_name("algorithm", "fedavgg", ["ifca", "fedfew", "fedavg"])
    "unknown algorithm 'fedavgg'; did you mean fedavg? available: fedavg, fedfew, ifca (set `algorithm=<one of these>`)"
    """
    available = sorted(available)
    close = difflib.get_close_matches(name, available, n=3)
    guess = f"; did you mean {' or '.join(close)}?" if close else ";"
    return f"unknown {kind} '{name}'{guess} available: {', '.join(available)} (set `{kind}=<one of these>`)"


# -- what the sources say, without importing them ------------------------------------------------
# Importing an implementation pulls in torch and Lightning (seconds); the checks that run before
# training (fedfew.experiments.training.preflight, fedfew.config.rules.validate_config) read the sources instead, by the
# project's rule that ``name`` is implemented in ``<package>/<name>.py`` and registered there with
# ``register("<name>")``.

def _sources(package: str) -> list[Path]:
    """The folders of ``package`` (importing its parent packages only, not its modules)."""
    spec = importlib.util.find_spec(package)
    return [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []


def _module_source(package: str, module: str) -> str | None:
    """The text of ``<package>/<module>.py``, or None."""
    for folder in _sources(package):
        if (folder / f"{module}.py").is_file():
            return (folder / f"{module}.py").read_text(encoding="utf-8")
    return None


def registered_names(package: str) -> list[str]:
    """The names registered in ``package``'s registry, sorted, read from the sources: each module
    ``<name>.py`` (not ``_private``) that calls ``register("<name>")``."""
    return sorted(info.name for info in pkgutil.iter_modules([str(p) for p in _sources(package)])
                  if not info.name.startswith("_")
                  and f'register("{info.name}")' in (_module_source(package, info.name) or ""))


def declared(package: str, name: str, attribute: str, default: Any = None) -> Any:
    """Class attribute ``attribute`` of the implementation registered as ``name`` in ``package``,
    read from the sources with :mod:`ast`: the class decorated with ``register("<name>")`` in
    ``<package>/<name>.py``, else its bases in turn, followed through ``from <package>.<module>
    import <Base>``. E.g. ``declared("fedfew.algorithms", "fedfew_reference", "uses_engine")`` is
    True: the class subclasses FedFew, which sets ``uses_engine = True``.

    Returns:
        the value assigned (a literal), or ``default`` when no class on that chain assigns one or
        ``name`` has no module.
    Raises:
        ValueError: the assigned value is not a Python literal (it cannot be read without
            importing the module).
    """
    text = _module_source(package, name)
    if text is None:
        return default
    tree = ast.parse(text)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and any(_registers(d, name) for d in node.decorator_list):
            value = _class_attribute(package, tree, node, attribute)
            return default if value is _UNSET else value
    return default


_UNSET = object()


def _registers(decorator: ast.expr, name: str) -> bool:
    """Whether ``decorator`` is ``<registry>.register("<name>")``."""
    return (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)
            and decorator.func.attr == "register" and len(decorator.args) == 1
            and isinstance(decorator.args[0], ast.Constant) and decorator.args[0].value == name)


def _class_attribute(package: str, tree: ast.Module, cls: ast.ClassDef, attribute: str) -> Any:
    """``attribute`` as ``cls`` (in ``tree``) or its bases assign it; ``_UNSET`` when none does."""
    for stmt in cls.body:
        if isinstance(stmt, ast.Assign):
            targets, value = stmt.targets, stmt.value
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            targets, value = [stmt.target], stmt.value
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == attribute for t in targets):
            try:
                return ast.literal_eval(value)
            except ValueError as err:
                raise ValueError(f"{package}: {cls.name}.{attribute} is not a literal, so it cannot be read "
                                 "without importing the module") from err
    for base in cls.bases:
        found = _find_class(package, tree, base.id) if isinstance(base, ast.Name) else None
        value = _class_attribute(package, *found, attribute) if found else _UNSET
        if value is not _UNSET:
            return value
    return _UNSET


def _find_class(package: str, tree: ast.Module, name: str) -> tuple[ast.Module, ast.ClassDef] | None:
    """The class ``name`` as ``tree`` sees it: defined there, or imported from a module of ``package``."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return tree, node
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(f"{package}."):
            for alias in node.names:
                text = _module_source(package, node.module[len(package) + 1:])
                if (alias.asname or alias.name) == name and text is not None:
                    return _find_class(package, ast.parse(text), alias.name)
    return None

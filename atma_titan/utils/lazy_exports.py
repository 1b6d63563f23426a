"""Package namespaces whose names import their module on first use (so a light import stays light)."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(
    package: str, exports: dict[str, list[str]], namespace: dict[str, Any]
) -> tuple[list[str], Callable, Callable]:
    """(__all__, __getattr__, __dir__) for `package`: each name in exports[module] is read from
    `package.module` when first asked for. `namespace` is the package's globals()."""
    module_of = {name: module for module, names in exports.items() for name in names}
    names = sorted(module_of)

    def __getattr__(name: str) -> Any:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names))

    return names, __getattr__, __dir__

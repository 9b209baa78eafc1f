"""Package APIs loaded on first use: importing a package then imports no torch and installs
nothing; the name's own module is imported when the name is first read."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_api(package: str, api: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that serves ``api`` (name -> defining module).

    A served name must not also be a submodule's name: once imported, the submodule would
    shadow it (``tests/test_imports.py`` checks)."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        if name not in api:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(api[name]), name)
        namespace[name] = value
        return value

    return __getattr__

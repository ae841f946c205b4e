"""A lab's own Python modules, named by an environment variable (comma-separated, importable from
``PYTHONPATH``) and imported once before the registry they extend is first read: how a lab adds a node
kind (``TESTBED_NODE_KINDS``) or a method family (``TESTBED_METHOD_FAMILIES``) without editing ours."""

from __future__ import annotations

import importlib
import os

from foundation.errors import TestbedError

_loaded: set[str] = set()


def import_lab_modules(variable: str, what: str) -> None:
    """Import the modules ``$variable`` names, once per variable; one that fails is named with its error."""
    if variable in _loaded:
        return
    _loaded.add(variable)
    for name in filter(None, (part.strip() for part in os.environ.get(variable, "").split(","))):
        try:
            importlib.import_module(name)
        except Exception as exc:  # a lab's module that fails is the user's problem to mend: say which
            raise TestbedError(f"{variable}: the {what} module {name!r} cannot be imported "
                               f"({type(exc).__name__}: {exc})") from None  # fmt: skip

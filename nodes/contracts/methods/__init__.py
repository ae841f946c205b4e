"""The methods the testbed runs, registered by name. A method is one module of this package that
defines ``METHODS`` (its :class:`~nodes.contracts.methods.base.Method` objects); registering it is one
entry in ``MODULES`` below. Standard library only (Python 3.8): the controller imports this registry
to validate campaigns; the workers use it to pick their behaviours.
"""

from typing import Dict, Tuple

from . import centralized, cocoserve, disco, hat, llms, serving, usarathi, ushape
from .base import Method, MethodCheck, default_adapter_dir
from .llms import CONTEXT_MEMORY_METHODS, FLOAT16_CONTEXT_MEMORY

# the registration: one module per method family
MODULES = (centralized, ushape, usarathi, hat, serving, disco, llms, cocoserve)

_REGISTRY: Dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add ``method`` (a name may be registered once)."""
    if not method.name or method.name in _REGISTRY:
        raise ValueError("a method needs a name not registered yet, not %r" % method.name)
    _REGISTRY[method.name] = method
    return method


def unregister(name: str) -> None:
    """Remove a method registered at run time (tests do)."""
    _REGISTRY.pop(name, None)


for _module in MODULES:
    for _method in _module.METHODS:
        register(_method)


def names() -> Tuple[str, ...]:
    return tuple(_REGISTRY)


def method_named(name: str) -> Method:
    """The registered method ``name``; a ValueError listing the known ones otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError("unknown method %r; known: %s" % (name, ", ".join(_REGISTRY))) from None


__all__ = ["CONTEXT_MEMORY_METHODS", "FLOAT16_CONTEXT_MEMORY", "Method", "MethodCheck", "default_adapter_dir",
           "method_named", "names", "register", "unregister"]

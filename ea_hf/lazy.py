"""Public names imported on first use (PEP 562): ``ea_hf`` and ``ea_hf.modeling`` import their modules only when
one of their names is asked for, so that the ``ea-hf`` command parses its arguments without torch."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any


def lazy_attribute(namespace: dict[str, Any], public: Mapping[str, str], name: str) -> Any:
    """A package's public ``name``, imported from the module that ``public`` gives for it (relative to the package
    whose globals are ``namespace``) and kept in ``namespace``, where the next look-up finds it.

    Example:
        >>> namespace = {"__name__": "ea_hf.modeling"}
        >>> lazy_attribute(namespace, {"ATTENTION_ROLES": ".settings"}, "ATTENTION_ROLES")
        ('encoder', 'decoder', 'cross')
        >>> "ATTENTION_ROLES" in namespace
        True
    """
    if name not in public:
        raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
    value = namespace[name] = getattr(importlib.import_module(public[name], namespace["__name__"]), name)
    return value

"""Release versions as numbers to compare: what the architecture table's ``since`` and the optional kernels'
dependency floors are checked with.

This file is copied beside the weights of saved EA checkpoints (``trust_remote_code``): it imports only the
standard library.
"""

from __future__ import annotations

import re


def release(version: str) -> tuple[int, ...]:
    """A release version (transformers, torch, triton) as numbers to compare (``"5.10.4"`` -> ``(5, 10, 4)``;
    suffixes such as ``.dev0`` or ``+cu132`` are dropped).

    Example:
        >>> release("5.9.0") < release("5.10.0.dev0")
        True
    """
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])

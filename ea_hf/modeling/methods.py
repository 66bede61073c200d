"""The registry of evolution methods: how each ``method`` of the settings builds a layer's evolution module.

A method is a subclass of :class:`~.evolution.AttentionMapEvolution` with a ``from_settings`` constructor;
adding one is a class in its own file and an entry here (and its name in ``settings.METHODS``).

This file is copied beside the weights of saved EA checkpoints (``trust_remote_code``): it imports only torch,
transformers and sibling files (single-dot relative imports).
"""

from __future__ import annotations

from .echo import EchoAttention
from .evolution import AttentionMapEvolution

#: Module class of each evolution method. ``residual`` is the convolution module without a convolution, ``linear``
#: the convolution module without the ReLU.
EVOLUTION_METHODS: dict[str, type[AttentionMapEvolution]] = {
    "conv": AttentionMapEvolution,
    "residual": AttentionMapEvolution,
    "echo": EchoAttention,
    "linear": AttentionMapEvolution,
}

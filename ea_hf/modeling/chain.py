"""The per-call chain: how one layer's attention logits reach the next layer of its stack.

A_logit_i reaches layer i+1 through a dict that lives for one forward call of the layer stack: a forward
pre-hook on the stack (:func:`start_chain`) puts a fresh dict into the keyword arguments that transformers
hands down to every attention call. Nothing is kept on the modules, so concurrent calls are independent, and
gradient checkpointing (non-reentrant) replays a layer against the very tensors of the original call.

This file is copied beside the weights of saved EA checkpoints (``trust_remote_code``): it imports only torch,
transformers and sibling files (single-dot relative imports).
"""

from __future__ import annotations

from typing import Any

from torch import nn

#: Keyword argument that carries the per-call chain of attention logits down to the attention calls.
CHAIN_KWARG = "evolving_attention_chain"
#: Chain entry with the decoder's real (non-padding) query rows, for the cross-attention convolution.
DECODER_ROWS_KEY = "decoder_rows"
#: Position in chain keys of the logits of modules shared across layers (ALBERT): the last call's.
SHARED_LAYERS = "shared"
#: Chain entry that says whether layers of the stack may be replayed (gradient checkpointing).
REPLAYS_KEY = "replays"
#: Chain entry with the previous layer's logits once consumed without autograd: the attention function may
#: write this layer's probabilities into them instead of allocating a new map.
SPARE_KEY = "spare"
#: Chain entry with a layer's attention weights once returned without autograd: the next layer may write its
#: product QK^T into them instead of allocating a new map (see attention.spare_map).
SPENT_WEIGHTS_KEY = "spent_weights"
#: Chain entry with the maps a layer's backward has spent, for the next layer down to recompute its P into
#: (see attention_core.leave_spare_map): one dict per call, emptied when the backward pass ends.
BACKWARD_SPARES_KEY = "backward_spares"


def start_chain(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """Forward pre-hook for a layer stack: give this call its own, empty chain of attention logits.

    The chain records whether layers of the stack may be replayed (gradient checkpointing): only then must it
    keep every layer's logits until backward.
    """
    replays = module.training and any(getattr(m, "gradient_checkpointing", False) for m in module.modules())
    kwargs[CHAIN_KWARG] = {REPLAYS_KEY: replays}
    return args, kwargs

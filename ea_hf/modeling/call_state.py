"""The per-call state of a layer stack: the dict (the "chain") that carries one layer's attention logits to the
next layer of its stack, with what the layers of one forward call share.

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
#: product QK^T into them instead of allocating a new map (see map_reuse.spare_map).
SPENT_WEIGHTS_KEY = "spent_weights"
#: Chain entry with the maps a layer's backward has spent, for the next layer down to recompute its P into
#: (see map_reuse.leave_spare_map): one dict per call, emptied when the backward pass ends.
BACKWARD_SPARES_KEY = "backward_spares"
#: Chain entry with the ``position_ids`` the stack was called with, where it got no attention mask: transformers
#: then looks for packed sequences in them (documents whose positions restart), see packing.py.
POSITIONS_KEY = "position_ids"
#: Chain entry that says whether the call's attention weights may be read (attention.weights_read_in_call), as
#: its first evolving layer found it: replays of its layers in backward see the same.
WEIGHTS_READ_KEY = "weights_read"
#: Chain entry with the call's packed-sequence layout (packing.Packing), found by its first evolving layer and
#: shared by the others, so that every layer's map, and the map passed between layers, has the same layout.
PACKING_KEY = "packing"


def start_chain(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """Forward pre-hook for a layer stack: give this call its own, empty chain of attention logits.

    The chain records whether layers of the stack may be replayed (gradient checkpointing): only then must it
    keep every layer's logits until backward; and the position ids of a call without an attention mask, where
    several documents may be packed in one row (see packing.py).
    """
    replays = module.training and any(getattr(m, "gradient_checkpointing", False) for m in module.modules())
    chain = {REPLAYS_KEY: replays}
    # transformers' own rule for packed sequences (masking_utils._preprocess_mask_arguments): position ids and no
    # attention mask. Only kept here; whether they are packed is found where a layer needs to know.
    if kwargs.get("position_ids") is not None and kwargs.get("attention_mask") is None:
        chain[POSITIONS_KEY] = kwargs["position_ids"]
    if isinstance(kwargs.get("logits_to_keep"), int):
        # A stack told which positions' logits will be kept may run its later layers on those rows alone (Gemma
        # 4's KV-sharing layers, in generate's first step): their maps would lack the rows that their convolution
        # and the next layer read, and their caches the rows the next steps convolve. It runs on every position
        # (and returns them all; the causal-LM head keeps its own).
        kwargs["logits_to_keep"] = 0
    kwargs[CHAIN_KWARG] = chain
    return args, kwargs

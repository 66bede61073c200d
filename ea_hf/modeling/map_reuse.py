"""Reuse of spent [B, H, Q, K] maps: a map the layers no longer read takes the next map instead of a fresh
allocation, whose first touch costs page faults (see :func:`spare_map`).

In inference (no autograd) a layer writes its probabilities into the previous layer's logits (:func:`spare_map`)
and its product QK^T into the previous layer's attention weights (:func:`spent_weights`); in backward each layer
leaves its spent S map for the layer below to recompute P into (:func:`leave_spare_map`). Only maps that nothing
else holds are reused: reference counts and torch's storage count say so.

This file is copied beside the weights of saved EA checkpoints (``trust_remote_code``): it imports only torch,
transformers and sibling files (single-dot relative imports).
"""

from __future__ import annotations

import sys

import torch

from .call_state import SPARE_KEY, SPENT_WEIGHTS_KEY
from .scores import plain_scores, scores_stand_in

#: Smallest attention weights (bytes) that the next layer's product QK^T is written into: glibc's default mmap
#: threshold, from which malloc may serve a new map with fresh pages (page faults on first touch). Smaller maps
#: come back from its free lists, where taking them would cost a decoding step more than it saves (see
#: docs/performance.md, "Choices in the hot path").
SPENT_WEIGHTS_MIN_BYTES = 128 * 1024


def spare_map(chain: dict | None, like: torch.Tensor, key: str = SPARE_KEY) -> torch.Tensor | None:
    """Takes a spent map out of ``chain`` (under ``key``: the previous layer's logits, which nothing reads any
    more, for this layer's probabilities; under ``SPENT_WEIGHTS_KEY`` the previous layer's attention weights, for
    this layer's product QK^T) and returns it where a map like ``like`` may be written into it: without autograd
    and outside compilation, with the shape, dtype and device of ``like``, and held by nothing else.

    Without autograd the previous layer's maps are dead once this layer has mixed in its logits and its caller
    has dropped its weights; reusing their storage spares the allocator a fresh [B, H, Q, K] map per layer,
    whose first touch costs page faults that weigh as much as the convolution on long sequences. Nothing else
    may hold the map: not the tensor object (a forward hook on the evolution module may have kept it, a caller
    that asked for the attentions keeps the weights) and not a view of its storage. The references are counted
    here, right after the map leaves the chain, so the functions that use it may pass it on freely.
    """
    spare = None if chain is None else chain.pop(key, None)
    # Compiling first: dynamo reads it as a constant and stops there, never tracing the reference count (a
    # graph break); a compiled graph plans its own buffers anyway.
    if spare is None or torch.compiler.is_compiling() or torch.is_grad_enabled():
        return None
    reusable = (
        sys.getrefcount(spare) == LOCAL_REFERENCES
        and spare.shape == like.shape
        and spare.dtype == like.dtype
        and spare.device == like.device
        and spare.is_contiguous()
        and sole_storage_user(spare)
    )
    return spare if reusable else None


def local_references() -> int:
    """What ``sys.getrefcount`` gives for an object that only a local name holds, once taken out of a dict."""
    holder = {SPARE_KEY: object()}
    taken = holder.pop(SPARE_KEY)
    return sys.getrefcount(taken)


#: References to a map that only :func:`spare_map`'s local name holds (interpreter-dependent, so measured).
LOCAL_REFERENCES = local_references()


def storage_users(tensor: torch.Tensor) -> int | None:
    """The reference count of ``tensor``'s storage as torch keeps it (None where torch does not expose it)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return None
    # Held while counted: a temporary's reference may already be gone (torch 2.8) or not (2.13).
    storage = tensor.untyped_storage()
    return use_count(storage._cdata)


def measured_sole_storage_users() -> int | None:
    """What :func:`storage_users` gives for a tensor that is its storage's only user (2: the tensor and the
    storage object held while counting), or None where the private count cannot be trusted: it must be small and
    grow by one with a view. Measured rather than assumed, as it is a private function of torch's."""
    alone, shared = torch.empty(1), torch.empty(1)
    view = shared[:]  # noqa: F841 - held while counted
    sole, with_view = storage_users(alone), storage_users(shared)
    if sole is None or with_view is None or not 0 < sole < 8 or with_view != sole + 1:
        return None
    return sole


#: :func:`storage_users` of a tensor that is its storage's only user, measured (None: unknown, never reuse).
SOLE_STORAGE_USERS = measured_sole_storage_users()


def sole_storage_user(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is the only tensor using its storage (no views or aliases of it exist).

    Example:
        >>> whole = torch.zeros(4)
        >>> sole_storage_user(whole), sole_storage_user(whole[1:])
        (True, False)
    """
    return SOLE_STORAGE_USERS is not None and tensor._base is None and storage_users(tensor) == SOLE_STORAGE_USERS


def writes_into_weights(
    chain: dict | None, query: torch.Tensor, position_bias: torch.Tensor | None, softcap: float | None
) -> bool:
    """Whether a layer's product QK^T may go into the previous layer's attention weights, and its own weights be
    left in ``chain`` for the next layer (:func:`spent_weights`, :func:`leave_spent_weights`): without autograd,
    where S is the plain product (:func:`~.scores.plain_scores`). Elsewhere (a positional bias, soft-capping,
    half precision) the chain holds no weights: no layer would take them, and holding them would keep one more
    map alive through the next layer.

    Example:
        >>> with torch.no_grad():
        ...     writes_into_weights({}, torch.randn(1, 2, 3, 4), None, None)
        True
    """
    return chain is not None and not torch.is_grad_enabled() and plain_scores(query, position_bias, softcap)


def spent_weights(chain: dict, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """The attention weights that the previous layer left in ``chain`` (:func:`leave_spent_weights`), where this
    layer's product of ``query`` and ``key`` may be written into them (see :func:`spare_map`), else None."""
    if SPENT_WEIGHTS_KEY not in chain:
        return None
    return spare_map(chain, scores_stand_in(query, key, query.dtype), SPENT_WEIGHTS_KEY)


def leave_spent_weights(chain: dict, weights: torch.Tensor | None) -> None:
    """Leave a layer's attention ``weights`` in ``chain`` for the next layer's product (:func:`spent_weights`),
    where they are at least :data:`SPENT_WEIGHTS_MIN_BYTES`."""
    if weights is not None and weights.numel() * weights.element_size() >= SPENT_WEIGHTS_MIN_BYTES:
        chain[SPENT_WEIGHTS_KEY] = weights


def _map_key(tensor: torch.Tensor) -> tuple:
    return tuple(tensor.shape), tensor.dtype, tensor.device


def leave_spare_map(spare_maps: dict | None, spent: torch.Tensor) -> None:
    """Leave ``spent``, a map a layer's backward allocated and reads no more, in its call's ``spare_maps`` for the
    next layer down to recompute P into (:func:`take_spare_map`): a training step's backward then allocates one
    fresh [B, H, Q, K] map a layer (G) instead of two, and fresh maps are pages the C library may have given back
    to the system, touched anew (page faults; see bench/README.md). At most one map of a shape is left, and the
    dict is emptied when the backward pass ends, so that none outlives it (nothing is left outside a pass).

    Example:
        >>> spares = {}
        >>> leave_spare_map(spares, torch.empty(2, 3)), spares  # not inside a backward pass: nothing is left
        (None, {})
    """
    if spare_maps is None or torch.compiler.is_compiling():
        return
    try:
        torch.autograd.Variable._execution_engine.queue_callback(spare_maps.clear)
    except RuntimeError:  # outside the autograd engine's pass, where no callback can empty the dict later
        return
    spare_maps[_map_key(spent)] = spent


def take_spare_map(spare_maps: dict | None, like: torch.Tensor) -> torch.Tensor | None:
    """The map of ``like``'s shape, dtype and device that an upper layer's backward left in ``spare_maps``
    (:func:`leave_spare_map`), taken out of it, or None."""
    return None if spare_maps is None else spare_maps.pop(_map_key(like), None)

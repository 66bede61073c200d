"""The transformers attention function of evolving attention and its registration (``AttentionInterface``).

``evolving_attention_forward`` computes S (scaled QK^T plus any positional bias), lets the module's
:class:`~.evolution.AttentionMapEvolution` evolve it, masks, and applies softmax and dropout. Attention
modules without one (layers or attention roles left out of the patch) get plain eager attention.

This file is copied beside the weights of saved EA checkpoints (``trust_remote_code``): it imports only torch,
transformers and sibling files (single-dot relative imports).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .attention_core import (
    attend_values,
    attention_scores,
    attention_weights_read,
    evolution_maps,
    full_precision,
    fused_attention_tail,
    masked_logits,
    plain_scores,
    scores_stand_in,
    softmax_probabilities,
)
from .chain import CHAIN_KWARG, SPARE_KEY, SPENT_WEIGHTS_KEY, WEIGHTS_READ_KEY
from .history import convolution_history
from .masks import convolution_mask, evolving_attention_mask, split_attention_mask
from .packing import find_packing

#: Name under which the attention function and its mask function are registered in transformers.
ATTENTION_IMPLEMENTATION = "evolving_attention"
#: Attribute of a patched attention module that holds its :class:`AttentionMapEvolution`.
MODULE_ATTRIBUTE = "evolving_attention"
#: Keyword argument that carries the KV cache (if any) down to the attention calls of causal layers.
CACHE_KWARG = "evolving_attention_cache"
#: Smallest attention weights (bytes) that the next layer's product QK^T is written into: glibc's default mmap
#: threshold, from which malloc may serve a new map with fresh pages (page faults on first touch). Smaller maps
#: come back from its free lists, and taking them costs a decoding step about 7 us a layer (AMD EPYC).
SPENT_WEIGHTS_MIN_BYTES = 128 * 1024


def evolving_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    position_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers attention function (``attn_implementation="evolving_attention"``).

    Attention modules without an :class:`AttentionMapEvolution` (layers or attention roles left out of the patch) get
    plain eager attention, so a whole model can use this one implementation. ``position_bias`` (T5's relative
    position bias) is part of the logits S that evolve. Grouped-query attention (fewer key/value heads than
    query heads) gives each query head its own map, and so the convolution its channels, as eager attention
    does, but the keys and values are not copied per query head: each key/value head serves its group of query
    heads in one product (see :func:`~.attention_core.grouped_product`), forward and backward.

    ``softcap`` (Gemma 2's logit soft-capping, ``tanh(S / cap) * cap``) applies to S before the evolution:
    S is then exactly the pretrained layer's logits, the maps passed between layers stay in the capped range,
    and alpha = beta = 0 reproduces the model. The evolved logits themselves are not capped again (the
    convolution branch may leave the range; its weights are trained with the model). Returns the output
    [B, Q, H, D] and the (evolved) attention probabilities [B, H, Q, K].

    A packed call (several documents in a row: restarting position ids that transformers masked apart, or
    flash-style ``cu_seq_lens_q`` / ``cu_seq_lens_k``) attends to each document on its own, in the padded layout of
    :mod:`.packing`, so that the convolution reads nothing across a document's boundary; it returns None for
    the attention probabilities, as sdpa and flash attention do (each document's map has its own size).
    """
    evolution = getattr(module, MODULE_ATTRIBUTE, None)
    if evolution is not None:
        chain, cache = kwargs.get(CHAIN_KWARG), kwargs.get(CACHE_KWARG)
        packing = find_packing(evolution.role, query, key, attention_mask, chain, cache, kwargs)
        if packing is not None:
            position_bias = None if position_bias is None else packing.maps(position_bias)
            tokens = (packing.tokens(states) for states in (query, key, value))
            mask = packing.mask(attention_mask)
            # Without the cache: a packed call keeps no convolution rows to decode on from (see find_packing).
            kwargs[CACHE_KWARG] = None
            output, _ = attend(module, *tokens, mask, scaling, dropout, position_bias, softcap, **kwargs)
            return packing.restore(output), None
    return attend(module, query, key, value, attention_mask, scaling, dropout, position_bias, softcap, **kwargs)


def attend(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    position_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`evolving_attention_forward` of a batch whose rows are one sequence each (padded or not)."""
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    allowed, additive = split_attention_mask(attention_mask)
    dropout = dropout if module.training else 0.0
    evolution = getattr(module, MODULE_ATTRIBUTE, None)
    chain = kwargs.get(CHAIN_KWARG)
    if evolution is not None:
        if kwargs.get("is_causal") and not evolution.causal:
            # CLIP's text tower: a causal mask through a module whose is_causal is false, so it was taken for
            # encoder attention. Row i of a full kernel reads row i + 1, whose keys reach token i + 1.
            raise RuntimeError(
                f"{type(module).__name__} attends causally (is_causal=True) but its module says it is not causal, "
                "so it was patched as bidirectional encoder attention, whose convolution would read later tokens."
            )
        cache = kwargs.get(CACHE_KWARG)
        query_length = query.shape[-2]
        if cache is None and evolution.role == "decoder" and key.shape[-2] != query_length:
            # Self-attention to keys from earlier steps, but no cache handed on (see pass_cache): the convolution
            # would miss the rows of those steps and silently compute another model.
            raise RuntimeError(
                f"{type(module).__name__} attends to {key.shape[-2]} keys from {query_length} queries, but its KV "
                f"cache did not reach evolving attention: the module takes it under none of {CACHE_ARGUMENTS}."
            )
        past = 0 if cache is None else cache.get_seq_length() - query_length
        history = None
        if cache is not None and evolution.causal and evolution.beta != 0.0:
            history = convolution_history(cache, evolution.key, past)
        conv_mask = convolution_mask(evolution.role, allowed, query_length, past, chain if chain is not None else {})
        if evolution.fuses_attention(history):
            output, probs = evolution.attend(
                query,
                key,
                value,
                conv_mask,
                allowed,
                additive,
                chain,
                history,
                scaling=scaling,
                dropout=dropout,
                position_bias=position_bias,
                softcap=softcap,
                # Sinks rescale the weights (join_sinks); elsewhere only transformers' recording reads them.
                weights_read=kwargs.get("s_aux") is not None or weights_read_in_call(chain),
            )
            if kwargs.get("s_aux") is not None:
                output, probs = join_sinks(output, probs, chain[evolution.key], allowed, additive, kwargs["s_aux"])
            return output.transpose(1, 2).contiguous(), probs
    # Without autograd, where S is the plain product: QK^T goes into the previous layer's attention weights where
    # nobody kept them, and this layer's probabilities into the previous layer's logits (spare_map), so a stack of
    # layers allocates its two maps in its first layer and none in the others. Elsewhere (a positional bias,
    # soft-capping, half precision) the chain holds no weights: no layer would take them, and holding them would
    # keep one more map alive through the next layer.
    writes_into_weights = (
        chain is not None and not torch.is_grad_enabled() and plain_scores(query, position_bias, softcap)
    )
    spent = None
    if writes_into_weights and SPENT_WEIGHTS_KEY in chain:
        spent = spare_map(chain, scores_stand_in(query, key, query.dtype), SPENT_WEIGHTS_KEY)
    scores = attention_scores(query, key, scaling, position_bias, softcap, out=spent)
    spare = tail = None
    if evolution is not None:
        scores = evolution(evolution_maps(scores, evolution.weight), conv_mask, chain, history, query=query, past=past)
        # Inference where nobody reads the weights: a fused tail (see the attention core) may take the softmax
        # and the product without forming P.
        inference = dropout == 0.0 and not torch.is_grad_enabled()
        if inference and kwargs.get("s_aux") is None and not attention_weights_read():
            tail = fused_attention_tail(scores, allowed, additive, value)
        spare = None if tail is not None else spare_map(chain, scores)
    if tail is not None:
        (output, _), probs = tail.forward(scores, allowed, additive, value, None, 1.0), None
    else:
        output, probs, _, _ = attend_values(scores, allowed, additive, value, dropout, out=spare)
    if kwargs.get("s_aux") is not None:
        output, probs = join_sinks(output, probs, scores, allowed, additive, kwargs["s_aux"])
    if (
        writes_into_weights
        and probs is not None
        and evolution is not None
        and probs.numel() * probs.element_size() >= SPENT_WEIGHTS_MIN_BYTES
    ):
        chain[SPENT_WEIGHTS_KEY] = probs
    return output.transpose(1, 2).contiguous(), probs


def join_sinks(
    output: torch.Tensor,
    probs: torch.Tensor,
    logits: torch.Tensor,
    allowed: torch.Tensor | None,
    additive: torch.Tensor | None,
    sinks: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention sinks (GPT-OSS's ``s_aux``): a learned logit per head joins each row's softmax as one more
    column, which has no value and which the convolution never reads (it is no entry of the map).

    The sink takes its share of each row's mass: P_ij = exp(L_ij) / (sum_k exp(L_ik) + exp(sink)) is the softmax
    over the keys alone times the share the keys keep, sigmoid(logsumexp_k L_ik - sink). So the ``output``
    [B, H, Q, D] and the ``probs`` [B, H, Q, K] of the softmax without the sink, times that share, are the
    layer's; ``logits`` are the unmasked (evolved) logits that softmax read.
    """
    share = SinkShare.apply(logits, sinks, allowed, additive).unsqueeze(-1)
    if torch.is_grad_enabled():
        return output * share.to(output.dtype), probs * share.to(probs.dtype)
    return output.mul_(share), probs.mul_(share)


class SinkShare(torch.autograd.Function):
    """sigmoid(logsumexp over the keys of the masked logits [B, H, Q, K] - the head's sink [H]) [B, H, Q]: the
    share of each row's softmax mass that its keys keep beside the sink (see :func:`join_sinks`).

    Backward recomputes the softmax from the logits, which the chain holds anyway: autograd through logsumexp
    would keep a masked copy of the map for each layer.
    """

    @staticmethod
    def forward(ctx, logits, sinks, allowed, additive):
        rows = torch.logsumexp(masked_logits(full_precision(logits), allowed, additive), -1)
        share = torch.sigmoid(rows - sinks.to(rows.dtype).view(-1, 1))
        ctx.save_for_backward(logits, allowed, additive, share)
        ctx.sinks_dtype = sinks.dtype
        return share

    @staticmethod
    def backward(ctx, grad_share):
        logits, allowed, additive, share = ctx.saved_tensors
        slope = grad_share * share * (1.0 - share)  # d share / d(logsumexp - sink)
        grad_logits = grad_sinks = None
        if ctx.needs_input_grad[0]:  # d logsumexp / d L = softmax(L)
            probabilities = softmax_probabilities(logits, allowed, additive)
            grad_logits = probabilities.mul_(slope.unsqueeze(-1)).to(logits.dtype)
        if ctx.needs_input_grad[1]:
            grad_sinks = slope.sum((0, 2)).neg_().to(ctx.sinks_dtype)
        return grad_logits, grad_sinks, None, None


def weights_read_in_call(chain: dict | None) -> bool:
    """:func:`~.attention_core.attention_weights_read` as the call's first evolving layer found it, kept in
    ``chain``. Gradient checkpointing replays a layer in backward, after transformers' recording of the outputs
    has ended, where the weights would count as read: the replay would take the torch tail where the forward took
    a fused one, save other tensors, and checkpointing refuses a replay that saves a different number.

    Example:
        >>> chain = {}
        >>> weights_read_in_call(chain), chain
        (True, {'weights_read': True})
    """
    if chain is None:  # a layer called on its own: the evolution says so (previous_logits) once this returns
        return attention_weights_read()
    if WEIGHTS_READ_KEY not in chain:
        chain[WEIGHTS_READ_KEY] = attention_weights_read()
    return chain[WEIGHTS_READ_KEY]


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


def pass_cache(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """Forward pre-hook for a causal attention module: hand its KV cache on to the attention function.

    Attention modules consume the cache themselves; the convolution needs it too, to keep the earlier rows of
    its input between decoding steps. The architectures name the argument differently (``past_key_values``,
    ``cache`` from transformers 5.24 on, GPT-NeoX's ``layer_past``), so whichever of :data:`CACHE_ARGUMENTS`
    holds one is handed on.
    """
    cache = next((kwargs[name] for name in CACHE_ARGUMENTS if kwargs.get(name) is not None), None)
    if cache is not None:
        kwargs[CACHE_KWARG] = cache
    return args, kwargs


#: The keyword arguments under which attention modules receive their KV cache (see :func:`pass_cache`).
CACHE_ARGUMENTS = ("cache", "past_key_values", "layer_past")


def register_attention() -> None:
    """Register the attention and mask functions with transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_IMPLEMENTATION, evolving_attention_forward)
    AttentionMaskInterface.register(ATTENTION_IMPLEMENTATION, evolving_attention_mask)


register_attention()

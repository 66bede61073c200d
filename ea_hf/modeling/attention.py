"""The transformers attention function of evolving attention and its registration (``AttentionInterface``).

:func:`evolving_attention_forward` computes S (scaled QK^T plus any positional bias), lets the module's
:class:`~.evolution.AttentionMapEvolution` evolve it, masks, and applies softmax and dropout. Attention
modules without one (layers or attention roles left out of the patch) get plain eager attention. With autograd
a layer runs as one node, the attention core (:mod:`.attention_core`); the other pieces are siblings: S and its
products (:mod:`.scores`), the mask, softmax, dropout and the product with the values (:mod:`.attention_tail`),
the reuse of spent maps (:mod:`.map_reuse`), attention sinks (:mod:`.sinks`) and the fused kernels' registries
(:mod:`.kernels`).

This file is copied beside the weights of saved EA checkpoints (``trust_remote_code``): it imports only torch,
transformers and sibling files (single-dot relative imports).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

try:  # where transformers' output recording says which outputs the running forward pass records
    from transformers.utils.output_capturing import _active_collector
except ImportError:  # pragma: no cover - a transformers without it (see attention_weights_read)
    _active_collector = None

from .attention_tail import attend_values
from .call_state import CHAIN_KWARG, WEIGHTS_READ_KEY
from .evolution import AttentionMapEvolution
from .history import (
    ConvolutionHistory,
    StaticConvolutionHistory,
    convolution_history,
    static_convolution_history,
    static_layout,
)
from .kernels import FusedAttentionTail, fused_attention_tail
from .map_reuse import leave_spent_weights, spare_map, spent_weights, writes_into_weights
from .masks import AttentionMask, convolution_mask, evolving_attention_mask, split_attention_mask
from .packing import find_packing
from .scores import attention_scores, evolution_maps
from .sinks import join_sinks

ATTENTION_IMPLEMENTATION = "evolving_attention"
"""Name under which the attention function and its mask function are registered in transformers: a patched
model's ``config._attn_implementation``."""
#: Attribute of a patched attention module that holds its :class:`AttentionMapEvolution`.
MODULE_ATTRIBUTE = "evolving_attention"
#: Keyword argument that carries the KV cache (if any) down to the attention calls of causal layers.
CACHE_KWARG = "evolving_attention_cache"


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
    heads in one product (see :func:`~.scores.grouped_product`), forward and backward.

    ``softcap`` (Gemma 2's logit soft-capping, ``tanh(S / cap) * cap``) applies to S before the evolution:
    S is then exactly the pretrained layer's logits, the maps passed between layers stay in the capped range,
    and alpha = beta = 0 reproduces the model. The evolved logits themselves are not capped again (the
    convolution branch may leave the range; its weights are trained with the model).

    A packed call (several documents in a row: restarting position ids that transformers masked apart, or
    flash-style ``cu_seq_lens_q`` / ``cu_seq_lens_k``) attends to each document on its own, in the padded layout of
    :mod:`.packing`, so that the convolution reads nothing across a document's boundary.

    Args:
        module: the attention module that calls it; its :class:`~.evolution.AttentionMapEvolution`, if any, is
            its ``evolving_attention`` attribute.
        query: the queries [B, H, Q, D].
        key: the keys [B, H_kv, K, D] (H_kv divides H: grouped-query attention).
        value: the values [B, H_kv, K, D].
        attention_mask: transformers' mask for eager attention ([B, 1, Q, K], additive or bool), or None.
        scaling: the factor of the logits (``None``: 1 / sqrt(D)).
        dropout: the dropout probability on the attention weights (only in training mode).
        position_bias: T5's relative position bias, added to the logits S before they evolve.
        softcap: Gemma 2's logit soft-capping, applied to S before the evolution.
        **kwargs: what transformers passes the attention functions (the cache, position ids, the packing's
            ``cu_seq_lens_*``, ``s_aux`` of attention sinks) and the chain that the model's hooks add.

    Returns:
        The output [B, Q, H, D] and the (evolved) attention probabilities [B, H, Q, K]; a packed call returns
        None for the probabilities, as sdpa and flash attention do (each document's map has its own size).
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`evolving_attention_forward` of a batch whose rows are one sequence each (padded or not)."""
    scaling = query.size(-1) ** -0.5 if scaling is None else scaling
    mask = split_attention_mask(attention_mask)
    dropout = dropout if module.training else 0.0
    evolution, chain, sinks = getattr(module, MODULE_ATTRIBUTE, None), kwargs.get(CHAIN_KWARG), kwargs.get("s_aux")
    call = None if evolution is None else evolving_call(module, evolution, query, key, mask, kwargs)
    if call is not None and evolution.fuses_attention(call.history):
        output, probs = evolution.attend(
            query, key, value, call.conv_mask, mask, chain, call.history, scaling=scaling, dropout=dropout,
            position_bias=position_bias, softcap=softcap,
            # Sinks rescale the weights (join_sinks); elsewhere only transformers' recording reads them.
            weights_read=sinks is not None or weights_read_in_call(chain),
        )  # fmt: skip
        logits = None if sinks is None else chain[evolution.key]
    else:
        # Without autograd, where S is the plain product, QK^T goes into the previous layer's attention weights
        # where nobody kept them, and this layer's probabilities into the previous layer's logits (spare_map), so
        # a stack of layers allocates its two maps in its first layer and none in the others.
        writes = writes_into_weights(chain, query, position_bias, softcap)
        spent = spent_weights(chain, query, key) if writes else None
        logits = attention_scores(query, key, scaling, position_bias, softcap, out=spent)
        tail = spare = None
        if call is not None:
            logits = evolution(
                evolution_maps(logits, evolution.weight), call.conv_mask, chain, call.history, query=query,
                past=call.past,
            )  # fmt: skip
            tail = None if sinks is not None else inference_tail(logits, mask, value, dropout)
            spare = None if tail is not None else spare_map(chain, logits)
        if tail is not None:
            (output, _), probs = tail.forward(logits, mask.allowed, mask.additive, value, None, 1.0), None
        else:
            output, probs, _, _ = attend_values(logits, mask, value, dropout, out=spare)
        if writes and call is not None:
            leave_spent_weights(chain, probs)
    if sinks is not None:
        output, probs = join_sinks(output, probs, logits, mask, sinks)
    return output.transpose(1, 2).contiguous(), probs


class EvolvingCall(NamedTuple):
    """What an evolving layer's call finds before it attends: the convolution's input mask (``conv_mask``), the
    earlier rows of its convolution input where it decodes with a cache (``history``; else None), and the number
    of cached query positions before this call's (``past``: a tensor where a static cache's history counts them)."""

    conv_mask: torch.Tensor | None
    history: ConvolutionHistory | StaticConvolutionHistory | None
    past: int | torch.Tensor


def evolving_call(
    module: nn.Module,
    evolution: AttentionMapEvolution,
    query: torch.Tensor,
    key: torch.Tensor,
    mask: AttentionMask,
    kwargs: dict[str, Any],
) -> EvolvingCall:
    """The :class:`EvolvingCall` of ``module``'s call (``kwargs``: the attention function's keyword arguments), or
    an error where the call would silently compute another model."""
    chain, cache = kwargs.get(CHAIN_KWARG), kwargs.get(CACHE_KWARG)
    if kwargs.get("is_causal") and not evolution.causal:
        # CLIP's text tower: a causal mask through a module whose is_causal is false, so it was taken for
        # encoder attention. Row i of a full kernel reads row i + 1, whose keys reach token i + 1.
        raise RuntimeError(
            f"{type(module).__name__} attends causally (is_causal=True) but its module says it is not causal, "
            "so it was patched as bidirectional encoder attention, whose convolution would read later tokens."
        )
    query_length = query.shape[-2]
    if cache is None and evolution.role == "decoder" and key.shape[-2] != query_length:
        # Self-attention to keys from earlier steps, but no cache handed on (see pass_cache): the convolution
        # would miss the rows of those steps and silently compute another model.
        raise RuntimeError(
            f"{type(module).__name__} attends to {key.shape[-2]} keys from {query_length} queries, but its KV "
            f"cache did not reach evolving attention: the module takes it under none of {CACHE_ARGUMENTS}."
        )
    keeps_rows = cache is not None and evolution.causal and evolution.may_convolve()
    if keeps_rows and static_layout(cache):
        # A static cache (torch.compile's): the tokens seen are a tensor of the kept rows, not read on the host.
        history = static_convolution_history(cache, evolution.key, query_length, evolution.context_rows)
        past = 0 if history.seen_tokens is None else history.seen_tokens.clone()
    else:
        past = 0 if cache is None else cache.get_seq_length() - query_length
        history = convolution_history(cache, evolution.key, past) if keeps_rows else None
    conv_mask = convolution_mask(evolution.role, mask.allowed, query_length, past, chain if chain is not None else {})
    return EvolvingCall(conv_mask, history, past)


def inference_tail(
    logits: torch.Tensor, mask: AttentionMask, value: torch.Tensor, dropout: float
) -> FusedAttentionTail | None:
    """The fused attention tail (see :mod:`.kernels`) that may take the softmax and the product without forming P
    in inference where nobody reads the weights, or None."""
    if dropout == 0.0 and not torch.is_grad_enabled() and not attention_weights_read():
        return fused_attention_tail(logits, mask, value)
    return None


def attention_weights_read() -> bool:
    """Whether the attention weights of the running forward pass may be read: a fused attention tail never forms
    them. transformers records them (``output_attentions``) through hooks that its ``capture_outputs`` sets up,
    with the outputs wanted in a context variable; where no such record is running, or transformers keeps it
    elsewhere, the weights count as read.

    Example:
        >>> attention_weights_read()  # outside a model's forward nothing says they are not
        True
    """
    if _active_collector is None:  # pragma: no cover - a transformers without it: assume the weights are read
        return True
    collected = _active_collector.get()
    return not isinstance(collected, dict) or any(name.endswith("attentions") for name in collected)


def weights_read_in_call(chain: dict | None) -> bool:
    """:func:`attention_weights_read` as the call's first evolving layer found it, kept in
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

"""One evolving attention layer's core as a single autograd node that keeps one map for backward (three where
the maps are small).

For S = QK^T * scaling (+ positional bias, soft-capped), the evolution A_logit = beta * ReLU(Conv(A_in * keep))
+ (1 - beta) * A_in with A_in = lerp(S, A_prev, alpha), P = softmax(A_logit + mask), dropout and P @ V,
autograd through the separate steps keeps S, the ReLU gate and P for every layer, and A_logit lives on as the
next layer's A_prev: three and a quarter [B, H, Q, K] maps where eager attention keeps one (P). At N = 512
that makes a training step need about 1.5x eager attention's memory.

:class:`EvolvingAttentionCore` keeps only A_logit (which the next layer keeps anyway), the ReLU gate (bit-packed on
the CPU kernel) and dropout's bool mask, and recomputes the rest in backward: S from Q and K (a matmul) and P from
A_logit and the mask (a softmax, bit-identical to the forward one). Backward then runs the same gradient steps
autograd would (the shared :func:`~.convolution.evolve_backward` for the evolution). The recomputation costs about
one QK^T matmul and one softmax per layer and step.

Where the maps are small, S and P are kept instead (:func:`keeps_small_maps`): when a map is no larger than
the layer's keys and values, which the core keeps anyway (N <= 2 * head_dim for self-attention: N <= 128 with
64-dimensional heads), two more maps cost at most twice as much memory as those. Backward then saves the matmul
and the softmax. On BERT-Base at N = 128, batch 8 (Intel Xeon, profiler), keeping S saves about 30 ms of a
1.8 s training step and keeping P about 10 ms more.

Where nobody reads the attention weights, a fused attention tail (``ea_hf.ops.triton_attention``, on GPUs with
the Triton kernels) takes the masked softmax, dropout and the product with V flash-style, without forming P.

While ``torch.compile`` traces, :func:`compiled_core` runs the layer's operators instead, inside a selective
activation checkpoint that keeps A_logit and the gate and recomputes S and P: the maps this node keeps, in a
graph that inductor plans. Where the maps are small it keeps S as well, and recomputes P, which this node keeps.

Where S is the plain product (:func:`plain_scores`), the queries are kept contiguous and pre-scaled
(:func:`contiguous_query`: one pass where the product would copy them anyway), S is recomputed from them without
autograd, and the gradients of Q and K come from :func:`scores_backward`; a positional bias or soft-capping
goes through autograd again.

This file is copied beside the weights of saved EA checkpoints (``trust_remote_code``): it imports only torch,
transformers and sibling files (single-dot relative imports).
"""

from __future__ import annotations

import functools
import math
from typing import Protocol

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

try:  # where transformers' output recording says which outputs the running forward pass records
    from transformers.utils.output_capturing import _active_collector
except ImportError:  # pragma: no cover - a transformers without it (see attention_weights_read)
    _active_collector = None

from .convolution import evolve_backward, evolve_convolution, evolve_step, fused_kernel, scale_kernel, select_kept
from .step import EvolutionStep, GradientIn, StepMaps


class FusedAttentionTail(Protocol):
    """What a fused implementation of the attention tail after the evolution provides (``ea_hf.ops.triton_attention``):
    the masked softmax over the evolved logits, dropout and the product with the values, without forming P.

    ``forward`` returns (the output [B, H, Q, D] in the values' dtype, row statistics for ``backward``), masking as
    :func:`masked_logits` does and dropping where ``dropout_keep`` (bool [B, H, Q, K]) is False, the kept weights
    scaled by ``dropout_scale``; ``backward`` returns (the logits' gradient in ``grad_dtype``, the values'
    gradient) from forward's row statistics and the output's gradient (both also while torch.compile traces, as
    operators); ``attend`` returns forward's output, differentiable in the logits and the values (what
    :func:`compiled_core` calls). ``applicable`` says whether it takes these tensors.
    """

    def applicable(
        self, logits: torch.Tensor, allowed: torch.Tensor | None, additive: torch.Tensor | None, value: torch.Tensor
    ) -> bool: ...

    def forward(
        self,
        logits: torch.Tensor,
        allowed: torch.Tensor | None,
        additive: torch.Tensor | None,
        value: torch.Tensor,
        dropout_keep: torch.Tensor | None,
        dropout_scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(
        self,
        logits: torch.Tensor,
        allowed: torch.Tensor | None,
        additive: torch.Tensor | None,
        value: torch.Tensor,
        dropout_keep: torch.Tensor | None,
        dropout_scale: float,
        stats: torch.Tensor,
        grad_output: torch.Tensor,
        grad_dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def attend(
        self,
        logits: torch.Tensor,
        allowed: torch.Tensor | None,
        additive: torch.Tensor | None,
        value: torch.Tensor,
        dropout_keep: torch.Tensor | None,
        dropout_scale: float,
    ) -> torch.Tensor: ...


#: Fused attention tails, tried in order; registered by ``ea_hf.ops`` (remote-code copies of this file have none).
FUSED_ATTENTION_TAILS: list[FusedAttentionTail] = []


def register_fused_attention_tail(tail: FusedAttentionTail) -> None:
    """Use ``tail`` in :class:`EvolvingAttentionCore` wherever it says it is applicable (idempotent)."""
    if tail not in FUSED_ATTENTION_TAILS:
        FUSED_ATTENTION_TAILS.append(tail)


def fused_attention_tail(
    logits: torch.Tensor, allowed: torch.Tensor | None, additive: torch.Tensor | None, value: torch.Tensor
) -> FusedAttentionTail | None:
    """The first registered tail applicable to these tensors, or None (softmax and product as torch operations)."""
    for tail in FUSED_ATTENTION_TAILS:
        if tail.applicable(logits, allowed, additive, value):
            return tail
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


def exact_scaling(scaling: float) -> bool:
    """Whether multiplying by ``scaling`` is exact (a power of two, such as 1/8 for 64-dimensional heads): the
    queries may then be scaled instead of their product with the keys, with the same numbers.

    Example:
        >>> exact_scaling(0.125), exact_scaling(64**-0.5 * 0.9)
        (True, False)
    """
    return math.frexp(scaling)[0] == 0.5


def stacked_heads(maps: torch.Tensor, key_value_heads: int) -> torch.Tensor:
    """[B, H, Q, X] maps of the query heads as [B, H_kv, (H / H_kv) * Q, X]: the rows of the query heads that share
    a key/value head (grouped-query attention, head h with key/value head h // (H / H_kv), as
    ``repeat_interleave`` pairs them) stacked into one matrix, a view where the layout allows. An error where the
    heads cannot share the key/value heads evenly.

    Example:
        >>> stacked_heads(torch.randn(2, 6, 3, 4), 2).shape
        torch.Size([2, 2, 9, 4])
    """
    heads = maps.shape[1]
    if heads % key_value_heads:
        raise ValueError(f"{heads} query heads cannot share {key_value_heads} key/value heads evenly")
    return maps.reshape(maps.shape[0], key_value_heads, heads // key_value_heads * maps.shape[-2], maps.shape[-1])


def grouped_product(left: torch.Tensor, right: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``left @ right`` over heads, where ``right`` may have fewer heads than ``left`` (grouped-query attention:
    head h of ``left`` pairs with head h // groups of ``right``, as after ``right.repeat_interleave(groups, 1)``),
    without repeating ``right``: each of its heads takes its group of ``left``'s heads as the rows of one product.
    Written into ``out`` (contiguous, of the product's shape and dtype) where given: the same numbers.

    Repeating the keys and values copies them for every query head: in a decoding step (a ~125M Llama with 4
    key/value heads for 12 query heads, 512 cached tokens, AMD EPYC) that took longer than the two products.

    Example:
        >>> q, k = torch.randn(2, 6, 3, 4), torch.randn(2, 2, 4, 5)
        >>> torch.allclose(grouped_product(q, k), q @ k.repeat_interleave(3, dim=1), atol=1e-6)
        True
    """
    if out is not None:
        torch.matmul(stacked_heads(left, right.shape[1]), right, out=stacked_heads(out, right.shape[1]))
        return out
    if left.shape[1] == right.shape[1]:
        return torch.matmul(left, right)
    product = torch.matmul(stacked_heads(left, right.shape[1]), right)
    # Not a view (as matmul's own reshapes): the map must be its storage's only user for inference to write the
    # next layer's probabilities into it (see attention.spare_map); a view of the product would never be.
    return torch.ops.aten._unsafe_view(product, (*left.shape[:-1], right.shape[-1]))


def grouped_transposed_product(left: torch.Tensor, right: torch.Tensor, right_heads: int) -> torch.Tensor:
    """``left^T @ right`` summed over each group of heads sharing one of ``right_heads`` key/value heads: the
    gradient of the keys or values that :func:`grouped_product` shared (as autograd through
    ``repeat_interleave`` sums it), in one product per key/value head over its group's rows, ``left`` and
    ``right`` being [B, H, Q, *] maps of the query heads.

    Example:
        >>> p, g = torch.randn(2, 6, 3, 5), torch.randn(2, 6, 3, 4)
        >>> summed = (p.transpose(-1, -2) @ g).unflatten(1, (2, 3)).sum(2)
        >>> torch.allclose(grouped_transposed_product(p, g, 2), summed, atol=1e-5)
        True
    """
    if left.shape[1] == right_heads:
        return torch.matmul(left.transpose(-1, -2), right)
    return torch.matmul(stacked_heads(left, right_heads).transpose(-1, -2), stacked_heads(right, right_heads))


def attention_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    scaling: float,
    position_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """S = QK^T * scaling (+ ``position_bias``; then ``tanh(S / softcap) * softcap``), as eager attention; keys
    with fewer heads than the queries are shared by groups of query heads (see :func:`grouped_product`). The
    product is written into ``out`` where given (the same numbers): a map the caller has spent.

    Example:
        >>> q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4)
        >>> torch.allclose(attention_scores(q, k, 0.5), q @ k.transpose(-1, -2) * 0.5)
        True
    """
    if exact_scaling(scaling):
        # A power of two (1/8 for 64-dimensional heads) scales exactly: scaling the queries instead of the
        # [B, H, Q, K] product gives eager attention's numbers with one pass less over the map.
        scores = grouped_product(query * scaling if scaling != 1.0 else query, key.transpose(-1, -2), out)
    else:  # in place: the product is a fresh tensor (or ``out``) that autograd does not keep
        scores = grouped_product(query, key.transpose(-1, -2), out).mul_(scaling)
    if position_bias is not None:
        scores = scores + position_bias
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return scores


def scores_stand_in(query: torch.Tensor, key: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of S's shape [B, H, Q, K] for these queries and keys, of ``dtype`` and on their device, that holds
    no memory (one element, expanded): what a map is asked about before it is computed.

    Example:
        >>> stand_in = scores_stand_in(torch.randn(2, 3, 5, 4), torch.randn(2, 3, 7, 4), torch.float32)
        >>> stand_in.shape, stand_in.untyped_storage().nbytes()
        (torch.Size([2, 3, 5, 7]), 4)
    """
    return torch.empty((), dtype=dtype, device=query.device).expand(*query.shape[:-1], key.shape[-2])


#: Half-precision dtypes, whose maps are masked and normalised in fp32 (:func:`full_precision`).
HALF_PRECISION = (torch.float16, torch.bfloat16)


def full_precision(logits: torch.Tensor) -> torch.Tensor:
    """Half-precision logits as fp32 for the mask and softmax, as eager attention's softmax runs: fp16's mask
    value plus a negative logit overflows to -inf (a fully masked row would then give NaN)."""
    return logits.float() if logits.dtype in HALF_PRECISION else logits


def evolution_dtype(scores: torch.Tensor, weight: torch.Tensor | None) -> torch.dtype:
    """The dtype the evolution of maps like ``scores`` runs in: the maps' own (a bf16 or fp16 model evolves bf16
    or fp16 maps, half the memory and traffic of fp32 ones; the kernels accumulate in fp32), except where the
    only fused kernel for them takes fp32 maps (the CPU kernel): half-precision maps are then upcast to fp32 for
    it. The masks and the softmax read the evolved logits in fp32 either way (:func:`full_precision`).
    ``weight``: the layer's convolution weight (None: no convolution, the maps' own dtype).

    Example:
        >>> weight, maps = torch.randn(2, 2, 3, 3), torch.randn(1, 2, 4, 4)
        >>> evolution_dtype(maps, weight), evolution_dtype(maps.bfloat16(), None)
        (torch.float32, torch.bfloat16)
    """
    if scores.dtype not in HALF_PRECISION or weight is None or fused_kernel(scores, weight=weight) is not None:
        return scores.dtype
    as_float32 = torch.empty((), dtype=torch.float32, device=scores.device).expand(scores.shape)
    return torch.float32 if fused_kernel(as_float32, weight=weight) is not None else scores.dtype


def evolution_maps(scores: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """S in :func:`evolution_dtype`: itself, or an fp32 copy."""
    dtype = evolution_dtype(scores, weight)
    return scores if dtype == scores.dtype else scores.to(dtype)


def masked_logits(
    logits: torch.Tensor, allowed: torch.Tensor | None, additive: torch.Tensor | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The logits with the attention mask applied: ``additive`` added, else disallowed entries at the dtype's
    minimum (see :func:`~.masks.split_attention_mask`); written into ``out`` where given (the same numbers)."""
    if additive is not None:
        return logits + additive if out is None else torch.add(logits, additive, out=out)
    if allowed is not None:
        fill = torch.finfo(logits.dtype).min
        if out is None:
            return logits.masked_fill(~allowed, fill)
        return select_kept(logits, allowed, fill=fill, out=out)
    return logits


def softmax_probabilities(
    logits: torch.Tensor, allowed: torch.Tensor | None, additive: torch.Tensor | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """P = softmax over the keys of the masked ``logits``, into ``out`` where given: the same numbers either way,
    so that backward may recompute forward's P bit for bit. Half-precision logits are masked and normalised in
    fp32 (:func:`full_precision`), and P is fp32 (``out`` of another dtype is not used).

    On CPU, outside autograd and compilation, a mask is applied as it is written into P's map (``out``, else a
    new one) and the softmax then runs in place there: one map and one pass less than masking into a map of its
    own, which ``masked_fill`` writes slowly with a mask broadcast over the heads. The same bits, and on AMD EPYC
    (2 threads) about 40 % less time for a [2, 12, 512, 512] map with a padding mask.

    Example:
        >>> logits, allowed = torch.randn(1, 2, 3, 4), torch.rand(1, 1, 3, 4) > 0.3
        >>> expected = logits.masked_fill(~allowed, torch.finfo(logits.dtype).min).softmax(-1)
        >>> torch.equal(softmax_probabilities(logits, allowed, None), expected)
        True
    """
    logits = full_precision(logits)
    if out is not None and out.dtype != logits.dtype:
        out = None
    if (allowed is None and additive is None) or not _masks_into_probabilities(logits, allowed, additive, out):
        scores = masked_logits(logits, allowed, additive)
        return torch.softmax(scores, -1) if out is None else torch.ops.aten._softmax.out(scores, -1, False, out=out)
    out = torch.empty_like(logits, memory_format=torch.contiguous_format) if out is None else out
    masked_logits(logits, allowed, additive, out=out)
    return torch.ops.aten._softmax.out(out, -1, False, out=out)


def _masks_into_probabilities(
    logits: torch.Tensor, allowed: torch.Tensor | None, additive: torch.Tensor | None, out: torch.Tensor | None
) -> bool:
    """Whether :func:`softmax_probabilities` may write the masked logits into P's map: no autograd graph to
    record and nothing traced, a mask that broadcasts to the logits' shape, an ``out`` like the logits. On CPU,
    where aten's softmax reads each row before it writes it (checked bit for bit in the tests); GPU kernels are
    left to their own allocations."""
    mask = additive if additive is not None else allowed
    if torch.compiler.is_compiling() or logits.device.type != "cpu":
        return False
    if torch.is_grad_enabled() and (logits.requires_grad or mask.requires_grad):
        return False
    if additive is not None and torch.result_type(logits, additive) != logits.dtype:
        return False
    # The mask broadcasts to the logits' shape: a plain loop, which costs a decoding step (one query row, where
    # the maps are tiny) less than torch.broadcast_shapes.
    if mask.dim() > logits.dim():
        return False
    trailing = logits.shape[logits.dim() - mask.dim() :]
    if any(m not in (1, n) for m, n in zip(mask.shape, trailing, strict=True)):
        return False
    return out is None or (out.shape == logits.shape and out.dtype == logits.dtype)


def attend_values(
    logits: torch.Tensor,
    allowed: torch.Tensor | None,
    additive: torch.Tensor | None,
    value: torch.Tensor,
    dropout: float,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The tail every attention path shares: P = softmax over the keys of the masked ``logits`` (into ``out``
    where given), dropout and the product with ``value``. Returns (dropout(P) @ V, dropout(P) in the values'
    dtype, P in fp32 for half-precision logits (see :func:`softmax_probabilities`) else in theirs, dropout's bool
    mask or None). ``value`` may have fewer heads than the logits
    (see :func:`grouped_product`).

    Dropout is ``torch.native_dropout``: the random numbers of ``torch.nn.functional.dropout`` (which runs it on
    GPUs) and a bool mask for backward instead of a float one.

    Example:
        >>> logits, value = torch.randn(1, 2, 3, 5), torch.randn(1, 2, 5, 4)
        >>> output, weights, probabilities, mask = attend_values(logits, None, None, value, 0.0)
        >>> torch.allclose(output, logits.softmax(-1) @ value), weights is probabilities, mask is None
        (True, True, True)
    """
    probabilities = softmax_probabilities(logits, allowed, additive, out)
    weights, mask = probabilities.to(value.dtype), None
    if dropout > 0.0:
        weights, mask = dropout_with_mask(weights, dropout)
    return grouped_product(weights, value), weights, probabilities, mask


def kept_by_dropout(like: torch.Tensor, dropout: float) -> torch.Tensor:
    """The bool mask of the weights that dropout of probability ``dropout`` keeps, for maps like ``like``: the
    ``bernoulli_`` draw ``torch.native_dropout`` makes on CPU, so that under one seed both drop the same weights.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> mask = kept_by_dropout(torch.zeros(2, 3), 0.5)
        >>> _ = torch.manual_seed(0)
        >>> torch.equal(mask, torch.native_dropout(torch.ones(2, 3), 0.5, True)[1])
        True
    """
    return torch.empty_like(like, dtype=torch.bool).bernoulli_(1.0 - dropout)


def dropout_with_mask(weights: torch.Tensor, dropout: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.native_dropout(weights, dropout, True)``: (the dropped weights, the bool mask of the kept ones). On
    CPU outside autograd and compilation (the attention core's forward), the same random numbers (the mask is the
    ``bernoulli_`` draw native_dropout makes) and the same values, with the mask applied in one pass
    (:func:`~.convolution.select_kept`) instead of native_dropout's ``weights.mul(mask).mul_(scale)``: at
    [2, 12, 512, 512] (AMD EPYC, 2 threads) 1.9 against 6 to 8 ms of the 47 to 66 ms the draw itself takes.

    Example:
        >>> weights = torch.rand(2, 3, 4, 5)
        >>> _ = torch.manual_seed(0)
        >>> dropped, mask = dropout_with_mask(weights, 0.1)
        >>> _ = torch.manual_seed(0)
        >>> expected, expected_mask = torch.native_dropout(weights, 0.1, True)
        >>> torch.equal(dropped, expected), torch.equal(mask, expected_mask)
        (True, True)
    """
    recorded = torch.is_grad_enabled() and weights.requires_grad
    plain = weights.device.type == "cpu" and weights.is_contiguous() and dropout < 1.0
    if recorded or torch.compiler.is_compiling() or not plain:
        return torch.native_dropout(weights, dropout, True)
    mask = kept_by_dropout(weights, dropout)
    return select_kept(weights, mask, 1.0 / (1.0 - dropout)), mask


def plain_scores(query: torch.Tensor, position_bias: torch.Tensor | None, softcap: float | None) -> bool:
    """Whether S is the plain product in full precision (no positional bias or soft-capping, no upcast or
    autocast): :class:`EvolvingAttentionCore` then keeps the queries contiguous and pre-scaled
    (:func:`contiguous_query`), recomputes S without autograd where it is not kept, and computes the gradients of
    Q and K directly (:func:`scores_backward`).

    Example:
        >>> q = torch.randn(1, 2, 3, 4)
        >>> plain_scores(q, None, None), plain_scores(q, None, 50.0), plain_scores(q.half(), None, None)
        (True, False, False)
    """
    if position_bias is not None or softcap is not None or query.dtype in (torch.float16, torch.bfloat16):
        return False
    return not torch.is_autocast_enabled(query.device.type)


def keeps_small_maps(
    query: torch.Tensor, key: torch.Tensor, position_bias: torch.Tensor | None, softcap: float | None
) -> bool:
    """Whether :class:`EvolvingAttentionCore` keeps S and P for backward instead of recomputing them: when a
    [B, H, Q, K] map is no larger than the keys and values it keeps anyway (Q <= 2 * head_dim; with grouped-query
    attention it keeps fewer key/value heads, and the rule stays the same) and S is :func:`plain_scores`.

    Example:
        >>> q, k = torch.randn(1, 2, 128, 64), torch.randn(1, 2, 128, 64)
        >>> keeps_small_maps(q, k, None, None), keeps_small_maps(torch.randn(1, 2, 512, 64), k, None, None)
        (True, False)
    """
    return plain_scores(query, position_bias, softcap) and query.shape[-2] <= 2 * key.shape[-1]


def contiguous_query(query: torch.Tensor, scaling: float) -> tuple[torch.Tensor, float]:
    """(the queries as a contiguous tensor, scaled where :func:`exact_scaling`; the scaling left for the product)
    in one pass: the queries arrive as a view of the projection's [B, Q, H * D] output, which the product with
    the keys would copy anyway (and ``query * scaling`` keeps that layout, so it would copy the scaled queries).

    Example:
        >>> q = torch.randn(1, 3, 2, 4).transpose(1, 2)
        >>> scaled, rest = contiguous_query(q, 0.5)
        >>> scaled.is_contiguous(), torch.equal(scaled, q * 0.5), rest
        (True, True, 1.0)
    """
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if exact_scaling(scaling):
        return torch.mul(query, scaling, out=out), 1.0
    return out.copy_(query), scaling


def scores_backward(
    grad_scores: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    scaling: float,
    needs: tuple[bool, bool],
    prescaled: bool = False,
    gradient_scale: float = 1.0,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The gradients of Q and K (where ``needs`` says) of :func:`attention_scores` without bias or soft-capping,
    as autograd computes them through its operations. ``prescaled``: ``query`` is Q * scaling already (an
    :func:`exact_scaling`, see :func:`contiguous_query`). ``gradient_scale``: the gradient of S is
    ``gradient_scale * grad_scores`` (a :class:`~.step.ScaledMap`), applied to the [B, H, N, D] results.

    Example:
        >>> q, k = torch.randn(1, 2, 3, 4, requires_grad=True), torch.randn(1, 2, 5, 4, requires_grad=True)
        >>> g = torch.randn(1, 2, 3, 5)
        >>> expected = torch.autograd.grad(attention_scores(q, k, 0.5), (q, k), g)
        >>> got = scores_backward(g, q.detach(), k.detach(), 0.5, (True, True))
        >>> all(torch.allclose(a, b) for a, b in zip(got, expected))
        True
    """
    if exact_scaling(scaling):  # S = (Q * scaling) @ K^T
        grad_query = grouped_product(grad_scores, key) if needs[0] else None
        if grad_query is not None and scaling * gradient_scale != 1.0:
            grad_query.mul_(scaling * gradient_scale)  # in place: the product is a fresh tensor
        scaled_query = query * scaling if scaling != 1.0 and needs[1] and not prescaled else query
        grad_key = _key_gradient(grad_scores, scaled_query, key.shape[1]) if needs[1] else None
        if grad_key is not None and gradient_scale != 1.0:
            grad_key.mul_(gradient_scale)
        return grad_query, grad_key
    grad_product = grad_scores * (scaling * gradient_scale)  # S = (Q @ K^T) * scaling
    grad_query = grouped_product(grad_product, key) if needs[0] else None
    return grad_query, _key_gradient(grad_product, query, key.shape[1]) if needs[1] else None


def _key_gradient(grad_product: torch.Tensor, query: torch.Tensor, key_heads: int) -> torch.Tensor:
    """The gradient of K (of ``key_heads`` heads) in Q @ K^T as autograd computes it, (Q^T @ G)^T: the gradient
    of the product's right operand K^T, transposed. G^T @ Q is the same sum, but BLAS may order it differently
    (on AMD EPYC it differed from autograd's in the last bit; on Intel Xeon it did not)."""
    return grouped_transposed_product(query, grad_product, key_heads).transpose(-1, -2)


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


class EvolvingAttentionCore(torch.autograd.Function):
    """(output [B, H, Q, D], A_logit, attention weights) of one evolving attention layer, keeping A_logit, the
    ReLU gate and the dropout mask for backward (see the module docstring).

    Inputs: the layer's :class:`~.step.EvolutionStep`, ``query`` [B, H, Q, D], ``key`` and ``value``
    [B, H_kv, K, D] (grouped-query attention: each of the H_kv key/value heads serves H / H_kv query heads, see
    :func:`grouped_product`), ``previous`` (A_prev or ``None``), ``position_bias`` (or ``None``), the
    convolution's ``weight`` and ``bias``, ``conv_mask`` (bool, where entries may enter the convolution, or
    ``None``), ``allowed`` / ``additive`` (the attention mask, see :func:`~.masks.split_attention_mask`), then
    the constants ``scaling``, ``softcap`` and ``dropout`` (the probability; 0 outside training), and
    ``spare_maps`` (the call's dict of maps that backward passes down the layers, see :func:`leave_spare_map`;
    or ``None``) and ``weights_read`` (False where nobody reads the attention weights: a registered
    :class:`FusedAttentionTail` may then take the softmax, dropout and the product with V without forming P,
    keeping two numbers a row (its statistics) to recompute P's tiles from in backward, and the weights come back
    as None). Half-precision queries give maps in :func:`evolution_dtype`, as the unfused path does; P is
    fp32 for them (see :func:`softmax_probabilities`).
    """

    @staticmethod
    def forward(
        ctx, step, query, key, value, previous, position_bias, weight, bias, conv_mask, allowed, additive, scaling,
        softcap, dropout, spare_maps=None, weights_read=True,
    ):  # fmt: skip
        # Keys and values as contiguous [B, H, K, D] (they arrive as views of the projections' [B, K, H * D]
        # outputs): every product with them, here and in backward, then reads them in place instead of copying
        # them first, and the copies saved for backward free the projections' outputs, so memory is unchanged.
        key, value = key.contiguous(), value.contiguous()
        # S and P are kept where they are small; elsewhere both are recomputed in backward, and the fused kernel
        # may write A_logit over S (one map less to allocate).
        small = keeps_small_maps(query, key, position_bias, softcap)
        plain = plain_scores(query, position_bias, softcap)
        product_scaling = scaling
        if plain:  # the queries kept contiguous (and scaled, where exact) for S again and the gradient of K
            query, product_scaling = contiguous_query(query, scaling)
            scores = attention_scores(query, key, product_scaling)
        else:
            scores = evolution_maps(attention_scores(query, key, scaling, position_bias, softcap), weight)
        keep = None if conv_mask is None else conv_mask.to(scores.dtype)
        maps = StepMaps(scores, previous, keep)
        logits, gate, _ = evolve_step(step, maps, weight, bias, for_backward=True, spend_scores=not small)
        # Where nobody reads the attention weights, a fused tail may take the softmax and the product without
        # forming P (it returns None for them, as sdpa and flash attention do).
        tail = None if weights_read else fused_attention_tail(logits, allowed, additive, value)
        stats = None
        if tail is None:
            output, probabilities, full, dropout_mask = attend_values(logits, allowed, additive, value, dropout)
        else:
            probabilities = full = dropout_mask = None
            if dropout > 0.0:  # kept for backward
                dropout_mask = kept_by_dropout(logits, dropout)
            output, stats = tail.forward(logits, allowed, additive, value, dropout_mask, 1.0 / (1.0 - dropout))
        # Kept: S and P (A_logit is kept by the next layer, as its A_prev). Else A_logit, to recompute P from;
        # with a fused tail, A_logit (and S where small) and the rows' statistics.
        kept = (scores if small else None, full if small else None, None if full is not None and small else logits)
        ctx.save_for_backward(
            query, key, value, previous, position_bias, weight, bias, gate, conv_mask, allowed, additive, dropout_mask,
            *kept, stats,
        )  # fmt: skip
        ctx.tail = tail
        ctx.plain, ctx.product_scaling = plain, product_scaling
        device = query.device.type
        # S is recomputed under the autocast state it was computed under (a matmul may run in half precision).
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.step, ctx.constants, ctx.spare_maps = step, (scaling, softcap, dropout), spare_maps
        ctx.set_materialize_grads(False)
        return output, logits, probabilities

    @staticmethod
    @torch.autocast("cpu", enabled=False)
    @torch.autocast("cuda", enabled=False)
    def backward(ctx, grad_output, grad_logits, grad_probabilities):
        saved = ctx.saved_tensors  # unpacked once: non-reentrant checkpointing refuses a second unpack
        query, key, value, previous, position_bias, weight, bias, gate, conv_mask, allowed, additive, mask = saved[:12]
        kept_scores, kept_probabilities, logits = saved[12:15]  # S and P where forward kept them, else A_logit
        step, (scaling, softcap, dropout) = ctx.step, ctx.constants
        dropout_scale = 1.0 / (1.0 - dropout) if dropout > 0.0 else 1.0
        grad_value = full = recomputed = None
        if ctx.tail is not None:  # the softmax's and the product's gradients in the tail's one pass
            if grad_output is not None:
                grad_evolved, grad_value = ctx.tail.backward(
                    logits, allowed, additive, value, mask, dropout_scale, saved[15], grad_output, logits.dtype
                )
            else:  # only A_logit's gradient flows back: none passes through the softmax
                grad_evolved = torch.zeros_like(logits)
        else:
            full, recomputed, grad_value, grad_evolved = _softmax_and_product_backward(
                ctx, saved, logits, kept_probabilities, grad_output, grad_probabilities, dropout_scale
            )
        spent_scores = None  # S's map where it is this function's own, to leave to the layer below
        if kept_scores is not None:
            scores = kept_scores
        elif ctx.plain:  # S again, bit-identical to forward's, from the queries as forward kept them
            # Written over the recomputed P, spent once the softmax's gradient is taken (the evolution's gradient
            # goes over G): a training step's backward then allocates one [B, H, Q, K] map a layer less. Each
            # fresh map is pages the C library may have returned to the system, touched anew (at N = 512, batch
            # 2, about 6,100 page faults; see bench/README.md).
            scores = spent_scores = attention_scores(query, key, ctx.product_scaling, out=recomputed)
            recomputed = None
        else:
            # S again, with autograd, to carry its gradient to Q, K and the positional bias as forward's ops do.
            # Which of them need a gradient comes from the inputs (the saved keys are a contiguous copy of them).
            leaves = [
                None if t is None else t.detach().requires_grad_(ctx.needs_input_grad[index])
                for t, index in ((query, 1), (key, 2), (position_bias, 5))
            ]
            device, autocast, autocast_dtype = ctx.autocast
            with torch.enable_grad(), torch.autocast(device, dtype=autocast_dtype, enabled=autocast):
                scores = evolution_maps(attention_scores(leaves[0], leaves[1], scaling, leaves[2], softcap), weight)
        scaled_weight, _ = scale_kernel(weight, bias, step.beta, scores.dtype)
        if grad_evolved.dtype != scores.dtype:  # fp32 from the softmax, back into half-precision maps' dtype
            grad_evolved = grad_evolved.to(scores.dtype)
        keep = None if conv_mask is None else conv_mask.to(scores.dtype)
        grad_scores, grad_previous, grad_weight, grad_bias = evolve_backward(
            step,
            StepMaps(scores.detach(), previous, keep),
            # G is spent here: the gradients may go over it. The next layer's gradient, through its A_prev, is
            # added as the kernel reads.
            GradientIn(grad_evolved, grad_logits, spent=True),
            gate,
            scaled_weight,
            needs_input=any(ctx.needs_input_grad[i] for i in (1, 2, 4, 5)),
            needs_kernel=ctx.needs_input_grad[6] or ctx.needs_input_grad[7],
            scaled_scores=True,  # S's gradient may share A_prev's map (see ScaledMap)
        )
        del grad_evolved, full
        if spent_scores is not None and previous is not None:  # a layer below, whose backward comes next
            leave_spare_map(ctx.spare_maps, spent_scores)
        if ctx.plain:
            grad_query, grad_key, grad_positions = None, None, None
            if grad_scores is not None:
                needs = (ctx.needs_input_grad[1], ctx.needs_input_grad[2])
                prescaled = ctx.product_scaling != scaling
                grad_query, grad_key = scores_backward(
                    grad_scores.map, query, key, scaling, needs, prescaled, gradient_scale=grad_scores.scale
                )
        else:
            wanted = [t for t in leaves if t is not None and t.requires_grad]
            grads = {}
            if grad_scores is not None and wanted:
                found = torch.autograd.grad(scores, wanted, grad_scores.map)
                if grad_scores.scale != 1.0:
                    # Not in place: a bias as large as S gets the map itself as its gradient, and the map is
                    # also A_prev's gradient.
                    found = [g * grad_scores.scale for g in found]
                grads = dict(zip(map(id, wanted), found, strict=True))
            grad_query, grad_key, grad_positions = (None if t is None else grads.get(id(t)) for t in leaves)
        if grad_weight is not None:
            grad_weight, grad_bias = grad_weight.to(weight.dtype), grad_bias.to(bias.dtype)
        grads = (grad_query, grad_key, grad_value, grad_previous, grad_positions, grad_weight, grad_bias)
        return None, *grads, *[None] * 8


def _softmax_and_product_backward(
    ctx, saved, logits, kept_probabilities, grad_output, grad_probabilities, dropout_scale
):  # fmt: skip
    """:meth:`EvolvingAttentionCore.backward`'s gradients of dropout(P) @ V and of the softmax as torch operations:
    (P, the recomputed P's map or None where P was kept, V's gradient, A_logit's gradient)."""
    value, allowed, additive, mask = saved[2], saved[9], saved[10], saved[11]
    # P again (bit-identical to forward's) where it was not kept; then the gradients of dropout(P) @ V and of
    # the softmax.
    if kept_probabilities is not None:
        full, recomputed = kept_probabilities, None
    else:
        handed_down = take_spare_map(ctx.spare_maps, logits)  # the S map the layer above spent, if any
        full = recomputed = softmax_probabilities(logits, allowed, additive, out=handed_down)
    # Outputs without a gradient come as None (see forward): the attention weights usually, the last
    # layer's A_logit, both without a map of zeros to allocate and add.
    grad_value, grad_attention = None, grad_probabilities
    if grad_output is not None:
        grad_output = grad_output.contiguous()  # a view of [B, Q, H * D]: copied once for both products
        probabilities = full.to(value.dtype)
        if mask is not None:
            probabilities = select_kept(probabilities, mask, dropout_scale)
        grad_value = grouped_transposed_product(probabilities, grad_output, value.shape[1])
        # dO @ V^T over dropout(P)'s map where that is a map of its own (spent now), as S goes over P's below.
        spare = probabilities if probabilities is not full and probabilities.dtype == grad_output.dtype else None
        del probabilities
        product = grouped_product(grad_output, value.transpose(-1, -2), out=spare)
        grad_attention = product if grad_probabilities is None else product.add_(grad_probabilities)
    elif grad_attention is not None:  # autograd's own tensor: the steps below write over it
        grad_attention = grad_attention.clone()
    else:  # only A_logit's gradient flows back: none passes through the softmax
        grad_attention = torch.zeros_like(full)
    if mask is not None:  # in place: grad_attention is a map of this function's own by now
        select_kept(grad_attention, mask, dropout_scale, out=grad_attention)
    # The softmax's gradient P * (G - rowsum(G * P)), by eager attention's fused kernel, written over G: a
    # training step then allocates no more [B, H, Q, K] maps in backward than eager attention does (P and
    # G: S is written over P, the evolution's gradient over G, below).
    grad_evolved = grad_attention.to(full.dtype)
    torch.ops.aten._softmax_backward_data.out(grad_evolved, full, -1, full.dtype, grad_input=grad_evolved)
    del grad_attention
    if additive is None and allowed is not None:  # masked_fill passes no gradient to the filled entries
        # In place, in one pass of the kernel where it applies: masked_fill_ with a mask broadcast over the
        # heads is slower on CPU, and so is torch.where (AMD EPYC, [2, 12, 512, 512]: 3.5, 2.5 to 3.6 and 0.6
        # ms), with the same result.
        select_kept(grad_evolved, allowed, out=grad_evolved)
    return full, recomputed, grad_value, grad_evolved


#: Operators whose outputs :func:`compiled_core` keeps for backward: the fused kernels' A_logit and gate (the CPU
#: kernel's and the Triton kernels'), the fused attention tail's output and row statistics (recomputing them would
#: repeat its pass over A_logit), and dropout's mask (a random operator: recomputing it would need the same
#: random numbers again).
KEPT_OPERATORS = (
    "ea_hf::evolve_with_gate_bits",
    "ea_hf::triton_evolve_with_gate_bits",
    "ea_hf::triton_attention_tail",
    "aten::native_dropout",
)


def _keep_logits_and_gate(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective checkpointing's policy of :func:`compiled_core`: keep the outputs of :data:`KEPT_OPERATORS`,
    recompute the rest (S, the mask, the softmax) in backward. By name: a remote-code copy of this file may run
    where the kernel's operators are not registered."""
    name = getattr(getattr(op, "_schema", None), "name", "")
    return CheckpointPolicy.MUST_SAVE if name in KEPT_OPERATORS else CheckpointPolicy.PREFER_RECOMPUTE


def compiled_core(
    step: EvolutionStep,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    previous: torch.Tensor | None,
    position_bias: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    conv_mask: torch.Tensor | None,
    allowed: torch.Tensor | None,
    additive: torch.Tensor | None,
    scaling: float,
    softcap: float | None,
    dropout: float,
    spare_maps: dict | None = None,
    weights_read: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What :class:`EvolvingAttentionCore` computes, with the arguments of its ``apply``, in a form ``torch.compile``
    traces (whose kernel operators correlate the masked tails too: the step's ``skip_masked_tails`` is left out here,
    ``spare_maps`` unused: a compiled graph plans its own buffers): the layer's operators inside a selective
    activation checkpoint that keeps A_logit and the gate of the fused kernel (and dropout's mask) and recomputes
    S and P in backward, as the core does. Without the checkpoint, a compiled training step keeps S, A_logit and P
    per layer (1.5x a compiled eager step's memory at N = 512). Where the maps are small (:func:`keeps_small_maps`),
    S is kept (computed before the checkpoint) and only P is recomputed. Where no fused kernel applies (the
    torch-operation path: recomputing would repeat its convolution), the operators run without a checkpoint. Where
    nobody reads the weights (``weights_read`` False), a fused attention tail takes the softmax and the product as
    its operator, which keeps its rows' statistics, not P (dropout's mask is drawn before the checkpoint, which
    keeps it as an input), and the weights come back as None.

    Example:
        >>> q, k, v = (torch.randn(1, 2, 20, 4) for _ in range(3))
        >>> weight, bias = torch.randn(2, 2, 3, 3), torch.zeros(2)
        >>> step = EvolutionStep(alpha=0.0, beta=0.3, context_rows=1)
        >>> arguments = (step, q, k, v, None, None, weight, bias, None, None, None, 0.5, None, 0.0)
        >>> got, expected = compiled_core(*arguments), EvolvingAttentionCore.apply(*arguments)
        >>> all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, expected))
        True
    """

    def scores_of(query, key, position_bias):
        return evolution_maps(attention_scores(query, key, scaling, position_bias, softcap), weight)

    # The masked tails correlated as the operators correlate them, also where this runs uncompiled.
    whole_rows = EvolutionStep(step.alpha, step.beta, step.context_rows, step.causal)

    # A stand-in with S's (and A_logit's) shape, device and dtype to ask whether a fused kernel takes the maps.
    maps = scores_stand_in(query, key, evolution_dtype(scores_stand_in(query, key, query.dtype), weight))
    tail = None if weights_read else fused_attention_tail(maps, allowed, additive, value)
    dropout_keep = None
    if tail is not None and dropout > 0.0:  # drawn outside the checkpoint, whose replay would draw anew
        dropout_keep = kept_by_dropout(maps, dropout)

    def after_scores(scores, value, previous, weight, bias, dropout_keep):
        keep = None if conv_mask is None else conv_mask.to(scores.dtype)
        logits = evolve_convolution(whole_rows, StepMaps(scores, previous, keep), weight, bias)
        if tail is not None:
            dropout_scale = 1.0 / (1.0 - dropout) if dropout > 0.0 else 1.0
            return tail.attend(logits, allowed, additive, value, dropout_keep, dropout_scale), logits, None
        output, probabilities, _, _ = attend_values(logits, allowed, additive, value, dropout)
        return output, logits, probabilities

    def core(query, key, value, previous, position_bias, weight, bias, dropout_keep):
        return after_scores(scores_of(query, key, position_bias), value, previous, weight, bias, dropout_keep)

    tensors = (query, key, value, previous, position_bias, weight, bias, dropout_keep)
    if fused_kernel(maps, previous, keep=conv_mask, weight=weight) is None:
        return core(*tensors)
    policy = functools.partial(create_selective_checkpoint_contexts, _keep_logits_and_gate)
    if keeps_small_maps(query, key, position_bias, softcap):
        # S computed before the checkpoint, which keeps its inputs: S is kept, as the core keeps it, and P is
        # recomputed. The core keeps P too, but compiled the map weighs more: inductor fuses away much of the
        # rest of a step (BERT-Base, N = 128, batch 8, AMD EPYC, against compiled eager attention: keeping both
        # maps takes 1.05x its time and 1.11x its step memory, recomputing P 1.05x and 1.07x, recomputing S as
        # well 1.07x and 1.03x).
        scores = scores_of(query, key, position_bias)
        return checkpoint(
            after_scores, scores, value, previous, weight, bias, dropout_keep, use_reentrant=False, context_fn=policy
        )
    return checkpoint(core, *tensors, use_reentrant=False, context_fn=policy)

"""S and the products of attention: QK^T scaled (with a positional bias and soft-capping where the model has
them), the products over heads that share key/value heads (grouped-query attention) without repeating the keys
and values, and the gradients of Q and K from S's gradient (:func:`scores_backward`).

This file is copied beside the weights of saved EA checkpoints (``trust_remote_code``): it imports only torch,
transformers and sibling files (single-dot relative imports).
"""

from __future__ import annotations

import math

import torch

from .kernels import fused_kernel

#: Half-precision dtypes (their maps are masked and normalised in their own dtype, accumulating in fp32).
HALF_PRECISION = (torch.float16, torch.bfloat16)


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

    Repeating the keys and values would copy them for every query head, which can cost more than the products
    themselves (see docs/performance.md, "Choices in the hot path").

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
    # next layer's probabilities into it (see map_reuse.spare_map); a view of the product would never be.
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


def plain_scores(query: torch.Tensor, position_bias: torch.Tensor | None, softcap: float | None) -> bool:
    """Whether S is the plain product in full precision (no positional bias or soft-capping, no upcast or
    autocast): :class:`~.attention_core.EvolvingAttentionCore` then keeps the queries contiguous and pre-scaled
    (:func:`contiguous_query`), recomputes S without autograd where it is not kept, and computes the gradients of
    Q and K directly (:func:`scores_backward`).

    Example:
        >>> q = torch.randn(1, 2, 3, 4)
        >>> plain_scores(q, None, None), plain_scores(q, None, 50.0), plain_scores(q.half(), None, None)
        (True, False, False)
    """
    if position_bias is not None or softcap is not None or query.dtype in HALF_PRECISION:
        return False
    return not torch.is_autocast_enabled(query.device.type)


def keeps_small_maps(
    query: torch.Tensor, key: torch.Tensor, position_bias: torch.Tensor | None, softcap: float | None
) -> bool:
    """Whether :class:`~.attention_core.EvolvingAttentionCore` keeps S and P for backward instead of recomputing
    them: when a [B, H, Q, K] map is no larger than the keys and values it keeps anyway (Q <= 2 * head_dim; with
    grouped-query attention it keeps fewer key/value heads, and the rule stays the same), two more maps cost at
    most twice their memory, and backward saves a product and a softmax; and S is :func:`plain_scores`.

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
    of the product's right operand K^T, transposed. G^T @ Q is the same sum, but BLAS may order it differently,
    and then the last bit differs from autograd's on some CPUs (see docs/performance.md, "Choices in the hot
    path")."""
    return grouped_transposed_product(query, grad_product, key_heads).transpose(-1, -2)


def evolution_dtype(scores: torch.Tensor, weight: torch.Tensor | None) -> torch.dtype:
    """The dtype the evolution of maps like ``scores`` runs in: the maps' own (a bf16 or fp16 model evolves bf16
    or fp16 maps, half the memory and traffic of fp32 ones; the kernels accumulate in fp32), except where the
    only fused kernel for them takes fp32 maps (the CPU kernel): half-precision maps are then upcast to fp32 for
    it. The masks and the softmax keep the evolved logits' dtype (:func:`~.attention_tail.softmax_probabilities`).
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

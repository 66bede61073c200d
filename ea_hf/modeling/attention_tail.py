"""The tail every attention path shares after the logits: the attention mask, the softmax (in the logits' dtype:
torch's softmax kernels accumulate half-precision rows in fp32 and round P once), dropout and the product with the
values, and the gradients of that tail.

Half-precision maps stay in their dtype through the mask, the softmax and its gradient: an fp32 copy of a
[B, H, Q, K] map would cost three passes over it each way (the upcast reads one map and writes a map twice its
size), six times a layer in a training step (see docs/performance.md, "Bytes per step"). fp16's mask is guarded so
that a masked sum cannot overflow to -inf (:func:`masked_logits`): a fully masked row then gets uniform weights, as
in fp32, not NaN.

This file is copied beside the weights of saved EA checkpoints (``trust_remote_code``): it imports only torch,
transformers and sibling files (single-dot relative imports).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .convolution import select_kept
from .masks import AttentionMask
from .scores import HALF_PRECISION, grouped_product, grouped_transposed_product


class Dropout(NamedTuple):
    """Dropout as the tail's backward (and a fused tail) applies it: ``kept``, the bool mask of the weights it
    keeps (None: no dropout), and ``scale``, the factor of the kept weights (:func:`dropout_scale`)."""

    kept: torch.Tensor | None = None
    scale: float = 1.0


def dropout_scale(dropout: float) -> float:
    """The factor 1 / (1 - p) of the weights that dropout of probability ``dropout`` keeps (1 without dropout).

    Example:
        >>> dropout_scale(0.5), dropout_scale(0.0)
        (2.0, 1.0)
    """
    return 1.0 / (1.0 - dropout) if dropout > 0.0 else 1.0


def full_precision(logits: torch.Tensor) -> torch.Tensor:
    """Half-precision logits as fp32 (the sinks' logsumexp over the masked logits runs in it)."""
    return logits.float() if logits.dtype in HALF_PRECISION else logits


def masked_logits(logits: torch.Tensor, mask: AttentionMask, out: torch.Tensor | None = None) -> torch.Tensor:
    """The logits with the attention mask applied: ``mask.additive`` added, else the entries ``mask.allowed``
    disallows at the dtype's minimum; written into ``out`` where given (the same numbers).

    In fp16 an additive mask (fp16's minimum, -65504) plus a negative logit overflows to -inf, and a fully masked
    row of -inf gives NaN: the sum is clamped at the dtype's minimum there (:func:`guarded`).

    Example:
        >>> logits = masked_logits(torch.zeros(3), AttentionMask(torch.tensor([True, False, True])))
        >>> (logits == torch.finfo(logits.dtype).min).tolist()
        [False, True, False]
        >>> additive = torch.full((3,), torch.finfo(torch.float16).min, dtype=torch.float16)
        >>> masked_logits(torch.full((3,), -100.0, dtype=torch.float16), AttentionMask(additive=additive)).tolist()
        [-65504.0, -65504.0, -65504.0]
    """
    if mask.additive is not None:
        return guarded(logits + mask.additive if out is None else torch.add(logits, mask.additive, out=out))
    if mask.allowed is not None:
        fill = torch.finfo(logits.dtype).min
        if out is None:
            return logits.masked_fill(~mask.allowed, fill)
        return select_kept(logits, mask.allowed, fill=fill, out=out)
    return logits


def guarded(masked: torch.Tensor) -> torch.Tensor:
    """fp16 masked logits clamped at fp16's minimum (in place outside autograd), so that no sum of a logit and the
    mask is -inf; other dtypes as they are (bf16's range is fp32's: its minimum plus a logit stays finite)."""
    if masked.dtype != torch.float16:
        return masked
    lowest = torch.finfo(torch.float16).min
    if torch.is_grad_enabled() and masked.requires_grad:
        return masked.clamp_min(lowest)
    return masked.clamp_min_(lowest)


def softmax_probabilities(logits: torch.Tensor, mask: AttentionMask, out: torch.Tensor | None = None) -> torch.Tensor:
    """P = softmax over the keys of the masked ``logits``, into ``out`` where given: the same numbers either way,
    so that backward may recompute forward's P bit for bit. P has the logits' dtype (``out`` of another dtype is
    not used): torch's softmax accumulates half-precision rows in fp32.

    On CPU, outside autograd and compilation, a mask is applied as it is written into P's map (``out``, else a
    new one) and the softmax then runs in place there: one map and one pass less than masking into a map of its
    own, which ``masked_fill`` writes slowly with a mask broadcast over the heads. The same bits, in less time
    (see docs/performance.md, "Choices in the hot path").

    Example:
        >>> logits, allowed = torch.randn(1, 2, 3, 4), torch.rand(1, 1, 3, 4) > 0.3
        >>> expected = logits.masked_fill(~allowed, torch.finfo(logits.dtype).min).softmax(-1)
        >>> torch.equal(softmax_probabilities(logits, AttentionMask(allowed)), expected)
        True
    """
    if out is not None and out.dtype != logits.dtype:
        out = None
    if (mask.allowed is None and mask.additive is None) or not _masks_into_probabilities(logits, mask, out):
        scores = masked_logits(logits, mask)
        return torch.softmax(scores, -1) if out is None else torch.ops.aten._softmax.out(scores, -1, False, out=out)
    out = torch.empty_like(logits, memory_format=torch.contiguous_format) if out is None else out
    masked_logits(logits, mask, out=out)
    return torch.ops.aten._softmax.out(out, -1, False, out=out)


def _masks_into_probabilities(logits: torch.Tensor, mask: AttentionMask, out: torch.Tensor | None) -> bool:
    """Whether :func:`softmax_probabilities` may write the masked logits into P's map: no autograd graph to
    record and nothing traced, a mask that broadcasts to the logits' shape, an ``out`` like the logits. On CPU,
    where aten's softmax reads each row before it writes it (checked bit for bit in the tests); GPU kernels are
    left to their own allocations."""
    applied = mask.additive if mask.additive is not None else mask.allowed
    if torch.compiler.is_compiling() or logits.device.type != "cpu":
        return False
    if torch.is_grad_enabled() and (logits.requires_grad or applied.requires_grad):
        return False
    if mask.additive is not None and torch.result_type(logits, mask.additive) != logits.dtype:
        return False
    # The mask broadcasts to the logits' shape: a plain loop, which costs a decoding step (one query row, where
    # the maps are tiny) less than torch.broadcast_shapes.
    if applied.dim() > logits.dim():
        return False
    trailing = logits.shape[logits.dim() - applied.dim() :]
    if any(m not in (1, n) for m, n in zip(applied.shape, trailing, strict=True)):
        return False
    return out is None or (out.shape == logits.shape and out.dtype == logits.dtype)


def attend_values(
    logits: torch.Tensor, mask: AttentionMask, value: torch.Tensor, dropout: float, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The tail every attention path shares: P = softmax over the keys of the masked ``logits`` (into ``out``
    where given), dropout and the product with ``value``. Returns (dropout(P) @ V, dropout(P) in the values'
    dtype, P in the logits' dtype (see :func:`softmax_probabilities`), dropout's bool mask or None). ``value``
    may have fewer heads than the logits (see :func:`~.scores.grouped_product`).

    Dropout is ``torch.native_dropout``: the random numbers of ``torch.nn.functional.dropout`` (which runs it on
    GPUs) and a bool mask for backward instead of a float one.

    Example:
        >>> logits, value = torch.randn(1, 2, 3, 5), torch.randn(1, 2, 5, 4)
        >>> output, weights, probabilities, kept = attend_values(logits, AttentionMask(), value, 0.0)
        >>> torch.allclose(output, logits.softmax(-1) @ value), weights is probabilities, kept is None
        (True, True, True)
    """
    probabilities = softmax_probabilities(logits, mask, out)
    weights, kept = probabilities.to(value.dtype), None
    if dropout > 0.0:
        weights, kept = dropout_with_mask(weights, dropout)
    return grouped_product(weights, value), weights, probabilities, kept


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
    (:func:`~.convolution.select_kept`) instead of native_dropout's ``weights.mul(mask).mul_(scale)``, which
    takes longer (see docs/performance.md, "Choices in the hot path").

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


def attend_values_backward(
    probabilities: torch.Tensor,
    mask: AttentionMask,
    value: torch.Tensor,
    dropout: Dropout,
    grad_output: torch.Tensor | None,
    grad_weights: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The gradients of :func:`attend_values` as torch operations: (V's gradient or None, the logits' gradient in
    the dtype of ``probabilities``), from P (``probabilities``, as forward's softmax gave it), dropout's mask and
    scale, and the gradients of the output and of the weights (either may be None: no gradient flows there).

    Example:
        >>> logits, value, grad = torch.randn(1, 2, 3, 5), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 3, 4)
        >>> leaves = (value.requires_grad_(), logits.requires_grad_())
        >>> expected = torch.autograd.grad(logits.softmax(-1) @ value, leaves, grad)
        >>> with torch.no_grad():  # as in backward
        ...     got = attend_values_backward(logits.softmax(-1), AttentionMask(), value, Dropout(), grad, None)
        >>> all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, expected))
        True
    """
    # Outputs without a gradient come as None: the attention weights usually, the last layer's A_logit, both
    # without a map of zeros to allocate and add.
    grad_value, grad_attention = None, grad_weights
    if grad_output is not None:
        grad_output = grad_output.contiguous()  # a view of [B, Q, H * D]: copied once for both products
        weights = probabilities.to(value.dtype)
        if dropout.kept is not None:
            weights = select_kept(weights, dropout.kept, dropout.scale)
        grad_value = grouped_transposed_product(weights, grad_output, value.shape[1])
        # dO @ V^T over dropout(P)'s map where that is a map of its own (spent now), as S goes over P's in the core.
        spare = weights if weights is not probabilities and weights.dtype == grad_output.dtype else None
        del weights
        product = grouped_product(grad_output, value.transpose(-1, -2), out=spare)
        grad_attention = product if grad_weights is None else product.add_(grad_weights)
    elif grad_attention is not None:  # autograd's own tensor: the steps below write over it
        grad_attention = grad_attention.clone()
    else:  # only A_logit's gradient flows back: none passes through the softmax
        grad_attention = torch.zeros_like(probabilities)
    if dropout.kept is not None:  # in place: grad_attention is a map of this function's own by now
        select_kept(grad_attention, dropout.kept, dropout.scale, out=grad_attention)
    # The softmax's gradient P * (G - rowsum(G * P)), by eager attention's fused kernel, written over G: a
    # training step then allocates no more [B, H, Q, K] maps in backward than eager attention does (P and
    # G: the core writes S over P, the evolution's gradient over G).
    grad_logits = grad_attention.to(probabilities.dtype)
    torch.ops.aten._softmax_backward_data.out(
        grad_logits, probabilities, -1, probabilities.dtype, grad_input=grad_logits
    )
    del grad_attention
    if mask.additive is None and mask.allowed is not None:  # masked_fill passes no gradient to the filled entries
        # In place, in one pass of the kernel where it applies: faster on CPU than masked_fill_ with a mask
        # broadcast over the heads, or torch.where (see docs/performance.md, "Choices in the hot path"), with the
        # same result.
        select_kept(grad_logits, mask.allowed, out=grad_logits)
    return grad_value, grad_logits

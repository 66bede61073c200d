"""Attention sinks (GPT-OSS's ``s_aux``): a learned logit per head that joins each row's softmax as one more
column, which has no value and which the convolution never reads (it is no entry of the map).

This file is copied beside the weights of saved EA checkpoints (``trust_remote_code``): it imports only torch,
transformers and sibling files (single-dot relative imports).
"""

from __future__ import annotations

import torch

from .attention_tail import full_precision, masked_logits, softmax_probabilities
from .masks import AttentionMask


def join_sinks(
    output: torch.Tensor, probs: torch.Tensor, logits: torch.Tensor, mask: AttentionMask, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's output and weights with the sinks [H] joined to the softmax.

    The sink takes its share of each row's mass: P_ij = exp(L_ij) / (sum_k exp(L_ik) + exp(sink)) is the softmax
    over the keys alone times the share the keys keep, sigmoid(logsumexp_k L_ik - sink). So the ``output``
    [B, H, Q, D] and the ``probs`` [B, H, Q, K] of the softmax without the sink, times that share, are the
    layer's; ``logits`` are the unmasked (evolved) logits that softmax read.

    Example:
        >>> logits, sinks = torch.randn(1, 2, 3, 4), torch.randn(2)
        >>> probs = logits.softmax(-1)
        >>> _, joined = join_sinks(torch.zeros(1, 2, 3, 5), probs.clone(), logits, AttentionMask(), sinks)
        >>> with_sink = torch.cat([logits, sinks.view(1, 2, 1, 1).expand(1, 2, 3, 1)], -1).softmax(-1)
        >>> torch.allclose(joined, with_sink[..., :4], atol=1e-6)
        True
    """
    share = SinkShare.apply(logits, sinks, mask).unsqueeze(-1)
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
    def forward(ctx, logits, sinks, mask):
        rows = torch.logsumexp(masked_logits(full_precision(logits), mask), -1)
        share = torch.sigmoid(rows - sinks.to(rows.dtype).view(-1, 1))
        ctx.save_for_backward(logits, mask.allowed, mask.additive, share)
        ctx.sinks_dtype = sinks.dtype
        return share

    @staticmethod
    def backward(ctx, grad_share):
        logits, allowed, additive, share = ctx.saved_tensors
        slope = grad_share * share * (1.0 - share)  # d share / d(logsumexp - sink)
        grad_logits = grad_sinks = None
        if ctx.needs_input_grad[0]:  # d logsumexp / d L = softmax(L)
            probabilities = softmax_probabilities(logits, AttentionMask(allowed, additive))
            grad_logits = probabilities.mul_(slope.unsqueeze(-1)).to(logits.dtype)
        if ctx.needs_input_grad[1]:
            grad_sinks = slope.sum((0, 2)).neg_().to(ctx.sinks_dtype)
        return grad_logits, grad_sinks, None

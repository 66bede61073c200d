"""One evolving attention layer's core as a single autograd node that keeps one map for backward (three where
the maps are small).

For S = QK^T * scaling (+ positional bias, soft-capped), the evolution A_logit = beta * ReLU(Conv(A_in * keep))
+ (1 - beta) * A_in with A_in = lerp(S, A_prev, alpha), P = softmax(A_logit + mask), dropout and P @ V,
autograd through the separate steps keeps S, the ReLU gate and P for every layer, and A_logit lives on as the
next layer's A_prev: three and a quarter [B, H, Q, K] maps where eager attention keeps one (P).

:class:`EvolvingAttentionCore` keeps only A_logit (which the next layer keeps anyway), the ReLU gate (bit-packed on
the CPU kernel) and dropout's bool mask, and recomputes the rest in backward: S from Q and K (a matmul) and P from
A_logit and the mask (a softmax, bit-identical to the forward one). Backward then runs the same gradient steps
autograd would (the shared :func:`~.convolution.evolve_backward` for the evolution). The recomputation costs about
one QK^T matmul and one softmax per layer and step.

Where the maps are small, S and P are kept instead (:func:`~.scores.keeps_small_maps`), and backward saves the
matmul and the softmax (see docs/performance.md, "Choices in the hot path").

Where nobody reads the attention weights, a fused attention tail (``ea_hf.ops.triton.attention_tail``, on GPUs with
the Triton kernels) takes the masked softmax, dropout and the product with V flash-style, without forming P.

Where S is the plain product (:func:`~.scores.plain_scores`), the queries are kept contiguous and pre-scaled
(:func:`~.scores.contiguous_query`: one pass where the product would copy them anyway), S is recomputed from
them without autograd, and the gradients of Q and K come from :func:`~.scores.scores_backward`; a positional
bias or soft-capping goes through autograd again.

While ``torch.compile`` traces, :func:`~.compiled.compiled_core` runs the layer's operators instead.

This file is copied beside the weights of saved EA checkpoints (``trust_remote_code``): it imports only torch,
transformers and sibling files (single-dot relative imports).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .attention_tail import (
    Dropout,
    attend_values,
    attend_values_backward,
    dropout_scale,
    kept_by_dropout,
    softmax_probabilities,
)
from .convolution import evolve_backward, evolve_step, scale_kernel
from .gates import alpha_gradient, beta_gradient
from .kernels import fused_attention_tail
from .map_reuse import leave_spare_map, take_spare_map
from .masks import AttentionMask
from .scores import (
    attention_scores,
    contiguous_query,
    evolution_maps,
    keeps_small_maps,
    plain_scores,
    scores_backward,
)
from .step import EvolutionStep, GradientIn, ScaledMap, StepMaps


class CoreInputs(NamedTuple):
    """The layer's tensors that autograd differentiates, each a direct argument of the core (after
    :class:`CoreConstants` and :class:`CoreMasks`, in this order): ``query`` [B, H, Q, D], ``key`` and ``value``
    [B, H_kv, K, D] (grouped-query attention: each of the H_kv key/value heads serves H / H_kv query heads, see
    :func:`~.scores.grouped_product`), ``previous`` (A_prev or None), ``position_bias`` (or None), the
    convolution's ``weight`` and ``bias``, and learned gates' clamped values ``alpha`` and ``beta`` (0-dim tensors,
    :mod:`.gates`; None for fixed gates, whose values the step holds). Backward names its gradients, and which of
    them are needed, the same way."""

    query: Tensor
    key: Tensor
    value: Tensor
    previous: Tensor | None
    position_bias: Tensor | None
    weight: Tensor
    bias: Tensor
    alpha: Tensor | None = None
    beta: Tensor | None = None


class CoreMasks(NamedTuple):
    """The layer's masks, tensors that get no gradient: ``convolution`` (bool, where entries may enter the
    convolution; None: all may) and ``attention`` (the :class:`~.masks.AttentionMask` of the softmax)."""

    convolution: Tensor | None = None
    attention: AttentionMask = AttentionMask()


class CoreConstants(NamedTuple):
    """The layer's settings and its call's state, none of them a tensor: the :class:`~.step.EvolutionStep`,
    ``scaling``, ``softcap`` (or None), ``dropout`` (the probability; 0 outside training), ``spare_maps`` (the
    call's dict of maps that backward passes down the layers, see :func:`~.map_reuse.leave_spare_map`; or None)
    and ``weights_read`` (False where nobody reads the attention weights: a registered
    :class:`~.kernels.FusedAttentionTail` may then take the softmax, dropout and the product with V without
    forming P, keeping two numbers a row (its statistics) to recompute P's tiles from in backward, and the weights
    come back as None)."""

    step: EvolutionStep
    scaling: float
    softcap: float | None = None
    dropout: float = 0.0
    spare_maps: dict | None = None
    weights_read: bool = True


class SavedTensors(NamedTuple):
    """What :class:`EvolvingAttentionCore`'s forward saves for backward, by name: the ``inputs`` as forward used
    them (keys and values contiguous; the queries contiguous and pre-scaled where S is plain), the ReLU ``gate``,
    the masks, dropout's mask (``dropout_kept``), S and P where kept (``scores``, ``probabilities``; else None),
    A_logit where P is not kept (``logits``; else None) and a fused tail's row statistics (``stats``; else None).
    """

    inputs: CoreInputs
    gate: Tensor
    conv_mask: Tensor | None
    allowed: Tensor | None
    additive: Tensor | None
    dropout_kept: Tensor | None
    scores: Tensor | None
    probabilities: Tensor | None
    logits: Tensor | None
    stats: Tensor | None

    def flat(self) -> tuple[Tensor | None, ...]:
        """The tensors in one flat tuple, as ``save_for_backward`` takes them."""
        return (*self.inputs, *self[1:])

    @classmethod
    def unflatten(cls, tensors: tuple[Tensor | None, ...]) -> SavedTensors:
        """The tensors of :meth:`flat` (``ctx.saved_tensors``) by name again."""
        inputs = len(CoreInputs._fields)
        return cls(CoreInputs(*tensors[:inputs]), *tensors[inputs:])


class EvolvingAttentionCore(torch.autograd.Function):
    """(output [B, H, Q, D], A_logit, attention weights) of one evolving attention layer, keeping A_logit, the
    ReLU gate and the dropout mask for backward (see the module docstring).

    ``apply(constants, masks, *inputs)``: :class:`CoreConstants`, :class:`CoreMasks`, then the seven tensors of
    :class:`CoreInputs`, direct arguments so that autograd differentiates them. Half-precision queries give maps in
    :func:`~.scores.evolution_dtype`, as the unfused path does; P has the maps' dtype (see
    :func:`~.attention_tail.softmax_probabilities`).
    """

    @staticmethod
    def forward(ctx, constants, masks, query, key, value, previous, position_bias, weight, bias, alpha=None, beta=None):
        scaling, softcap, dropout, mask = constants.scaling, constants.softcap, constants.dropout, masks.attention
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
        keep = None if masks.convolution is None else masks.convolution.to(scores.dtype)
        maps = StepMaps(scores, previous, keep)
        logits, gate, _ = evolve_step(constants.step, maps, weight, bias, for_backward=True, spend_scores=not small)
        # Where nobody reads the attention weights, a fused tail may take the softmax and the product without
        # forming P (it returns None for them, as sdpa and flash attention do).
        tail = None if constants.weights_read else fused_attention_tail(logits, mask, value)
        stats = None
        if tail is None:
            output, probabilities, full, dropout_kept = attend_values(logits, mask, value, dropout)
        else:
            probabilities = full = dropout_kept = None
            if dropout > 0.0:  # kept for backward
                dropout_kept = kept_by_dropout(logits, dropout)
            output, stats = tail.forward(
                logits, mask.allowed, mask.additive, value, dropout_kept, dropout_scale(dropout)
            )
        # Kept: S and P (A_logit is kept by the next layer, as its A_prev). Else A_logit, to recompute P from;
        # with a fused tail, A_logit (and S where small) and the rows' statistics.
        saved = SavedTensors(
            CoreInputs(query, key, value, previous, position_bias, weight, bias, alpha, beta), gate, masks.convolution,
            mask.allowed, mask.additive, dropout_kept, scores=scores if small else None,
            probabilities=full if small else None, logits=None if full is not None and small else logits, stats=stats,
        )  # fmt: skip
        ctx.save_for_backward(*saved.flat())
        ctx.tail, ctx.constants = tail, constants
        ctx.plain, ctx.product_scaling = plain, product_scaling
        device = query.device.type
        # S is recomputed under the autocast state it was computed under (a matmul may run in half precision).
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.set_materialize_grads(False)
        return output, logits, probabilities

    @staticmethod
    @torch.autocast("cpu", enabled=False)
    @torch.autocast("cuda", enabled=False)
    def backward(ctx, grad_output, grad_logits, grad_probabilities):
        # Unpacked once: non-reentrant checkpointing refuses a second unpack.
        saved = SavedTensors.unflatten(ctx.saved_tensors)
        inputs, needs = saved.inputs, CoreInputs(*ctx.needs_input_grad[2:])
        constants = ctx.constants
        mask = AttentionMask(saved.allowed, saved.additive)
        dropout = Dropout(saved.dropout_kept, dropout_scale(constants.dropout))
        full = recomputed = None
        if ctx.tail is None:
            # P again (bit-identical to forward's) where it was not kept, into the S map the layer above spent (if
            # any); then the gradients of dropout(P) @ V and of the softmax.
            full = saved.probabilities
            if full is None:
                handed_down = take_spare_map(constants.spare_maps, saved.logits)
                full = recomputed = softmax_probabilities(saved.logits, mask, out=handed_down)
            grad_value, grad_evolved = attend_values_backward(
                full, mask, inputs.value, dropout, grad_output, grad_probabilities
            )
        elif grad_output is not None:  # the softmax's and the product's gradients in the tail's one pass
            # The next layer's gradient, through its A_prev, is added as the tail writes A_logit's gradient: one
            # read of it, where the evolution's backward would add it in a pass of its own (read, read, write).
            grad_evolved, grad_value = ctx.tail.backward(
                saved.logits, mask.allowed, mask.additive, inputs.value, dropout.kept, dropout.scale, saved.stats,
                grad_output, saved.logits.dtype, grad_logits,
            )  # fmt: skip
            grad_logits = None
        else:  # only A_logit's gradient flows back: none passes through the softmax
            grad_value, grad_evolved = None, torch.zeros_like(saved.logits)
        leaves = spent_scores = None  # spent_scores: S's map where it is this function's own, for the layer below
        if saved.scores is not None:
            scores = saved.scores
        elif ctx.plain:  # S again, bit-identical to forward's, from the queries as forward kept them
            # Written over the recomputed P, spent once the softmax's gradient is taken (the evolution's gradient
            # goes over G): a training step's backward then allocates one [B, H, Q, K] map a layer less, and
            # fresh maps cost page faults (see docs/performance.md, "Choices in the hot path").
            scores = spent_scores = attention_scores(inputs.query, inputs.key, ctx.product_scaling, out=recomputed)
            recomputed = None
        else:
            scores, leaves = _scores_with_autograd(ctx, inputs, needs)
        scaled_weight, _ = scale_kernel(inputs.weight, inputs.bias, constants.step.beta, scores.dtype)
        if grad_evolved.dtype != scores.dtype:  # a fused tail's gradient in another dtype than the maps
            grad_evolved = grad_evolved.to(scores.dtype)
        keep = None if saved.conv_mask is None else saved.conv_mask.to(scores.dtype)
        maps = StepMaps(scores.detach(), inputs.previous, keep)
        grad_beta = None
        if needs.beta:  # before the evolution's backward, which may write over G
            grads = (grad_evolved, grad_logits)
            grad_beta = beta_gradient(grads, constants.step, maps, inputs.weight, inputs.bias).to(inputs.beta.dtype)
        grad_scores, grad_previous, grad_weight, grad_bias = evolve_backward(
            constants.step,
            maps,
            # G is spent here: the gradients may go over it. The next layer's gradient, through its A_prev, is
            # added to it where the tail has not added it already (over G, or as the CPU kernel reads).
            GradientIn(grad_evolved, grad_logits, spent=True),
            saved.gate,
            scaled_weight,
            needs_input=needs.query or needs.key or needs.previous or needs.position_bias or needs.alpha,
            needs_kernel=needs.weight or needs.bias,
            scaled_scores=True,  # S's gradient may share A_prev's map (see ScaledMap)
        )
        del grad_evolved, full
        grad_alpha = None
        if needs.alpha and inputs.previous is None:  # the first layer has no A_prev: its alpha changes nothing
            grad_alpha = torch.zeros_like(inputs.alpha)
        elif needs.alpha:
            grad_alpha = alpha_gradient(grad_scores, grad_previous, maps, constants.step.alpha).to(inputs.alpha.dtype)
        if spent_scores is not None and inputs.previous is not None:  # a layer below, whose backward comes next
            leave_spare_map(constants.spare_maps, spent_scores)
        grad_query, grad_key, grad_positions = _scores_input_gradients(ctx, inputs, needs, scores, leaves, grad_scores)
        if grad_weight is not None:
            grad_weight, grad_bias = grad_weight.to(inputs.weight.dtype), grad_bias.to(inputs.bias.dtype)
        grads = CoreInputs(
            grad_query,
            grad_key,
            grad_value,
            grad_previous,
            grad_positions,
            grad_weight,
            grad_bias,
            grad_alpha,
            grad_beta,
        )
        return None, None, *grads


def _scores_with_autograd(ctx, inputs: CoreInputs, needs: CoreInputs) -> tuple[Tensor, list[Tensor | None]]:
    """S again, with autograd, to carry its gradient to Q, K and the positional bias as forward's ops do: (S, the
    leaves it was computed from: Q, K and the bias, each None where absent). Which of them need a gradient comes
    from the inputs (the saved keys are a contiguous copy of them)."""
    pairs = ((inputs.query, needs.query), (inputs.key, needs.key), (inputs.position_bias, needs.position_bias))
    leaves = [None if t is None else t.detach().requires_grad_(need) for t, need in pairs]
    device, autocast, autocast_dtype = ctx.autocast
    constants = ctx.constants
    with torch.enable_grad(), torch.autocast(device, dtype=autocast_dtype, enabled=autocast):
        scores = attention_scores(leaves[0], leaves[1], constants.scaling, leaves[2], constants.softcap)
        scores = evolution_maps(scores, inputs.weight)
    return scores, leaves


def _scores_input_gradients(
    ctx, inputs: CoreInputs, needs: CoreInputs, scores: Tensor, leaves: list | None, grad_scores: ScaledMap | None
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The gradients of Q, K and the positional bias from S's (``grad_scores``): directly where S is the plain
    product (:func:`~.scores.scores_backward`), else through autograd from ``scores`` to its ``leaves``."""
    if ctx.plain:
        if grad_scores is None:
            return None, None, None
        scaling = ctx.constants.scaling
        prescaled = ctx.product_scaling != scaling
        grad_query, grad_key = scores_backward(
            grad_scores.map, inputs.query, inputs.key, scaling, (needs.query, needs.key), prescaled,
            gradient_scale=grad_scores.scale,
        )  # fmt: skip
        return grad_query, grad_key, None
    wanted = [t for t in leaves if t is not None and t.requires_grad]
    grads = {}
    if grad_scores is not None and wanted:
        found = torch.autograd.grad(scores, wanted, grad_scores.map)
        if grad_scores.scale != 1.0:
            # Not in place: a bias as large as S gets the map itself as its gradient, and the map is also A_prev's
            # gradient.
            found = [g * grad_scores.scale for g in found]
        grads = dict(zip(map(id, wanted), found, strict=True))
    grad_query, grad_key, grad_positions = (None if t is None else grads.get(id(t)) for t in leaves)
    return grad_query, grad_key, grad_positions

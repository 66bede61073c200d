"""The attention core while ``torch.compile`` traces: the layer's operators inside a selective activation
checkpoint (:func:`compiled_core`), and the choice between it and :class:`~.attention_core.EvolvingAttentionCore`
(:func:`evolving_attention_core`).

The checkpoint keeps A_logit and the gate and recomputes S and P: the maps the eager core keeps, in a graph that
inductor plans. Where the maps are small it keeps S as well, and recomputes P, which the eager core keeps.

This file is copied beside the weights of saved EA checkpoints (``trust_remote_code``): it imports only torch,
transformers and sibling files (single-dot relative imports).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .attention_core import CoreConstants, CoreInputs, CoreMasks, EvolvingAttentionCore
from .attention_tail import attend_values, dropout_scale, kept_by_dropout
from .convolution import evolve_convolution
from .kernels import fused_attention_tail, fused_kernel
from .scores import attention_scores, evolution_dtype, evolution_maps, keeps_small_maps, scores_stand_in
from .step import EvolutionStep, StepMaps

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


def evolving_attention_core(
    constants: CoreConstants, masks: CoreMasks, inputs: CoreInputs
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(output [B, H, Q, D], A_logit, attention weights or None) of one evolving attention layer: by
    :class:`~.attention_core.EvolvingAttentionCore`, which keeps one map for backward instead of three, or while
    torch.compile traces by :func:`compiled_core`, which keeps what the core keeps, less P on small maps."""
    if torch.compiler.is_compiling():
        return compiled_core(constants, masks, *inputs)
    return EvolvingAttentionCore.apply(constants, masks, *inputs)


def compiled_core(
    constants: CoreConstants,
    masks: CoreMasks,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    previous: Tensor | None,
    position_bias: Tensor | None,
    weight: Tensor,
    bias: Tensor,
    alpha: Tensor | None = None,
    beta: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """What :class:`~.attention_core.EvolvingAttentionCore` computes, with the arguments of its ``apply``, in a
    form ``torch.compile`` traces (whose kernel operators correlate the masked tails too: the step's
    ``skip_masked_tails`` is left out here, ``constants.spare_maps`` unused: a compiled graph plans its own
    buffers): the layer's operators inside a selective activation checkpoint that keeps A_logit and the gate of the
    fused kernel (and dropout's mask) and recomputes S and P in backward, as the core does. Without the checkpoint,
    a compiled training step would keep S, A_logit and P per layer. Where the maps are small
    (:func:`~.scores.keeps_small_maps`), S is kept (computed before the checkpoint) and only P is recomputed.
    Where no fused kernel applies (the torch-operation path: recomputing would repeat its convolution), the
    operators run without a checkpoint. Where nobody reads the weights (``constants.weights_read`` False), a fused
    attention tail takes the softmax and the product as its operator, which keeps its rows' statistics, not P
    (dropout's mask is drawn before the checkpoint, which keeps it as an input), and the weights come back as None.

    Example:
        >>> q, k, v = (torch.randn(1, 2, 20, 4) for _ in range(3))
        >>> weight, bias = torch.randn(2, 2, 3, 3), torch.zeros(2)
        >>> constants = CoreConstants(EvolutionStep(alpha=0.0, beta=0.3, context_rows=1), scaling=0.5)
        >>> inputs = (q, k, v, None, None, weight, bias)
        >>> got = compiled_core(constants, CoreMasks(), *inputs)
        >>> expected = EvolvingAttentionCore.apply(constants, CoreMasks(), *inputs)
        >>> all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, expected))
        True
    """
    if alpha is not None or beta is not None:  # a traced layer's learned gates run in its forward (see .gates)
        raise ValueError("compiled_core takes fixed gates only; learned gates are traced as torch operations")
    step, scaling, softcap, dropout = constants.step, constants.scaling, constants.softcap, constants.dropout
    conv_mask, mask = masks

    def scores_of(query, key, position_bias):
        return evolution_maps(attention_scores(query, key, scaling, position_bias, softcap), weight)

    # The masked tails correlated as the operators correlate them, also where this runs uncompiled.
    whole_rows = EvolutionStep(step.alpha, step.beta, step.context_rows, step.causal)

    # A stand-in with S's (and A_logit's) shape, device and dtype to ask whether a fused kernel takes the maps.
    maps = scores_stand_in(query, key, evolution_dtype(scores_stand_in(query, key, query.dtype), weight))
    tail = None if constants.weights_read else fused_attention_tail(maps, mask, value)
    dropout_keep = None
    if tail is not None and dropout > 0.0:  # drawn outside the checkpoint, whose replay would draw anew
        dropout_keep = kept_by_dropout(maps, dropout)

    def after_scores(scores, value, previous, weight, bias, dropout_keep):
        keep = None if conv_mask is None else conv_mask.to(scores.dtype)
        logits = evolve_convolution(whole_rows, StepMaps(scores, previous, keep), weight, bias)
        if tail is not None:
            output = tail.attend(logits, mask.allowed, mask.additive, value, dropout_keep, dropout_scale(dropout))
            return output, logits, None
        output, probabilities, _, _ = attend_values(logits, mask, value, dropout)
        return output, logits, probabilities

    def core(query, key, value, previous, position_bias, weight, bias, dropout_keep):
        return after_scores(scores_of(query, key, position_bias), value, previous, weight, bias, dropout_keep)

    tensors = (query, key, value, previous, position_bias, weight, bias, dropout_keep)
    if fused_kernel(maps, previous, keep=conv_mask, weight=weight) is None:
        return core(*tensors)
    policy = functools.partial(create_selective_checkpoint_contexts, _keep_logits_and_gate)
    if keeps_small_maps(query, key, position_bias, softcap):
        # S computed before the checkpoint, which keeps its inputs: S is kept, as the core keeps it, and P is
        # recomputed. The core keeps P too, but compiled the map weighs more, as inductor fuses away much of the
        # rest of a step (see docs/performance.md, "Choices in the hot path").
        scores = scores_of(query, key, position_bias)
        return checkpoint(
            after_scores, scores, value, previous, weight, bias, dropout_keep, use_reentrant=False, context_fn=policy
        )
    return checkpoint(core, *tensors, use_reentrant=False, context_fn=policy)

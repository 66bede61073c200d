"""The interfaces of the fused kernels and their registries, defined once: :class:`FusedKernel` (the evolution step)
and :class:`FusedAttentionTail` (the masked softmax, dropout and the product with the values after it).

``ea_hf.ops`` registers its implementations here (:func:`register_fused_kernel`,
:func:`register_fused_attention_tail`); the modeling code takes the first registered one that says it applies
(:func:`fused_kernel`, :func:`fused_attention_tail`) and runs the same steps as torch operations where none does.

This file is copied beside the weights of saved EA checkpoints (``trust_remote_code``): it imports only torch,
transformers and sibling files (single-dot relative imports). Remote-code copies have no registered kernels.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from .masks import AttentionMask
from .step import EvolutionStep, GradientIn, ScaledMap, StepMaps


class FusedKernel(Protocol):
    """What a fused implementation of the evolution step provides (``ea_hf.ops.cpu``, ``ea_hf.ops.triton_kernels``).

    ``evolve`` is the forward step with a beta-scaled kernel (``weight`` and ``bias`` times beta):
    (A_logit, the ReLU gate in the form its ``backward`` reads: a bool map, or :func:`~.step.packed_gate`'s), or
    with ``in_place`` A_logit written over ``maps.scores`` and no gate unless ``gate`` (default: a gate unless in
    place). ``convolve`` is a plain correlation plus bias whose output row i reads input rows ``i + row_shift ..``.
    ``backward`` gives the gradients of S, of A_prev (``None`` without it) and of the beta-scaled kernel's weight
    and bias, from the gate and the beta-scaled ``weight`` of the forward step; with ``shared_map`` it may
    return S's gradient as a :class:`~.step.ScaledMap` of A_prev's. ``select_kept`` runs the attention core's masked
    passes, ``keep ? scale * x : fill`` (into ``out`` where given), or returns ``None`` where the kernel does not
    take them. ``applicable`` says whether the kernel takes these maps and this kernel weight.
    """

    def applicable(self, *tensors: Tensor | None, keep: Tensor | None = None, weight: Tensor) -> bool: ...

    def evolve(
        self, step: EvolutionStep, maps: StepMaps, weight: Tensor, bias: Tensor, *, in_place: bool, gate: bool | None
    ) -> tuple[Tensor, Tensor | None]: ...

    def convolve(self, x: Tensor, weight: Tensor, bias: Tensor, *, row_shift: int) -> Tensor: ...

    def backward(
        self, step: EvolutionStep, maps: StepMaps, grad: GradientIn, gate: Tensor, weight: Tensor, *, shared_map: bool
    ) -> tuple[Tensor | ScaledMap, Tensor | None, Tensor, Tensor]: ...

    def select_kept(self, x: Tensor, keep: Tensor, scale: float, fill: float, out: Tensor | None) -> Tensor | None: ...


class FusedAttentionTail(Protocol):
    """What a fused implementation of the attention tail after the evolution provides (``ea_hf.ops.triton_attention``):
    the masked softmax over the evolved logits, dropout and the product with the values, without forming P.

    The attention mask comes as its two tensors, ``allowed`` and ``additive`` (an :class:`~.masks.AttentionMask`
    unpacked), as the tail's torch operators take them. ``forward`` returns (the output [B, H, Q, D] in the values'
    dtype, row statistics for ``backward``), masking as :func:`~.softmax.masked_logits` does and dropping where
    ``dropout_keep`` (bool [B, H, Q, K]) is False, the kept weights scaled by ``dropout_scale``; ``backward``
    returns (the logits' gradient in ``grad_dtype``, the values' gradient) from forward's row statistics and the
    output's gradient (both also while torch.compile traces, as operators); ``attend`` returns forward's output,
    differentiable in the logits and the values (what :func:`~.compiled.compiled_core` calls). ``applicable`` says
    whether it takes these tensors.
    """

    def applicable(self, logits: Tensor, allowed: Tensor | None, additive: Tensor | None, value: Tensor) -> bool: ...

    def forward(
        self,
        logits: Tensor,
        allowed: Tensor | None,
        additive: Tensor | None,
        value: Tensor,
        dropout_keep: Tensor | None,
        dropout_scale: float,
    ) -> tuple[Tensor, Tensor]: ...

    def backward(
        self,
        logits: Tensor,
        allowed: Tensor | None,
        additive: Tensor | None,
        value: Tensor,
        dropout_keep: Tensor | None,
        dropout_scale: float,
        stats: Tensor,
        grad_output: Tensor,
        grad_dtype: torch.dtype,
    ) -> tuple[Tensor, Tensor]: ...

    def attend(
        self,
        logits: Tensor,
        allowed: Tensor | None,
        additive: Tensor | None,
        value: Tensor,
        dropout_keep: Tensor | None,
        dropout_scale: float,
    ) -> Tensor: ...


#: Fused kernels of the evolution step, tried in order; registered by ``ea_hf.ops``.
FUSED_KERNELS: list[FusedKernel] = []
#: Fused attention tails, tried in order; registered by ``ea_hf.ops``.
FUSED_ATTENTION_TAILS: list[FusedAttentionTail] = []


def register_fused_kernel(kernel: FusedKernel) -> None:
    """Use ``kernel`` for the evolution step wherever it says it is applicable (idempotent)."""
    if kernel not in FUSED_KERNELS:
        FUSED_KERNELS.append(kernel)


def register_fused_attention_tail(tail: FusedAttentionTail) -> None:
    """Use ``tail`` in the attention core wherever it says it is applicable (idempotent)."""
    if tail not in FUSED_ATTENTION_TAILS:
        FUSED_ATTENTION_TAILS.append(tail)


def fused_kernel(*tensors: Tensor | None, keep: Tensor | None = None, weight: Tensor) -> FusedKernel | None:
    """The first registered kernel applicable to these tensors, or None (torch operations)."""
    # A loop, not next() over a generator: torch 2.8's dynamo cannot trace that (fullgraph fails).
    for kernel in FUSED_KERNELS:
        if kernel.applicable(*tensors, keep=keep, weight=weight):
            return kernel
    return None


def fused_select_kept(x: Tensor, keep: Tensor, scale: float, fill: float, out: Tensor | None) -> Tensor | None:
    """``keep ? scale * x : fill`` by the first registered kernel that takes these tensors (its ``select_kept``),
    or None where none does."""
    for kernel in FUSED_KERNELS:  # a loop, as in fused_kernel
        result = kernel.select_kept(x, keep, scale, fill, out)
        if result is not None:
            return result
    return None


def fused_attention_tail(logits: Tensor, mask: AttentionMask, value: Tensor) -> FusedAttentionTail | None:
    """The first registered tail applicable to these tensors, or None (softmax and product as torch operations)."""
    for tail in FUSED_ATTENTION_TAILS:
        if tail.applicable(logits, mask.allowed, mask.additive, value):
            return tail
    return None

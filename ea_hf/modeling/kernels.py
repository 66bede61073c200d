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
    """What a fused implementation of the evolution step provides (``ea_hf.ops.cpu.evolution``,
    ``ea_hf.ops.triton.evolution``).

    A module with these five functions is one (``ea_hf.ops`` registers its modules with
    :func:`register_fused_kernel`). The step is the one :mod:`.step` defines: A_in = lerp(S, A_prev, alpha),
    A_logit = beta * ReLU(Conv(A_in * keep)) + (1 - beta) * A_in. ``evolve``, ``convolve`` and ``backward`` take
    the kernel beta-scaled (``weight`` and ``bias`` times beta), and the ReLU gate that ``evolve`` returns is
    what ``backward`` reads: a bool map, or :func:`~.step.packed_gate`'s form.
    """

    def applicable(self, *tensors: Tensor | None, keep: Tensor | None = None, weight: Tensor) -> bool:
        """Whether the kernel takes these maps and this kernel weight (device, dtype, shapes, mask).

        Args:
            *tensors: the maps the step would read (S, A_prev, a gradient...; None where absent).
            keep: the convolution's input mask, if any.
            weight: the convolution weight [H, H, kh, kw].

        Returns:
            True if every other function may be called on them.
        """

    def evolve(
        self, step: EvolutionStep, maps: StepMaps, weight: Tensor, bias: Tensor, *, in_place: bool, gate: bool | None
    ) -> tuple[Tensor, Tensor | None]:
        """The step's forward.

        Args:
            step: alpha, beta, the kernel's context rows, causality and whether masked tails may be skipped.
            maps: S, A_prev (None: A_in = S) and the convolution's input mask.
            weight: the beta-scaled convolution weight.
            bias: the beta-scaled convolution bias.
            in_place: write A_logit over ``maps.scores``.
            gate: return the ReLU gate (None: a gate unless in place).

        Returns:
            A_logit, and the ReLU gate for ``backward`` (None without ``gate``).
        """

    def convolve(self, x: Tensor, weight: Tensor, bias: Tensor, *, row_shift: int) -> Tensor:
        """A plain correlation plus bias (the kept rows of a decoding step).

        Args:
            x: the input map [B, H, R, K].
            weight: the beta-scaled convolution weight [H, H, kh, kw].
            bias: the beta-scaled convolution bias [H].
            row_shift: output row i reads input rows ``i + row_shift .. i + row_shift + kh - 1`` (rows outside
                ``x`` read as zeros; the columns are centred, as a padded convolution's).

        Returns:
            The correlation, of ``x``'s shape.
        """

    def backward(
        self, step: EvolutionStep, maps: StepMaps, grad: GradientIn, gate: Tensor, weight: Tensor, *, shared_map: bool
    ) -> tuple[Tensor | ScaledMap, Tensor | None, Tensor, Tensor]:
        """The step's whole backward, from the forward's gate.

        Args:
            step: as ``evolve`` took it.
            maps: as ``evolve`` took them (S as it was before an in-place forward).
            grad: A_logit's gradient (plus an addend, and whether it may be written over).
            gate: the ReLU gate ``evolve`` returned.
            weight: the beta-scaled convolution weight of the forward step.
            shared_map: S's gradient may be returned as a :class:`~.step.ScaledMap` of A_prev's.

        Returns:
            The gradients of S, of A_prev (None without A_prev), and of the beta-scaled kernel's weight and bias.
        """

    def select_kept(self, x: Tensor, keep: Tensor, scale: float, fill: float, out: Tensor | None) -> Tensor | None:
        """The attention core's masked passes: ``keep ? scale * x : fill``.

        Args:
            x: the map [B, H, Q, K].
            keep: a bool mask broadcastable to ``x``.
            scale: the factor of the kept entries.
            fill: the value of the others.
            out: where to write the result (it may be ``x``); None: a new tensor.

        Returns:
            The result, or None where the kernel does not take these tensors.
        """


class FusedAttentionTail(Protocol):
    """What a fused implementation of the attention tail after the evolution provides
    (``ea_hf.ops.triton.attention_tail``): the masked softmax over the evolved logits, dropout and the product
    with the values, without forming P.

    A module with these four functions is one (``ea_hf.ops`` registers it with
    :func:`register_fused_attention_tail`). The attention mask comes as its two tensors, ``allowed`` and
    ``additive`` (an :class:`~.masks.AttentionMask` unpacked), as the tail's torch operators take them; the tail
    masks as :func:`~.attention_tail.masked_logits` does. Both ``forward`` and ``backward`` also run while
    torch.compile traces (as operators).
    """

    def applicable(self, logits: Tensor, allowed: Tensor | None, additive: Tensor | None, value: Tensor) -> bool:
        """Whether the tail takes these tensors.

        Args:
            logits: the evolved logits A_logit [B, H, Q, K].
            allowed: a bool mask broadcastable to the logits (False: masked), or None.
            additive: an additive mask broadcastable to the logits, or None.
            value: the values [B, H_kv, K, D].

        Returns:
            True if ``forward``, ``backward`` and ``attend`` may be called on them.
        """

    def forward(
        self,
        logits: Tensor,
        allowed: Tensor | None,
        additive: Tensor | None,
        value: Tensor,
        dropout_keep: Tensor | None,
        dropout_scale: float,
    ) -> tuple[Tensor, Tensor]:
        """softmax(mask(logits)), with dropout, times the values.

        Args:
            logits: the evolved logits [B, H, Q, K]; ``allowed``, ``additive`` and ``value`` as ``applicable``
                takes them.
            dropout_keep: bool [B, H, Q, K], False where dropout drops a weight; None: no dropout.
            dropout_scale: the factor of the kept weights.

        Returns:
            The output [B, H, Q, D] in the values' dtype, and the row statistics ``backward`` reads.
        """

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
        addend: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """The gradients of ``forward``, from the arguments it took and the following four.

        Args:
            stats: the row statistics ``forward`` returned.
            grad_output: the gradient of the output.
            grad_dtype: the dtype of the logits' gradient.
            addend: a gradient of the logits from elsewhere [B, H, Q, K] (the next layer's, through its A_prev),
                added to theirs as it is written; only read; None: none.

        Returns:
            The logits' gradient (plus ``addend``) in ``grad_dtype``, and the values' gradient.
        """

    def attend(
        self,
        logits: Tensor,
        allowed: Tensor | None,
        additive: Tensor | None,
        value: Tensor,
        dropout_keep: Tensor | None,
        dropout_scale: float,
    ) -> Tensor:
        """``forward``'s output from ``forward``'s arguments, differentiable in the logits and the values (what
        :func:`~.compiled.compiled_core` calls).

        Returns:
            The output [B, H, Q, D].
        """


#: Fused kernels of the evolution step, tried in order; registered by ``ea_hf.ops``.
FUSED_KERNELS: list[FusedKernel] = []
#: Fused attention tails, tried in order; registered by ``ea_hf.ops``.
FUSED_ATTENTION_TAILS: list[FusedAttentionTail] = []


def register_fused_kernel(kernel: FusedKernel) -> None:
    """Use ``kernel`` for the evolution step wherever it says it is applicable (idempotent).

    Args:
        kernel: the implementation; kernels are tried in the order they were registered.
    """
    if kernel not in FUSED_KERNELS:
        FUSED_KERNELS.append(kernel)


def register_fused_attention_tail(tail: FusedAttentionTail) -> None:
    """Use ``tail`` in the attention core wherever it says it is applicable (idempotent).

    Args:
        tail: the implementation; tails are tried in the order they were registered.
    """
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

"""The evolution step's settings and maps, and the fused kernels' bit-packed gate format (their protocol is
:class:`~.kernels.FusedKernel`).

Every path of the step (torch operations in ``convolution``, the attention core, the kernels of ``ea_hf.ops``)
takes an :class:`EvolutionStep` first, then the step's maps and the kernel, in that order. alpha and beta are the
paper's (TPAMI 2023, section 3.1) at every level:

    A_in    = alpha * A_prev + (1 - alpha) * S = lerp(S, A_prev, alpha)
    A_logit = beta * ReLU(Conv(A_in * keep)) + (1 - beta) * A_in

Only a kernel's native interface (the C ABI, the torch.library schemas) takes primitive arguments, unpacked from
the step in one place each.

This file is copied beside the weights of saved EA checkpoints (``trust_remote_code``): it imports only torch,
transformers and sibling files (single-dot relative imports).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
from torch import Tensor


@dataclasses.dataclass(frozen=True)
class EvolutionStep:
    """The settings of one evolution step: the residual weight ``alpha`` and the convolution's weight ``beta``
    (above), the kernel's ``context_rows`` (output row i reads input rows i - c .. : c = kernel height // 2, the
    rows above the centre, also for a causal kernel, whose rows stop at its centre), whether the kernel is
    ``causal``, and ``skip_masked_tails``: the caller's softmax masks, in every layer of the chain, the entries
    right of each row's last kept column, so a kernel may leave them out (the CPU kernel does, see
    ``ea_hf.ops.cpu.binding.forward_correlation``).

    Example:
        >>> step = EvolutionStep(alpha=0.2, beta=0.3, context_rows=1)
        >>> step.causal, step.skip_masked_tails
        (False, False)
    """

    alpha: float
    beta: float
    context_rows: int
    causal: bool = False
    skip_masked_tails: bool = False


class StepMaps(NamedTuple):
    """The maps a step's A_in is made of: S (``scores``, [B, H, Q, K]), A_prev (``previous``, ``None``: A_in = S)
    and the convolution's input mask (``keep``, a float 0/1 mask broadcastable to S; ``None``: every entry enters
    the convolution)."""

    scores: Tensor
    previous: Tensor | None
    keep: Tensor | None


class GradientIn(NamedTuple):
    """The gradient of A_logit that a step's backward takes: ``grad``, plus ``addend`` where given (a second
    gradient of A_logit, the next layer's through its A_prev: a kernel adds it as it reads). ``spent``: ``grad`` is
    a map the caller no longer needs, which the gradients may be written over instead of new maps."""

    grad: Tensor
    addend: Tensor | None = None
    spent: bool = False


class ScaledMap(NamedTuple):
    """``scale * map``, not multiplied out: a fused backward writes the gradient of A_in once, as A_prev's
    gradient alpha * G_in, and gives S's, (1 - alpha) * G_in, as that map times (1 - alpha) / alpha. The
    attention core folds the factor into the products that consume S's gradient (the gradients of Q and K):
    one [B, H, Q, K] map less to write and to allocate in every layer's backward.

    Example:
        >>> gradient = ScaledMap(torch.ones(2), 0.5)
        >>> gradient.scale * gradient.map
        tensor([0.5000, 0.5000])
    """

    map: Tensor
    scale: float


# --------------------------------------------------------------------------------------------------------------
# The fused kernels' ReLU gate format (the CPU and the Triton kernels write and read it), which torch operations
# also read.
# --------------------------------------------------------------------------------------------------------------


def packed_gate(scores: Tensor) -> Tensor:
    """A bit-packed ReLU gate for maps like ``scores`` [B, H, Q, K], the form the fused kernels write and read:
    per row, ceil(K / 16) little-endian 16-bit words (as bytes), bit j % 16 of word j // 16 for column j, and
    zeros past the last column. An eighth of a bool map's memory. Zeros until written (a kernel with 8-column
    vectors writes a byte a vector and leaves a row's last byte alone where its vectors are odd in number).

    Example:
        >>> packed_gate(torch.zeros(2, 3, 5, 40)).shape
        torch.Size([2, 3, 5, 6])
    """
    return scores.new_zeros(packed_gate_shape(scores.shape), dtype=torch.uint8)


def packed_gate_shape(shape: torch.Size) -> torch.Size:
    """The shape of a :func:`packed_gate` for maps of ``shape``: two bytes a 16 columns (or fewer, at the end).

    Example:
        >>> tuple(packed_gate_shape(torch.Size([2, 3, 5, 33])))
        (2, 3, 5, 6)
    """
    return torch.Size((*shape[:-1], 2 * -(-shape[-1] // 16)))


def pack_gate(gate: Tensor) -> Tensor:
    """A bool ReLU gate in :func:`packed_gate`'s form (a packed one as it is).

    Example:
        >>> gate = torch.rand(2, 3, 4, 21) > 0.5
        >>> torch.equal(unpacked_gate(pack_gate(gate), 21), gate)
        True
    """
    if gate.dtype != torch.bool:
        return gate
    padded = gate.new_zeros((*gate.shape[:-1], 8 * packed_gate_shape(gate.shape)[-1]))
    padded[..., : gate.shape[-1]] = gate
    bits = padded.unflatten(-1, (-1, 8)).to(torch.uint8) << torch.arange(8, dtype=torch.uint8, device=gate.device)
    return bits.sum(-1, dtype=torch.uint8)


def checked_packed_gate(gate: Tensor | None, like: Tensor) -> Tensor | None:
    """``gate`` if it is a contiguous :func:`packed_gate` for maps like ``like`` (or None); else a ValueError.

    Example:
        >>> scores = torch.zeros(1, 2, 3, 20)
        >>> checked_packed_gate(packed_gate(scores), scores).shape
        torch.Size([1, 2, 3, 4])
    """
    if gate is not None:
        shape = packed_gate_shape(like.shape)
        if gate.dtype != torch.uint8 or gate.shape != shape or not gate.is_contiguous():
            raise ValueError(
                f"the fused kernels' ReLU gate is bit-packed (packed_gate): a contiguous torch.uint8 map of shape "
                f"{tuple(shape)}, not {gate.dtype} {tuple(gate.shape)}"
            )
    return gate


def unpacked_gate(gate: Tensor, cols: int) -> Tensor:
    """A ReLU gate as a bool map of ``cols`` columns: ``gate`` itself where it is one, else unpacked from
    :func:`packed_gate`'s form.

    Example:
        >>> packed = torch.tensor([[0b00000101, 0b10000000]], dtype=torch.uint8)
        >>> unpacked_gate(packed, 16).nonzero()[:, -1].tolist()
        [0, 2, 15]
    """
    if gate.dtype == torch.bool:
        return gate
    bits = gate.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8, device=gate.device)
    return (bits & 1).flatten(-2)[..., :cols].bool()

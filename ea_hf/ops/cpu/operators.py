"""The CPU kernel as torch operators (``torch.ops.ea_hf.*``, declared with ``torch.library.custom_op``, with fake
implementations and a registered autograd formula), so that ``torch.compile`` and ``torch.export`` see it as one
node of the graph instead of stopping at a ctypes call.

The schemas take primitive arguments: an :class:`~ea_hf.modeling.step.EvolutionStep` is unpacked into them by
:func:`~ea_hf.ops.fused_step.schema_arguments`, and the operators' bodies pack them into one again with
:func:`~ea_hf.ops.fused_step.schema_step` (shared with the Triton operators).
"""

from __future__ import annotations

import torch

from ...modeling.step import EvolutionStep, GradientIn, StepMaps, packed_gate
from ..fused_step import (
    CONVOLVE_SCHEMA,
    EVOLVE_SCHEMA,
    evolve_by_correlation,
    register_step_autograd,
    schema_arguments,
    schema_step,
)
from . import binding


def split_map_gradient(
    grad_map: torch.Tensor, previous: torch.Tensor | None, alpha: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gradients of S and of A_prev from the one map ``ea_hf::evolve_backward_one_map`` writes: S's
    gradient, (1 - alpha) * G_in, is the map (G_in without A_prev), and A_prev's, alpha * G_in, that map times
    alpha / (1 - alpha); where alpha = 1 the map is G_in, A_prev's, and S's is zero.

    Why S's and not A_prev's: in a compiled graph S's gradient goes into the products for the gradients of Q
    and K, which read a map as it is, while A_prev's is added to the previous layer's softmax gradient, a
    pointwise kernel into which inductor fuses the multiplication (no map is written for it).

    Example:
        >>> grad_in = torch.ones(1, 1, 2, 2)
        >>> grad_scores, grad_previous = split_map_gradient((1 - 0.2) * grad_in, torch.zeros(1, 1, 2, 2), 0.2)
        >>> torch.allclose(grad_scores, 0.8 * grad_in), torch.allclose(grad_previous, 0.2 * grad_in)
        (True, True)
    """
    if previous is None:
        return grad_map, None
    if alpha == 1.0:
        return torch.zeros_like(grad_map), grad_map
    return grad_map, grad_map * (alpha / (1.0 - alpha))


def one_map_backward(
    step: EvolutionStep, maps: StepMaps, grad: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The gradients of S, A_prev (``None`` without it), the beta-scaled weight and bias through the operator
    ``ea_hf::evolve_backward_one_map`` and :func:`split_map_gradient`: what compiled graphs call."""
    scores, previous, keep = maps
    grad_map, grad_weight, grad_bias = torch.ops.ea_hf.evolve_backward_one_map(
        scores, previous, keep, grad, gate, weight, *schema_arguments(step)
    )
    return (*split_map_gradient(grad_map, previous, step.alpha), grad_weight, grad_bias)


#: The CPU operators' own schemas (maps float32 [B, H, Q, K] on CPU; the arguments as in
#: :data:`~ea_hf.ops.fused_step.EVOLVE_SCHEMA`): the forward written over S, and the backward's one map and kernel
#: gradients.
EVOLVE_IN_PLACE_SCHEMA = (
    "(Tensor(a!) scores, Tensor? previous, Tensor? keep, Tensor weight, Tensor bias, float alpha, float blend, "
    "int context_rows) -> ()"
)
EVOLVE_BACKWARD_SCHEMA = (
    "(Tensor scores, Tensor? previous, Tensor? keep, Tensor grad, Tensor gate, Tensor weight, float alpha, "
    "float blend, int context_rows) -> (Tensor, Tensor, Tensor)"
)


# Named for its gate: torch.compile's caches key a graph by the operators' names, not their fake implementations,
# so a graph cached with an operator that returned another form of gate must not match this one (it would fail at
# run time, in inductor's output size check).
@torch.library.custom_op("ea_hf::evolve_with_gate_bits", mutates_args=(), device_types="cpu", schema=EVOLVE_SCHEMA)
def evolve_operator(scores, previous, keep, weight, bias, alpha, blend, context_rows):
    """(ReLU(Conv(A_in * keep)) + (1 - beta) * A_in, its bit-packed ReLU gate), A_in = lerp(S, A_prev, alpha): the
    evolution step's forward pass, differentiable (its backward is ``ea_hf::evolve_backward_one_map``)."""
    step, maps = schema_step(alpha, blend, context_rows), StepMaps(scores, previous, keep)
    return evolve_by_correlation(binding.correlate, step, maps, weight, bias, in_place=False)


@evolve_operator.register_fake
def _(scores, previous, keep, weight, bias, alpha, blend, context_rows):
    return scores.new_empty(scores.shape), packed_gate(scores)


register_step_autograd(evolve_operator, one_map_backward)


def evolve_in_place(step: EvolutionStep, maps: StepMaps, weight: torch.Tensor, bias: torch.Tensor) -> None:
    """``ea_hf::evolve_with_gate_bits`` written over ``maps.scores``, without the gate (inference: one map less):
    the body of ``ea_hf::evolve_``, which ``ea_hf.ops.cpu.evolution.evolve`` also calls directly outside torch.compile
    (there also with ``step.skip_masked_tails``, see :func:`~ea_hf.ops.cpu.binding.forward_correlation`)."""
    correlation = binding.forward_correlation(step.skip_masked_tails)
    if maps.scores.is_contiguous():
        evolve_by_correlation(correlation, step, maps, weight, bias, in_place=True)
    else:
        maps.scores.copy_(evolve_by_correlation(correlation, step, maps, weight, bias, in_place=False, gate=False)[0])


@torch.library.custom_op("ea_hf::evolve_", mutates_args=("scores",), device_types="cpu", schema=EVOLVE_IN_PLACE_SCHEMA)
def evolve_in_place_operator(scores, previous, keep, weight, bias, alpha, blend, context_rows):
    """``ea_hf::evolve_with_gate_bits`` written over ``scores``, without the gate (see :func:`evolve_in_place`)."""
    evolve_in_place(schema_step(alpha, blend, context_rows), StepMaps(scores, previous, keep), weight, bias)


@evolve_in_place_operator.register_fake
def _(scores, previous, keep, weight, bias, alpha, blend, context_rows):
    return None


@torch.library.custom_op("ea_hf::convolve", mutates_args=(), device_types="cpu", schema=CONVOLVE_SCHEMA)
def convolve_operator(x, weight, bias, row_shift):
    """A plain correlation plus bias whose output row i reads rows ``i + row_shift ..`` of ``x``."""
    return binding.correlate(x, weight, bias, row_shift=row_shift)


@convolve_operator.register_fake
def _(x, weight, bias, row_shift):
    return x.new_empty(x.shape)


# One map out instead of the gradients of S and A_prev apart: glibc returns two fresh maps to the system after every
# call, and the next call faults all their pages in again (docs/performance.md, "Choices in the fused kernels"). Named
# for its one map, for torch.compile's caches (see above).
@torch.library.custom_op(
    "ea_hf::evolve_backward_one_map", mutates_args=(), device_types="cpu", schema=EVOLVE_BACKWARD_SCHEMA
)
def evolve_backward_operator(scores, previous, keep, grad, gate, weight, alpha, blend, context_rows):
    """The gradient map of ``ea_hf::evolve_with_gate_bits`` (see :func:`split_map_gradient`) and the gradients
    of its weight and bias."""
    step, maps = schema_step(alpha, blend, context_rows), StepMaps(scores, previous, keep)
    grad_map, _, grad_weight, grad_bias = binding.backward_pass(
        step, maps, GradientIn(grad), gate, weight, scores_map=True
    )
    return grad_map, grad_weight, grad_bias


@evolve_backward_operator.register_fake
def _(scores, previous, keep, grad, gate, weight, alpha, blend, context_rows):
    heads = scores.shape[1]
    return scores.new_empty(scores.shape), scores.new_empty(heads, heads, *weight.shape[-2:]), scores.new_empty(heads)

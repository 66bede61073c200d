"""The Triton kernels as torch operators (``torch.ops.ea_hf.triton_*``, declared with ``torch.library.custom_op``,
with fake implementations and a registered autograd formula), so that ``torch.compile`` keeps them in its graph
as one node each: traced instead, dynamo follows the kernels' launch into Triton's runtime (and, on the CPU, into
its interpreter), where it fails. ``ea_hf.ops.triton_kernels`` calls them while torch.compile traces; elsewhere
it runs their bodies directly.

The schemas are the CPU operators' (:data:`~.fused_step.EVOLVE_SCHEMA`), on CUDA tensors and, under Triton's
interpreter, on CPU ones; the maps may be float32, bfloat16 or float16, and the gate is a bool map.
"""

from __future__ import annotations

import torch

from ..modeling.step import GradientIn, StepMaps
from . import triton_kernels
from .fused_step import (
    CONVOLVE_SCHEMA,
    EVOLVE_SCHEMA,
    bool_gate,
    evolve_by_correlation,
    register_step_autograd,
    schema_step,
)

#: The backward's schema: the gradients of S and of A_prev (an empty tensor without A_prev: a schema's tensors
#: cannot be None), and of the beta-scaled kernel's weight and bias (float32).
BACKWARD_SCHEMA = (
    "(Tensor scores, Tensor? previous, Tensor? keep, Tensor grad, Tensor gate, Tensor weight, float alpha, "
    "float blend, int context_rows) -> (Tensor, Tensor, Tensor, Tensor)"
)
DEVICES = ("cuda", "cpu")


@torch.library.custom_op("ea_hf::triton_evolve", mutates_args=(), device_types=DEVICES, schema=EVOLVE_SCHEMA)
def evolve_operator(scores, previous, keep, weight, bias, alpha, blend, context_rows):
    """(ReLU(Conv(A_in * keep)) + (1 - beta) * A_in, its bool ReLU gate), A_in = lerp(S, A_prev, alpha), on the
    Triton kernels: the evolution step's forward pass, differentiable (its backward is
    ``ea_hf::triton_evolve_backward``)."""
    step, maps = schema_step(alpha, blend, context_rows), StepMaps(scores, previous, keep)
    return evolve_by_correlation(triton_kernels.correlate, step, maps, weight, bias, in_place=False)


@evolve_operator.register_fake
def _(scores, previous, keep, weight, bias, alpha, blend, context_rows):
    return scores.new_empty(scores.shape), bool_gate(scores)


@torch.library.custom_op("ea_hf::triton_evolve_backward", mutates_args=(), device_types=DEVICES, schema=BACKWARD_SCHEMA)
def backward_operator(scores, previous, keep, grad, gate, weight, alpha, blend, context_rows):
    """The gradients of ``ea_hf::triton_evolve``'s S, A_prev (empty without it), weight and bias."""
    step, maps = schema_step(alpha, blend, context_rows), StepMaps(scores, previous, keep)
    grad_scores, grad_previous, grad_weight, grad_bias = triton_kernels.backward_pass(
        step, maps, GradientIn(grad), gate, weight
    )
    return grad_scores, scores.new_empty(0) if grad_previous is None else grad_previous, grad_weight, grad_bias


@backward_operator.register_fake
def _(scores, previous, keep, grad, gate, weight, alpha, blend, context_rows):
    heads = scores.shape[1]
    grad_previous = scores.new_empty(0) if previous is None else scores.new_empty(scores.shape)
    kernel = weight.new_empty(heads, heads, *weight.shape[-2:], dtype=torch.float32)
    return scores.new_empty(scores.shape), grad_previous, kernel, weight.new_empty(heads, dtype=torch.float32)


register_step_autograd(evolve_operator, triton_kernels.backward_through_operator)


@torch.library.custom_op("ea_hf::triton_convolve", mutates_args=(), device_types=DEVICES, schema=CONVOLVE_SCHEMA)
def convolve_operator(x, weight, bias, row_shift):
    """A plain correlation plus bias whose output row i reads rows ``i + row_shift ..`` of ``x``, on Triton."""
    return triton_kernels.correlate(x, weight, bias, row_shift=row_shift)


@convolve_operator.register_fake
def _(x, weight, bias, row_shift):
    return x.new_empty(x.shape)

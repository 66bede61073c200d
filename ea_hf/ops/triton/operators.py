"""The Triton kernels as torch operators (``torch.ops.ea_hf.triton_*``, declared with ``torch.library.custom_op``,
with fake implementations and a registered autograd formula), so that ``torch.compile`` keeps them in its graph
as one node each: traced instead, dynamo follows the kernels' launch into Triton's runtime (and, on the CPU, into
its interpreter), where it fails. :mod:`.evolution` and :mod:`.attention_tail` call them while torch.compile traces;
elsewhere they run their bodies directly.

The evolution's schemas are the CPU operators' (:data:`~ea_hf.ops.fused_step.EVOLVE_SCHEMA`), on CUDA tensors and, under
Triton's interpreter, on CPU ones; the maps may be float32, bfloat16 or float16, and the gate is bit-packed
(``ea_hf.modeling.step.packed_gate``), as the CPU operators' is. The fused attention tail's operators
(``triton_attention_tail`` and its backward) take the evolved logits and the values, and keep the rows'
statistics for backward, not P.
"""

from __future__ import annotations

import torch

from ...modeling.step import GradientIn, StepMaps, packed_gate
from ..fused_step import (
    CONVOLVE_SCHEMA,
    EVOLVE_SCHEMA,
    evolve_by_correlation,
    register_step_autograd,
    schema_step,
)
from . import attention_tail, evolution

#: The backward's schema: the gradients of S and of A_prev (an empty tensor without A_prev: a schema's tensors
#: cannot be None), and of the beta-scaled kernel's weight and bias (float32).
BACKWARD_SCHEMA = (
    "(Tensor scores, Tensor? previous, Tensor? keep, Tensor grad, Tensor gate, Tensor weight, float alpha, "
    "float blend, int context_rows) -> (Tensor, Tensor, Tensor, Tensor)"
)
DEVICES = ("cuda", "cpu")


# Named for its gate, as ``ea_hf::evolve_with_gate_bits`` is (see there): torch.compile's caches key a graph by the
# operators' names, so a graph cached with an operator that returned another form of gate must not match this one.
@torch.library.custom_op(
    "ea_hf::triton_evolve_with_gate_bits", mutates_args=(), device_types=DEVICES, schema=EVOLVE_SCHEMA
)
def evolve_operator(scores, previous, keep, weight, bias, alpha, blend, context_rows):
    """(ReLU(Conv(A_in * keep)) + (1 - beta) * A_in, its packed ReLU gate), A_in = lerp(S, A_prev, alpha), on the
    Triton kernels: the evolution step's forward pass, differentiable (its backward is
    ``ea_hf::triton_evolve_backward``)."""
    step, maps = schema_step(alpha, blend, context_rows), StepMaps(scores, previous, keep)
    return evolve_by_correlation(evolution.correlate, step, maps, weight, bias, in_place=False)


@evolve_operator.register_fake
def _(scores, previous, keep, weight, bias, alpha, blend, context_rows):
    return scores.new_empty(scores.shape), packed_gate(scores)


@torch.library.custom_op("ea_hf::triton_evolve_backward", mutates_args=(), device_types=DEVICES, schema=BACKWARD_SCHEMA)
def backward_operator(scores, previous, keep, grad, gate, weight, alpha, blend, context_rows):
    """The gradients of ``ea_hf::triton_evolve_with_gate_bits``'s S, A_prev (empty without it), weight and bias."""
    step, maps = schema_step(alpha, blend, context_rows), StepMaps(scores, previous, keep)
    grad_scores, grad_previous, grad_weight, grad_bias = evolution.backward_pass(
        step, maps, GradientIn(grad), gate, weight
    )
    return grad_scores, scores.new_empty(0) if grad_previous is None else grad_previous, grad_weight, grad_bias


@backward_operator.register_fake
def _(scores, previous, keep, grad, gate, weight, alpha, blend, context_rows):
    heads = scores.shape[1]
    grad_previous = scores.new_empty(0) if previous is None else scores.new_empty(scores.shape)
    kernel = weight.new_empty(heads, heads, *weight.shape[-2:], dtype=torch.float32)
    return scores.new_empty(scores.shape), grad_previous, kernel, weight.new_empty(heads, dtype=torch.float32)


register_step_autograd(evolve_operator, evolution.backward_through_operator)


@torch.library.custom_op("ea_hf::triton_convolve", mutates_args=(), device_types=DEVICES, schema=CONVOLVE_SCHEMA)
def convolve_operator(x, weight, bias, row_shift):
    """A plain correlation plus bias whose output row i reads rows ``i + row_shift ..`` of ``x``, on Triton."""
    return evolution.correlate(x, weight, bias, row_shift=row_shift)


@convolve_operator.register_fake
def _(x, weight, bias, row_shift):
    return x.new_empty(x.shape)


#: The fused attention tail's operators (:mod:`.attention_tail`): the output and the rows' statistics
#: from the evolved logits and the values; and their gradients, the logits' in their own dtype.
TAIL_SCHEMA = (
    "(Tensor logits, Tensor? allowed, Tensor? additive, Tensor value, Tensor? dropout_keep, float dropout_scale) "
    "-> (Tensor, Tensor)"
)
TAIL_BACKWARD_SCHEMA = (
    "(Tensor logits, Tensor? allowed, Tensor? additive, Tensor value, Tensor? dropout_keep, float dropout_scale, "
    "Tensor stats, Tensor grad_output) -> (Tensor, Tensor)"
)


@torch.library.custom_op("ea_hf::triton_attention_tail", mutates_args=(), device_types=DEVICES, schema=TAIL_SCHEMA)
def tail_operator(logits, allowed, additive, value, dropout_keep, dropout_scale):
    """(softmax(mask(logits)) with dropout @ value, the rows' maximum and sum [2, B, H, Q]) on the Triton kernels,
    differentiable in the logits and the values (see :func:`.attention_tail.forward`)."""
    return attention_tail.forward(logits, allowed, additive, value, dropout_keep, dropout_scale)


@tail_operator.register_fake
def _(logits, allowed, additive, value, dropout_keep, dropout_scale):
    batch, heads, rows, _ = logits.shape
    output = value.new_empty(batch, heads, rows, value.shape[-1])
    return output, logits.new_empty(2, batch, heads, rows, dtype=torch.float32)


@torch.library.custom_op(
    "ea_hf::triton_attention_tail_backward", mutates_args=(), device_types=DEVICES, schema=TAIL_BACKWARD_SCHEMA
)
def tail_backward_operator(logits, allowed, additive, value, dropout_keep, dropout_scale, stats, grad_output):
    """The gradients of ``ea_hf::triton_attention_tail``'s logits (in their dtype) and values."""
    return attention_tail.backward(
        logits, allowed, additive, value, dropout_keep, dropout_scale, stats, grad_output, logits.dtype
    )


@tail_backward_operator.register_fake
def _(logits, allowed, additive, value, dropout_keep, dropout_scale, stats, grad_output):
    return logits.new_empty(logits.shape), value.new_empty(value.shape)


def _tail_setup_context(ctx, inputs, output):
    logits, allowed, additive, value, dropout_keep, dropout_scale = inputs
    ctx.save_for_backward(logits, allowed, additive, value, dropout_keep, output[1])
    ctx.dropout_scale = dropout_scale


def _tail_formula(ctx, grad_output, _grad_stats):
    logits, allowed, additive, value, dropout_keep, stats = ctx.saved_tensors
    if grad_output is None:  # only the statistics were used: no gradient flows back
        return None, None, None, None, None, None
    grad_logits, grad_value = tail_backward_operator(
        logits, allowed, additive, value, dropout_keep, ctx.dropout_scale, stats, grad_output
    )
    return grad_logits, None, None, grad_value, None, None


tail_operator.register_autograd(_tail_formula, setup_context=_tail_setup_context)

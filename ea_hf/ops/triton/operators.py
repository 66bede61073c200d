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

import math

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
#: from the evolved logits and the values; and their gradients, the logits' in their own dtype (plus an optional
#: addend: the attention core's other gradient of the logits, added as the kernel writes theirs).
TAIL_SCHEMA = (
    "(Tensor logits, Tensor? allowed, Tensor? additive, Tensor value, Tensor? dropout_keep, float dropout_scale) "
    "-> (Tensor, Tensor)"
)
TAIL_BACKWARD_SCHEMA = (
    "(Tensor logits, Tensor? allowed, Tensor? additive, Tensor value, Tensor? dropout_keep, float dropout_scale, "
    "Tensor stats, Tensor grad_output, Tensor? addend=None) -> (Tensor, Tensor)"
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
def tail_backward_operator(
    logits, allowed, additive, value, dropout_keep, dropout_scale, stats, grad_output, addend=None
):
    """The gradients of ``ea_hf::triton_attention_tail``'s logits (in their dtype, plus ``addend`` where given)
    and values."""
    return attention_tail.backward(
        logits, allowed, additive, value, dropout_keep, dropout_scale, stats, grad_output, logits.dtype, addend
    )


@tail_backward_operator.register_fake
def _(logits, allowed, additive, value, dropout_keep, dropout_scale, stats, grad_output, addend=None):
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


# --------------------------------------------------------------------------------------------------------------
# The bytes each operator's kernels read and write, from the shapes (bench/harness/bytes.py counts a step's bytes
# op by op on the meta device, where these operators run their fake implementations above).
# --------------------------------------------------------------------------------------------------------------


def _held(*tensors: torch.Tensor | None) -> int:
    """The bytes of the elements the tensors hold (a broadcast dimension, stride 0, counts once)."""
    total = 0
    for t in tensors:
        if t is not None and t.numel():
            total += t.element_size() * math.prod(n for n, s in zip(t.shape, t.stride(), strict=True) if s != 0)
    return total


def _map_bytes(like: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    """The bytes of one contiguous map of ``like``'s shape (in ``dtype``, default its own)."""
    return like.numel() * (like.element_size() if dtype is None else torch.empty((), dtype=dtype).element_size())


def evolve_bytes(scores, previous, keep, weight, bias, alpha, blend, context_rows) -> int:
    """``triton_evolve_with_gate_bits``: one pass reads S, A_prev, the mask and the kernel, and writes A_logit and
    the packed gate (zeroed first by ``packed_gate``: written twice)."""
    gate = packed_gate_bytes(scores)
    return _held(scores, previous, keep, weight, bias) + _map_bytes(scores) + 2 * gate


def packed_gate_bytes(scores: torch.Tensor) -> int:
    """The bytes of the packed ReLU gate of maps like ``scores``."""
    return math.prod(scores.shape[:-1]) * 2 * -(-scores.shape[-1] // 16)


def evolve_backward_bytes(scores, previous, keep, grad, gate, weight, alpha, blend, context_rows) -> int:
    """``triton_evolve_backward``: the input-gradient kernel reads the gradient and the gate and writes S's and
    A_prev's gradients; the weight-gradient kernel reads the gradient and the gate again, and S and A_prev (A_in
    mixed as it reads)."""
    maps = 1 if previous is None else 2
    return 2 * _held(grad, gate, keep) + _held(scores, previous) + maps * _map_bytes(scores) + _held(weight)


def convolve_bytes(x, weight, bias, row_shift) -> int:
    """``triton_convolve``: reads ``x`` and the kernel, writes a map like ``x``."""
    return _held(x, weight, bias) + _map_bytes(x)


def _first_tile(logits: torch.Tensor, kernel: str, side: str) -> int:
    """A side of the first configuration of ``kernel``'s list for maps like ``logits``: the tiles counted (autotune
    may choose others on a GPU, which re-read the values and the output's gradient more or less often)."""
    kind = "float32" if logits.dtype == torch.float32 else "half"
    return attention_tail.CONFIGS[kind][kernel][0][side]


def _row_blocks(logits: torch.Tensor) -> int:
    return -(-logits.shape[-2] // _first_tile(logits, "forward", "BLOCK_M"))


def _column_blocks(logits: torch.Tensor) -> int:
    return -(-logits.shape[-1] // _first_tile(logits, "backward", "BLOCK_N"))


def tail_bytes(logits, allowed, additive, value, dropout_keep, dropout_scale) -> int:
    """``triton_attention_tail``: each block of query rows reads its rows of the logits, the masks and dropout's
    mask, and all the values (V once per row block); it writes the output and two statistics a row."""
    batch, heads, rows, _ = logits.shape
    output = batch * heads * rows * value.shape[-1] * value.element_size()
    values = _held(value) * (heads // value.shape[1]) * _row_blocks(logits)
    return _held(logits, allowed, additive, dropout_keep) + values + output + 2 * batch * heads * rows * 4


def tail_backward_bytes(
    logits, allowed, additive, value, dropout_keep, dropout_scale, stats, grad_output, addend=None
) -> int:
    """``triton_attention_tail_backward``: the row-terms kernel reads the logits, masks, values (once per row block)
    and the output's gradient, and writes a float32 term a row; the backward kernel, one program per block of keys,
    reads the logits and masks again, the output's gradient once per key block and the addend (if any) once, and
    writes the logits' gradient and the values' (float32 per query head, summed per key/value head and cast)."""
    batch, heads, rows, cols = logits.shape
    groups = heads // value.shape[1]
    masks = _held(logits, allowed, additive, dropout_keep)
    per_row = batch * heads * rows * 4
    row_terms = masks + _held(value) * groups * _row_blocks(logits) + _held(grad_output, stats) + per_row
    grad_value_float = batch * heads * cols * value.shape[-1] * 4
    backward = masks + _held(grad_output) * _column_blocks(logits) + _held(value) * groups + _held(stats) + per_row
    backward += _held(addend) + _map_bytes(logits) + grad_value_float
    return row_terms + backward + grad_value_float + 2 * _held(value)


#: Bytes read plus written by each operator's kernels, by the operator's name, from its arguments' shapes.
DECLARED_BYTES = {
    "ea_hf::triton_evolve_with_gate_bits": evolve_bytes,
    "ea_hf::triton_evolve_backward": evolve_backward_bytes,
    "ea_hf::triton_convolve": convolve_bytes,
    "ea_hf::triton_attention_tail": tail_bytes,
    "ea_hf::triton_attention_tail_backward": tail_backward_bytes,
}

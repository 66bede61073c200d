"""The fused CPU kernel of the evolution step, as the fused-kernel protocol of the evolution
(``ea_hf.modeling.kernels.FusedKernel``): which calls it takes (:func:`applicable`), and how each runs.

The kernel is C++ compiled on first use (:mod:`ea_hf.ops.cpu.build`), called through ctypes
(:mod:`ea_hf.ops.cpu.binding`) and declared as torch operators (:mod:`ea_hf.ops.cpu.operators`), so that
``torch.compile`` and ``torch.export`` see it as one node of the graph instead of stopping at a ctypes call (ONNX
has no translation of them: while ``torch.onnx.export`` traces, :func:`applicable` is False). This module
dispatches: while torch.compile traces, and where autograd differentiates the result, the evolution calls
the operators; elsewhere (inference and decoding steps, the attention core's forward and backward) it calls their
bodies directly, whose Python dispatch would cost a decoding step as much as the kernel itself.

Without a compiler, or with ``EA_HF_KERNELS=0``, :func:`cpu_kernel` returns ``None``, :func:`applicable` is False
and the evolution uses torch operations (same results to float rounding).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...modeling.step import EvolutionStep, GradientIn, ScaledMap, StepMaps
from ..fused_step import evolve_by_correlation, schema_arguments, tracing_without_kernels
from ..limits import MAX_HEADS, MAX_KERNEL_COLUMNS, MAX_KERNEL_ROWS
from . import binding, operators
from .binding import (
    build_library,
    cpu_kernel,
    kernel_available,
    select_kept,
    using_library,
)

__all__ = [  # the kernel's protocol, and the library's controls that benchmarks and tests use
    "applicable",
    "backward",
    "build_library",
    "convolve",
    "cpu_kernel",
    "evolve",
    "kernel_available",
    "select_kept",
    "using_library",
]


def applicable(*tensors: Tensor | None, keep: Tensor | None = None, weight: Tensor) -> bool:
    """Whether the CPU kernel can take these maps and this kernel: float32 on CPU, a mask shared by the heads, and
    no ONNX export or jit trace running (:func:`~ea_hf.ops.fused_step.tracing_without_kernels`)."""
    if weight.shape[-2] > MAX_KERNEL_ROWS or weight.shape[-1] // 2 > MAX_KERNEL_COLUMNS // 2:
        return False
    maps = [t for t in tensors if t is not None]
    if any(t.device.type != "cpu" or t.dtype != torch.float32 or t.dim() != 4 for t in maps):
        return False
    if maps and not 1 <= maps[0].shape[1] <= MAX_HEADS:
        return False
    if keep is not None and keep.dim() == 4 and keep.shape[1] != 1:
        return False
    return kernel_available() and not tracing_without_kernels()


def evolve(
    step: EvolutionStep, maps: StepMaps, weight: Tensor, bias: Tensor, *, in_place: bool, gate: bool | None = None
) -> tuple[Tensor, Tensor | None]:
    """The evolution step's forward (see ``ea_hf.modeling.kernels.FusedKernel``): through the operators while
    torch.compile traces (never in place: a compiled graph plans its own buffers) and where autograd differentiates
    the result; elsewhere, in place, the operators' bodies directly, which skip masked tails with
    ``step.skip_masked_tails`` (see :func:`~ea_hf.ops.cpu.binding.forward_correlation`; the operators correlate
    the masked tails too)."""
    gate = not in_place if gate is None else gate
    # Outside torch.compile the operators' bodies run directly where the result is not differentiated: the dispatch of a
    # Python custom operator costs a decoding step as much as the correlation of a decoded row itself
    # (docs/performance.md, "Choices in the fused kernels").
    if in_place and not torch.compiler.is_compiling():
        if gate:  # the attention core's forward (never compiled): S is spent, A_logit and the gate are kept
            correlation = binding.forward_correlation(step.skip_masked_tails)
            return evolve_by_correlation(correlation, step, maps, weight, bias, in_place=True, gate=True)
        operators.evolve_in_place(step, maps, weight, bias)
        return maps.scores, None
    logits, saved = torch.ops.ea_hf.evolve_with_gate_bits(*maps, weight, bias, *schema_arguments(step))
    return logits, saved if gate else None


def convolve(x: Tensor, weight: Tensor, bias: Tensor, *, row_shift: int) -> Tensor:
    """A plain correlation plus bias (the kept rows of a decoding step): ``ea_hf::convolve``, whose body runs
    directly outside torch.compile (see :func:`evolve`)."""
    if not torch.compiler.is_compiling():
        return binding.correlate(x, weight, bias, row_shift=row_shift)
    return torch.ops.ea_hf.convolve(x, weight, bias, row_shift)


def backward(
    step: EvolutionStep, maps: StepMaps, grad: GradientIn, gate: Tensor, weight: Tensor, *, shared_map: bool = False
) -> tuple[Tensor | ScaledMap, Tensor | None, Tensor, Tensor]:
    """The evolution step's whole backward (see :func:`~ea_hf.ops.cpu.binding.backward_pass`; while torch.compile
    traces, the operator ``ea_hf::evolve_backward_one_map``, which correlates the masked tails too).

    The incoming gradient is ``grad.grad`` plus ``grad.addend`` (where given). Outside torch.compile (a compiled
    graph plans its own buffers), the kernel adds them as it reads, and writes S's gradient over a spent
    ``grad.grad`` where it fits instead of a new map; with ``shared_map`` it writes one map, A_prev's gradient,
    and returns S's as a :class:`~ea_hf.modeling.step.ScaledMap` of it."""
    if not torch.compiler.is_compiling():
        return binding.backward_pass(step, maps, grad, gate, weight, shared_map=shared_map)
    incoming = grad.grad if grad.addend is None else grad.grad + grad.addend
    return operators.one_map_backward(step, maps, incoming, gate, weight)

"""Optional fused kernels of the evolution step and of the attention tail, apart from the modeling core.

Each kernel module provides ``applicable``, ``evolve``, ``convolve``, ``backward`` and ``select_kept`` (the
``FusedKernel`` protocol of ``ea_hf.modeling``), each attention tail ``applicable``, ``forward``, ``backward`` and
``attend`` (``FusedAttentionTail``). Importing this package registers them with the core's registries
(``ea_hf.modeling.register_fused_kernel``, ``register_fused_attention_tail``), in the order they are tried; where
none applies, the core runs the same steps as torch operations.

- :mod:`ea_hf.ops.cpu`: a C++/OpenMP kernel compiled on first use (``EA_HF_KERNELS=0`` turns it off), called as
  the torch operators ``torch.ops.ea_hf.evolve_with_gate_bits`` (differentiable), ``evolve_``, ``convolve`` and
  ``evolve_backward_one_map``, so that ``torch.compile`` and ``torch.export`` keep it in their graphs (outside
  them, inference calls the operators' bodies directly). By concern: :mod:`~ea_hf.ops.cpu.build` builds and
  caches the library, :mod:`~ea_hf.ops.cpu.binding` calls it through ctypes, :mod:`~ea_hf.ops.cpu.operators`
  declares the torch operators, and :mod:`~ea_hf.ops.cpu.evolution` dispatches between them (the
  ``FusedKernel`` protocol).
- :mod:`ea_hf.ops.triton`: Triton kernels for GPUs (the ``gpu`` extra), by default for half-precision maps on
  the GPUs where a session's decision table chose them (Hopper), else with ``EA_HF_TRITON=1``
  (docs/performance.md):
  :mod:`~ea_hf.ops.triton.evolution` (the evolution step) and :mod:`~ea_hf.ops.triton.attention_tail` (the masked
  softmax and the product with the values after it, flash-style, without forming P), which run as the torch
  operators of :mod:`~ea_hf.ops.triton.operators` while torch.compile traces.
- :mod:`ea_hf.ops.fused_step`: the step's forward as one pass of a kernel's correlation, and the operators'
  schemas, shared by both, and when both step aside: while ``torch.onnx.export`` or ``torch.jit.trace`` traces
  (``tracing_without_kernels``), which then record the torch operations; :mod:`ea_hf.ops.limits`: the largest
  step both kernels take.
"""

from ..modeling import register_fused_attention_tail, register_fused_kernel
from . import cpu, triton

# The CPU kernel first: it takes CPU float32 maps, also under Triton's interpreter.
register_fused_kernel(cpu.evolution)
register_fused_kernel(triton.evolution)
register_fused_attention_tail(triton.attention_tail)

__all__ = ["cpu", "triton"]

"""Optional fused kernels of the evolution step, apart from the modeling core.

Each kernel module provides ``applicable``, ``evolve``, ``convolve``, ``backward`` and ``select_kept`` (see
``ea_hf.modeling.step.FusedKernel``) and is registered with the core by ``ea_hf``'s ``__init__``; where
none applies, the core runs the same steps as torch operations.

- :mod:`ea_hf.ops.cpu`: a C++/OpenMP kernel compiled on first use (``EA_HF_KERNELS=0`` turns it off), called as
  the torch operators ``torch.ops.ea_hf.evolve_with_gate_bits`` (differentiable), ``evolve_``, ``convolve`` and
  ``evolve_backward_one_map``, so that ``torch.compile`` and ``torch.export`` keep it in their graphs (outside
  them, inference calls the operators' bodies directly). By concern: :mod:`~ea_hf.ops.native_build` builds and
  caches the library, :mod:`~ea_hf.ops.cpu_binding` calls it through ctypes, :mod:`~ea_hf.ops.cpu_operators`
  declares the torch operators, and :mod:`~ea_hf.ops.cpu` dispatches between them.
- :mod:`ea_hf.ops.triton_kernels`: Triton kernels for GPUs (the ``gpu`` extra), opt-in with ``EA_HF_TRITON=1``:
  their tests pass on an H100 and in Triton's CPU interpreter, but whole EA models ran slower on them than on
  torch operations in the one GPU benchmark so far, so they are not the default.
  While torch.compile traces, they run as the torch operators of :mod:`ea_hf.ops.triton_operators`
  (``torch.ops.ea_hf.triton_evolve_with_gate_bits``, ``triton_evolve_backward``, ``triton_convolve``).
- :mod:`ea_hf.ops.triton_attention`: Triton kernels of the attention tail after the evolution (the masked softmax
  and the product with the values, flash-style, without forming P), with the evolution kernels' opt-in, where
  nobody reads the attention weights.
- :mod:`ea_hf.ops.fused_step`: the step's forward as one pass of a kernel's correlation, and the operators'
  schemas, shared by both.
"""

from . import cpu, triton_attention, triton_kernels, triton_operators  # noqa: F401  (registers the operators)

#: The kernel modules of this package, in the order they are tried (the CPU kernel takes CPU float32 maps
#: first, also under Triton's interpreter).
FUSED_KERNELS = (cpu, triton_kernels)
#: The fused attention tails (masked softmax and product with the values after the evolution), in order.
FUSED_ATTENTION_TAILS = (triton_attention,)

__all__ = ["FUSED_ATTENTION_TAILS", "FUSED_KERNELS", "cpu", "triton_attention", "triton_kernels"]

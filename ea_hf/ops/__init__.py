"""Optional fused kernels of the evolution step, apart from the modeling core.

Each kernel module provides ``applicable``, ``correlate`` and ``backward`` (see
``ea_hf.modeling.convolution.FusedKernel``) and is registered with the core by ``ea_hf``'s ``__init__``; where
none applies, the core runs the same steps as torch operations.

- :mod:`ea_hf.ops.cpu`: a C++/OpenMP kernel compiled on first use (``EA_HF_KERNELS=0`` turns it off).
"""

from . import cpu

#: The kernel modules of this package, in the order they are tried.
FUSED_KERNELS = (cpu,)

__all__ = ["FUSED_KERNELS", "cpu"]

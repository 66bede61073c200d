"""The fused CPU kernel of the evolution step: C++/OpenMP (``csrc/evolve_cpu.cpp``) compiled on first use
(``EA_HF_KERNELS=0`` turns it off).

- :mod:`.build`: builds the C++ source into a shared library with the system compiler, cached between processes.
- :mod:`.binding`: loads the library and calls its entry points through ctypes, one Python function each.
- :mod:`.operators`: the kernel as torch operators (``torch.ops.ea_hf.evolve_with_gate_bits``, ``evolve_``,
  ``convolve``, ``evolve_backward_one_map``), so that ``torch.compile`` and ``torch.export`` keep it in their
  graphs.
- :mod:`.evolution`: the ``FusedKernel`` protocol of ``ea_hf.modeling`` (which calls the kernel takes, and
  whether each runs through the operators or their bodies directly).
"""

from . import binding, build, evolution, operators  # noqa: F401  (operators registers the torch operators)

__all__ = ["binding", "build", "evolution", "operators"]

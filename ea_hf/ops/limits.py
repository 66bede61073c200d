"""The largest evolution step the fused kernels take, defined once for the CPU kernel and the Triton kernels.

They are the C++ kernel's bounds (``cpu/csrc/evolve_cpu.cpp``: ``kMaxHeads``, ``kMaxKernelRows``, and ``kLead``, half
the widest kernel): its per-row tables have room for that many heads and kernel rows. The Triton kernels take the
same maps, so that a model evolves on either kernel or on neither (they would take more heads and taps, at the cost
of larger padded products). A larger step runs as torch operations.
"""

#: The most heads a map may have.
MAX_HEADS = 64
#: The tallest kernel, in rows.
MAX_KERNEL_ROWS = 8
#: The widest kernel, in columns (odd: centred on the output column).
MAX_KERNEL_COLUMNS = 33

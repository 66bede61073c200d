"""What one layer's evolution step must move and compute: the roofline's bytes and FLOPs (``analyses/roofline.py``), and
the bandwidth a measured step achieved on them (``benchmarks/triton_kernels.py``)."""

from __future__ import annotations

import dataclasses

from .models import DTYPE_BYTES


@dataclasses.dataclass(frozen=True)
class Gpu:
    """Peak HBM bandwidth (bytes/s) and dense tensor-core throughput (FLOP/s) from the vendor's data sheets."""

    name: str
    bandwidth: float
    flops: dict[str, float]


@dataclasses.dataclass(frozen=True)
class Traffic:
    """The least bytes and the FLOPs of one layer's evolution step, forward and backward."""

    forward_bytes: int
    backward_bytes: int
    forward_flops: int
    backward_flops: int

    def seconds(self, gpu: Gpu, dtype: str, passes: str = "both") -> float:
        """The roofline time: the larger of the memory time and the compute time, per pass."""
        bytes_flops = {
            "forward": [(self.forward_bytes, self.forward_flops)],
            "both": [(self.forward_bytes, self.forward_flops), (self.backward_bytes, self.backward_flops)],
        }[passes]
        return sum(max(b / gpu.bandwidth, f / gpu.flops[dtype]) for b, f in bytes_flops)


def evolution_traffic(batch: int, heads: int, n: int, dtype: str, kernel: int = 3) -> Traffic:
    """What one layer's fused evolution step must move and compute (see the module docstring); the padding mask
    (one map of the model's dtype per sequence) is read once a pass. The incoming gradient already holds the next
    layer's (the fused attention tail's backward adds it as it writes A_logit's: ``roofline.tail_traffic``), and
    the input and weight gradients' kernels each read it.

    Example:
        >>> traffic = evolution_traffic(8, 12, 512, "bf16")
        >>> round(traffic.forward_bytes / 1e6), round(traffic.backward_bytes / 1e6)  # MB
        (158, 317)
    """
    elements = batch * heads * n * n
    size = DTYPE_BYTES[dtype]
    mask = batch * n * n * size
    gate = elements / 8  # bit-packed
    forward = 3 * size * elements + gate + mask  # S, A_prev in; A_logit, the gate out
    backward = 6 * size * elements + 2 * gate + 2 * mask  # G, S, A_prev, G again in; 2 grads out
    flops = 2 * kernel * kernel * heads * elements
    return Traffic(forward, backward, flops, 2 * flops)

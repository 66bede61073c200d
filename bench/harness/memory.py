"""Memory figures, each function one meaning.

The process's resident set (Linux, ``/proc/self/status`` and ``getrusage``), in MiB:

- :func:`current_rss_mib`: the RSS now (VmRSS);
- :func:`process_peak_rss_mib`: the largest RSS the process has had since it started (``ru_maxrss``), what a fresh
  process per case reports;
- :func:`peak_rss_since_reset_mib`: the largest RSS since the last :func:`reset_peak_rss` (VmHWM);
- :func:`step_memory_mib`: what one call adds at its peak above the memory before it (on CUDA, the allocator's).

The GPU's allocator (``torch.cuda``), in bytes, None on the CPU, whose allocator keeps no such counts:
:func:`reset_gpu_peak` starts a measurement and returns what is allocated then, :func:`gpu_peak_bytes` and
:func:`gpu_peak_added_bytes` read its peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import resource
from collections.abc import Callable
from typing import Any

from harness import is_cuda

MIB = 1024.0 * 1024.0


def _status_mib(field: str) -> float:
    """A memory field of this process's /proc/self/status (kB there), in MiB; NaN where it has none."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def current_rss_mib() -> float:
    """Resident set size of this process now (VmRSS), in MiB."""
    return _status_mib("VmRSS")


def process_peak_rss_mib() -> float:
    """The largest resident set this process has had since it started (``ru_maxrss``, KiB on Linux), in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS; False if not possible (Linux >= 4.0: writing 5
    to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


def peak_rss_since_reset_mib() -> float:
    """The largest RSS of this process since the last :func:`reset_peak_rss` (VmHWM), else since it started, in
    MiB. Linux raises VmHWM only when RSS is about to fall (it can lag the current VmRSS by what was mapped
    since), so the larger of the two is the peak."""
    peak = _status_mib("VmHWM")
    if peak != peak:  # NaN: no VmHWM line
        return process_peak_rss_mib()
    return max(peak, current_rss_mib())


def minor_faults() -> int:
    """Minor page faults of this process so far: first touches of memory the allocator got fresh from the
    kernel. How many a step takes depends on the heap's state (glibc returns freed memory at the top of its heap
    to the kernel), so they are reported beside the times."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def trim_heap() -> None:
    """Return glibc's free heap to the kernel (``malloc_trim``), so that memory freed earlier cannot hide what the
    next call takes."""
    ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)


def reset_gpu_peak(device: Any) -> int | None:
    """Start measuring the peak of the GPU allocator: synchronise, reset its peak and return the bytes allocated
    now; None on the CPU."""
    if not is_cuda(device):
        return None
    import torch

    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def gpu_allocated_bytes(device: Any) -> int | None:
    """The bytes the GPU allocator holds now, once the queued work is done; None on the CPU."""
    if not is_cuda(device):
        return None
    import torch

    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def gpu_peak_bytes(device: Any) -> int | None:
    """The GPU allocator's peak since :func:`reset_gpu_peak` (or since the process started), in bytes; None on
    the CPU."""
    if not is_cuda(device):
        return None
    import torch

    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)


def gpu_peak_added_bytes(device: Any, allocated_before: int | None) -> int | None:
    """Bytes the GPU allocator's peak rose above ``allocated_before`` (:func:`reset_gpu_peak`'s figure): what the
    work since then added at its peak, the model and whatever else was alive before not counted."""
    peak = gpu_peak_bytes(device)
    return None if peak is None or allocated_before is None else peak - allocated_before


def gpu_reserved_peak_bytes(device: Any) -> int | None:
    """The peak of what the GPU allocator reserved from the driver (its cache included); None on the CPU."""
    if not is_cuda(device):
        return None
    import torch

    return torch.cuda.max_memory_reserved(device)


def release_gpu_memory(device: Any) -> None:
    """Free what earlier work left on the GPU, so that the next baseline does not include it. Nothing on the CPU,
    where a full collection per case costs time and no GPU memory is measured."""
    if not is_cuda(device):
        return
    import torch

    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def step_memory_mib(step: Callable[[], Any], device: Any) -> float:
    """What one call of ``step`` adds to memory at its peak, in MiB, measured in a process that has run steps
    before. On CPU: the peak RSS during the call (VmHWM, reset first) above the RSS before it, after the free heap
    went back to the kernel (:func:`trim_heap`), so that memory freed by earlier steps does not hide what this one
    takes. On CUDA: the allocator's peak above what it held before."""
    gc.collect()
    if is_cuda(device):
        before = reset_gpu_peak(device)
        step()
        return gpu_peak_added_bytes(device, before) / MIB
    trim_heap()
    if not reset_peak_rss():
        raise RuntimeError("step memory needs a resettable peak RSS (Linux /proc/self/clear_refs)")
    before = current_rss_mib()
    step()
    return _status_mib("VmHWM") - before

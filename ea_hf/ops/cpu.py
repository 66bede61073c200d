"""The fused CPU kernel of the evolution's convolution step, compiled on first use.

``csrc/evolve_cpu.cpp`` is a plain C++ shared library (no torch headers, about a second to compile) that
computes one correlation over [B, H, Q, K] maps with its input mask, ReLU, output mask and blend in a single
pass: the forward step ``ReLU(Conv(A_in * keep)) + (1 - beta) * A_in`` and the input gradient of backward.
On CPU it is faster than torch's convolution for H-channel maps, which reorders NCHW maps to a blocked
layout and back around every call, and it allocates nothing but its output.

The kernel runs as torch operators (``torch.ops.ea_hf.*``, declared with ``torch.library.custom_op``, with fake
implementations and a registered autograd formula), so ``torch.compile`` and ``torch.export`` see it as one
node of the graph instead of stopping at a ctypes call. Outside compilation, inference and decoding steps call
the operators' bodies directly (see :func:`evolve`): their Python dispatch costs a decoding step as much as the
kernel itself.

It is built with the system C++ compiler (``$CXX``, else ``c++``/``g++``/``clang++``) for the machine it
runs on (``-march=native``) into ``$EA_HF_CACHE`` (default ``~/.cache/ea_hf``), keyed by source, compiler
and CPU, and loaded with ctypes. Without a compiler, or with ``EA_HF_KERNELS=0``, :func:`cpu_kernel`
returns ``None`` and the evolution uses torch operations (same results to float rounding).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from ..modeling.convolution import ScaledMap, pack_gate, packed_gate, packed_gate_shape
from .fused_step import evolve_by_correlation

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "evolve_cpu.cpp"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
#: Largest head count and kernel height the kernel takes.
MAX_HEADS = 64
MAX_KERNEL_ROWS = 8
MAX_KERNEL_COLUMNS = 33

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}
_NOT_LOADED = object()


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_signature() -> str:
    """The CPU model and its feature flags: a binary built with -march=native only runs where they match."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            lines = [line for line in cpuinfo if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


def _cache_dir() -> Path:
    return Path(os.environ.get("EA_HF_CACHE", Path.home() / ".cache" / "ea_hf")) / "kernels"


def _build(compiler: str, flags: tuple[str, ...] = FLAGS) -> Path:
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + compiler.encode() + " ".join(flags).encode() + _cpu_signature().encode())
    target = _cache_dir() / f"evolve_cpu-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename into place, so concurrent processes (DDP ranks) never load a
    # half-written library.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        subprocess.run(
            [compiler, *flags, "-o", str(built), str(SOURCE)], check=True, capture_output=True, text=True, timeout=300
        )
        os.replace(built, target)
    return target


def _declare(library: ctypes.CDLL) -> ctypes.CDLL:
    pointer, integer, single = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    library.ea_correlate.restype = integer
    library.ea_correlate.argtypes = [pointer, pointer, single, *[pointer] * 4, *[integer] * 8]
    library.ea_correlate.argtypes += [*[pointer] * 3, single, pointer, single, pointer, single, integer, integer]
    library.ea_backward.restype = integer
    library.ea_backward.argtypes = [pointer, pointer, single, *[pointer] * 5, *[integer] * 8, single]
    library.ea_backward.argtypes += [pointer, single, pointer, single, pointer, pointer, integer, integer]
    library.ea_select_kept.restype = integer
    library.ea_select_kept.argtypes = [pointer, pointer, *[ctypes.c_long] * 3, single, single, pointer, *[integer] * 5]
    return library


def _load(compiler: str, flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL:
    """The kernel built with ``flags`` (cached), loaded and its entry points declared."""
    return _declare(ctypes.CDLL(str(_build(compiler, flags))))


def cpu_kernel() -> ctypes.CDLL | None:
    """The loaded kernel library, building it the first time; ``None`` where it cannot be built or is off.

    Example:
        >>> kernel = cpu_kernel()  # None without a C++ compiler or with EA_HF_KERNELS=0
    """
    if os.environ.get("EA_HF_KERNELS", "1").lower() in ("0", "false", "no", "off"):
        return None
    with _lock:
        if "cpu" not in _loaded:
            library = None
            compiler = _compiler()
            if compiler is None:
                logger.info("ea_hf: no C++ compiler found; evolving attention uses torch operations on CPU")
            else:
                try:
                    library = _load(compiler)
                except (OSError, subprocess.SubprocessError) as error:
                    detail = getattr(error, "stderr", "") or error
                    logger.warning("ea_hf: building the CPU kernel failed, using torch operations: %s", detail)
            _loaded["cpu"] = library
        return _loaded["cpu"]


def build_library(*extra_flags: str) -> ctypes.CDLL:
    """The kernel library built with ``extra_flags`` after the usual ones (cached as the default build is), for
    tests and benchmarks that compare builds: ``-DEA_HF_DIRECT_CONVOLUTION`` (the direct form of every
    correlation), ``-DEA_HF_CORRELATE_EVERY_ROW`` (no bias-only rows), ``-DEA_HF_PREFETCH_LOCALITY=3`` (cache lines
    requested into L1), ``-mno-avx512f``. Calls use it inside :func:`using_library`. Raises ``RuntimeError``
    without a C++ compiler and ``subprocess.CalledProcessError`` where the build fails.

    Example:
        >>> library = build_library("-DEA_HF_PREFETCH_LOCALITY=3") if kernel_available() else None
        >>> with using_library(library):
        ...     kernel_available() == (library is not None)
        True
    """
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler: the fused CPU kernel cannot be built on this machine")
    return _load(compiler, (*FLAGS, *extra_flags))


@contextlib.contextmanager
def using_library(library: ctypes.CDLL | None) -> Iterator[None]:
    """Runs the kernel's calls inside the block on ``library`` (a :func:`build_library` build; ``None``: torch
    operations), then restores the default. Process-wide, for tests and benchmarks: not for code that other
    threads run kernels beside.

    Example:
        >>> with using_library(None):
        ...     kernel_available()
        False
    """
    with _lock:
        previous = _loaded.get("cpu", _NOT_LOADED)
        _loaded["cpu"] = library
    try:
        yield
    finally:
        with _lock:
            if previous is _NOT_LOADED:
                _loaded.pop("cpu", None)
            else:
                _loaded["cpu"] = previous


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _checked_gate(gate: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """``gate`` if it is a contiguous :func:`~ea_hf.modeling.convolution.packed_gate` for maps like ``like``."""
    if gate is not None:
        shape = packed_gate_shape(like.shape)
        if gate.dtype != torch.uint8 or gate.shape != shape or not gate.is_contiguous():
            raise ValueError(
                f"the CPU kernel's ReLU gate is bit-packed (packed_gate): a contiguous torch.uint8 map of shape "
                f"{tuple(shape)}, not {gate.dtype} {tuple(gate.shape)}"
            )
    return gate


def kernel_keep(keep: torch.Tensor | None, batch: int, rows: int, cols: int) -> torch.Tensor | None:
    """``keep`` as the kernel reads it, a contiguous float32 [B, 1, Q, K] mask, or None."""
    if keep is None:
        return None
    return keep.to(torch.float32).expand(batch, 1, rows, cols).contiguous()


@torch.compiler.assume_constant_result
def kernel_available() -> bool:
    """Whether the kernel is built and loaded (building it the first time). torch.compile calls this once while
    tracing and keeps the answer, instead of tracing the build (a lock, a subprocess, ctypes)."""
    return cpu_kernel() is not None


def applicable(*tensors: torch.Tensor | None, keep: torch.Tensor | None = None, weight: torch.Tensor) -> bool:
    """Whether the CPU kernel can take these maps and this kernel: float32 on CPU, a mask shared by the heads."""
    if weight.shape[-2] > MAX_KERNEL_ROWS or weight.shape[-1] // 2 > MAX_KERNEL_COLUMNS // 2:
        return False
    maps = [t for t in tensors if t is not None]
    if any(t.device.type != "cpu" or t.dtype != torch.float32 or t.dim() != 4 for t in maps):
        return False
    if maps and not 1 <= maps[0].shape[1] <= MAX_HEADS:
        return False
    if keep is not None and keep.dim() == 4 and keep.shape[1] != 1:
        return False
    return kernel_available()


#: Maps smaller than this take torch's operators instead of :func:`select_kept`'s kernel pass: a decoding step's
#: one-row maps, where the checks and the ctypes call cost more than the pass saves (AMD EPYC, a masked softmax
#: into P's map: [1, 12, 1, 513] 21 us with torch.where, 27 us through the kernel; [2, 12, 1, 1024] 39 against 35).
SELECT_KEPT_MIN_ENTRIES = 16384


def select_kept(
    x: torch.Tensor,
    keep: torch.Tensor,
    scale: float = 1.0,
    fill: float = 0.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """``keep ? scale * x : fill`` in one pass of the kernel (``ea_select_kept``), into ``out`` where given (it may
    be ``x``), or ``None`` where the kernel does not take these tensors: ``x`` (and ``out``) a contiguous float32
    [B, H, Q, K] map on CPU of at least :data:`SELECT_KEPT_MIN_ENTRIES` entries, ``keep`` a bool mask that
    broadcasts to it and is contiguous along the keys. Called directly, outside autograd and compilation (see
    ``ea_hf.modeling.convolution.select_kept``).

    Example:
        >>> x, keep = torch.randn(1, 2, 64, 128), torch.rand(1, 1, 64, 128) > 0.5
        >>> result = select_kept(x, keep, 2.0)
        >>> result is None or torch.equal(result, torch.where(keep, 2.0 * x, 0.0))
        True
    """
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 4 or not x.is_contiguous():
        return None
    if x.numel() < SELECT_KEPT_MIN_ENTRIES:
        return None
    if keep.dtype != torch.bool or keep.device.type != "cpu" or keep.dim() > 4:
        return None
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous()):
        return None
    try:
        keep = keep.expand(x.shape)
    except RuntimeError:  # does not broadcast
        return None
    library = cpu_kernel()
    if (x.shape[-1] > 1 and keep.stride(-1) != 1) or library is None:
        return None
    out = torch.empty_like(x) if out is None else out
    batch, heads, rows, cols = x.shape
    library.ea_select_kept(
        x.data_ptr(),
        keep.data_ptr(),
        *keep.stride()[:3],
        float(scale),
        float(fill),
        out.data_ptr(),
        batch,
        heads,
        rows,
        cols,
        torch.get_num_threads(),
    )
    return out


def correlate(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    row_shift: int,
    lerp_end: torch.Tensor | None = None,
    lerp_weight: float = 0.0,
    in_keep: torch.Tensor | None = None,
    relu: bool = False,
    saved: torch.Tensor | None = None,
    out_keep: torch.Tensor | None = None,
    blend: torch.Tensor | None = None,
    blend_coef: float = 0.0,
    in_place: bool = False,
    skip_masked_tails: bool = False,
) -> torch.Tensor:
    """One fused pass of the kernel (see ``csrc/evolve_cpu.cpp``), called directly (the operators below wrap
    it); callers check :func:`applicable` first.

    Output row i reads rows ``i + row_shift .. i + row_shift + kh - 1`` of ``x`` (zeros outside) and columns
    ``j - kw // 2 .. j + kw // 2``. With ``lerp_end``, ``x`` and ``blend`` are first mixed with it:
    ``x + lerp_weight * (lerp_end - x)``. Masks are [B, 1, Q, K] floats; ``saved`` (a
    :func:`~ea_hf.modeling.convolution.packed_gate` for ``x``) receives where the (ReLU) output is positive, one
    bit a value: the gate of backward.
    ``in_place`` writes the result over ``x`` (one map less to allocate; ``x`` may also be ``blend``).
    ``skip_masked_tails`` (with ``in_keep``): each row's correlation stops after its last kept column, rounded up
    to 64 columns; from there on the gate is 0 and the output 0, or in place ``x`` left as it is (no pass over
    a causal map's future half). A row without a kept column is correlated whole. For callers whose softmax
    masks, in every layer, the entries right of a row's last kept column: a causal map's future, a batch's
    padded keys (see :func:`forward_correlation`).
    With or without it, a row whose every input row ``in_keep`` masks whole (a padding query's, or outside the
    map) takes its bias for the correlation without computing the products, which would add zeros: the same
    bits, with finite weights.
    """
    library = cpu_kernel()
    batch, heads, rows, cols = x.shape
    x = x.contiguous()
    weight = weight.detach().to(torch.float32).contiguous()
    bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
    blend = None if blend is None else blend.contiguous()
    lerp_end = None if lerp_end is None else lerp_end.contiguous()
    in_keep = kernel_keep(in_keep, batch, rows, cols)
    out_keep = kernel_keep(out_keep, batch, rows, cols)
    out = x if in_place else torch.empty_like(x)
    status = library.ea_correlate(
        x.data_ptr(),
        _pointer(lerp_end),
        float(lerp_weight),
        None,
        _pointer(in_keep),
        weight.data_ptr(),
        _pointer(bias),
        batch,
        heads,
        rows,
        cols,
        weight.shape[-2],
        weight.shape[-1],
        row_shift,
        int(relu),
        _pointer(_checked_gate(saved, x)),
        _pointer(out_keep),
        _pointer(blend),
        float(blend_coef),
        out.data_ptr(),
        1.0,
        None,
        0.0,
        torch.get_num_threads(),
        int(skip_masked_tails and in_keep is not None),
    )
    if status != 0:
        raise RuntimeError(f"ea_hf CPU kernel rejected a map with {heads} heads")
    return out


def forward_correlation(skip_masked_tails: bool):
    """The correlation of the evolution's forward: :func:`correlate`, skipping masked tails where the caller says
    every layer of its chain masks them in its softmax (see :attr:`AttentionMapEvolution.skip_masked_tails
    <ea_hf.modeling.evolution.AttentionMapEvolution.skip_masked_tails>`): each layer's logits then differ from
    the reference formulation's only in entries every layer's softmax masks, and no output or gradient depends
    on them. On AMD EPYC, the correlation of a causal [1, 12, 2048, 2048] map then takes about a third less time,
    and a ~125M Llama's prefill of 2048 tokens 7 to 15 % less."""
    return functools.partial(correlate, skip_masked_tails=True) if skip_masked_tails else correlate


def backward(
    scores: torch.Tensor,
    previous: torch.Tensor | None,
    alpha: float,
    keep: torch.Tensor | None,
    grad: torch.Tensor,
    gate: torch.Tensor,
    scaled_weight: torch.Tensor,
    context_rows: int,
    beta: float,
    into: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    addend: torch.Tensor | None = None,
    *,
    shared_map: bool = False,
    skip_masked_tails: bool = False,
) -> tuple[torch.Tensor | ScaledMap, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The evolution step's whole backward (see :func:`_backward`; while torch.compile traces, the operator
    ``ea_hf::evolve_backward_one_map``, which correlates the masked tails too).

    The incoming gradient is ``grad`` plus ``addend`` (where given). Outside torch.compile (a compiled graph plans
    its own buffers), the kernel adds them as it reads, and with ``into`` writes the gradients of S and of A_prev
    to those spent maps where they fit instead of two new ones; with ``shared_map`` it writes one map, A_prev's
    gradient, and returns S's as a :class:`~ea_hf.modeling.convolution.ScaledMap` of it."""
    if not torch.compiler.is_compiling():
        return _backward(
            scores,
            previous,
            alpha,
            keep,
            grad,
            gate,
            scaled_weight,
            context_rows,
            1.0 - beta,
            into,
            addend,
            shared_map=shared_map,
            skip_masked_tails=skip_masked_tails,
        )
    if addend is not None:
        grad = grad + addend
    return _one_map_backward(scores, previous, keep, grad, gate, scaled_weight, alpha, 1.0 - beta, context_rows)


def _output_map(buffer: torch.Tensor | None, like: torch.Tensor, read: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
    """``buffer`` if the kernel can write a map like ``like`` there and it shares no memory with the maps in
    ``read`` (which the kernel reads while it writes), else a new map."""
    if buffer is None or buffer.shape != like.shape or buffer.dtype != torch.float32 or not buffer.is_contiguous():
        return torch.empty_like(like)
    start, stop = buffer.data_ptr(), buffer.data_ptr() + buffer.nbytes
    for tensor in read:
        if tensor is not None and tensor.data_ptr() < stop and start < tensor.data_ptr() + tensor.nbytes:
            return torch.empty_like(like)
    return buffer


def _backward(
    scores: torch.Tensor,
    previous: torch.Tensor | None,
    alpha: float,
    keep: torch.Tensor | None,
    grad: torch.Tensor,
    gate: torch.Tensor,
    scaled_weight: torch.Tensor,
    context_rows: int,
    blend: float,
    into: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    addend: torch.Tensor | None = None,
    *,
    shared_map: bool = False,
    scores_map: bool = False,
    skip_masked_tails: bool = False,
) -> tuple[torch.Tensor | ScaledMap, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The evolution step's whole backward in one pass over the rows (see ``ea_backward``).

    Returns the gradients of S, of A_prev (``None`` without ``previous``), and of the beta-scaled kernel's
    weight and bias, for A_logit = ReLU(Conv(A_in * keep)) + (1 - beta) * A_in, A_in = lerp(S, A_prev, alpha),
    the ReLU gate ``gate`` (bit-packed as :func:`correlate` writes it; a bool map is packed first), the output
    gradient ``grad`` and blend = 1 - beta; callers check :func:`applicable`.
    ``into`` names maps the caller no longer needs that the gradients of S and of A_prev may be written to
    (``grad`` itself may hold the first: each row is read before it is overwritten). ``addend``, a second
    incoming gradient, is added to ``grad`` as its rows are read (one pass over the maps less than adding first).

    ``shared_map``: the gradient of A_in, G_in, is written once. With ``previous`` and alpha != 0 that map is
    A_prev's gradient, alpha * G_in, and S's is returned as ``ScaledMap(it, (1 - alpha) / alpha)``; with alpha
    = 0 it is S's, ``ScaledMap(G_in, 1.0)``, and A_prev's is ``None`` (none flows). Writing a second map costs
    about a tenth of the pass (AMD EPYC, N = 512) and a map of memory.
    ``scores_map``: G_in is written once too, as S's gradient (see :func:`split_map_gradient`), and A_prev's is
    returned as ``None``.
    ``skip_masked_tails`` (with ``keep``): each row stops at its masked tail, as :func:`forward_correlation`'s
    does forward; the gradients there are 0, as they are where every layer's softmax masks those entries (the
    incoming gradient is 0 there).
    """
    library = cpu_kernel()
    batch, heads, rows, cols = scores.shape
    kernel_rows, kernel_cols = scaled_weight.shape[-2:]
    transposed = scaled_weight.detach().to(torch.float32).flip(-2, -1).transpose(0, 1).contiguous()
    scores, grad, gate = scores.contiguous(), grad.contiguous(), _checked_gate(pack_gate(gate).contiguous(), scores)
    previous = None if previous is None else previous.contiguous()
    addend = None if addend is None else addend.contiguous()
    keep = kernel_keep(keep, batch, rows, cols)
    grad_scores = _output_map(into[0], scores, (scores, previous, addend))
    grad_previous = None
    if previous is not None and not (shared_map or scores_map):
        grad_previous = _output_map(into[1], scores, (scores, previous, grad, addend, grad_scores))
    # The first map's scale: 1 - alpha (S's gradient), or alpha where it is shared as A_prev's; as the one map of
    # ``scores_map``, G_in itself where alpha = 1 (A_prev's alone: see split_map_gradient).
    shares = shared_map and previous is not None and alpha != 0.0
    if scores_map:
        out_scale = 1.0 if previous is None or alpha == 1.0 else 1.0 - alpha
    else:
        out_scale = 1.0 if previous is None else (alpha if shares else 1.0 - alpha)
    grad_weight = torch.empty(heads, heads, kernel_rows, kernel_cols)
    grad_bias = torch.empty(heads)
    status = library.ea_backward(
        scores.data_ptr(),
        _pointer(previous),
        float(alpha),
        _pointer(keep),
        grad.data_ptr(),
        _pointer(addend),
        gate.data_ptr(),
        transposed.data_ptr(),
        batch,
        heads,
        rows,
        cols,
        kernel_rows,
        kernel_cols,
        -context_rows,
        -(kernel_rows - 1 - context_rows),
        blend,
        grad_scores.data_ptr(),
        out_scale,
        _pointer(grad_previous),
        float(alpha),
        grad_weight.data_ptr(),
        grad_bias.data_ptr(),
        torch.get_num_threads(),
        int(skip_masked_tails and keep is not None),
    )
    if status != 0:
        raise RuntimeError(f"ea_hf CPU kernel rejected a map with {heads} heads")
    if shares:
        return ScaledMap(grad_scores, (1.0 - alpha) / alpha), grad_scores, grad_weight, grad_bias
    if shared_map:
        return ScaledMap(grad_scores, 1.0), None, grad_weight, grad_bias
    return grad_scores, grad_previous, grad_weight, grad_bias


def split_map_gradient(
    grad_map: torch.Tensor, previous: torch.Tensor | None, alpha: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gradients of S and of A_prev from the one map ``ea_hf::evolve_backward_one_map`` writes: S's
    gradient, (1 - alpha) * G_in, is the map (G_in without A_prev), and A_prev's, alpha * G_in, that map times
    alpha / (1 - alpha); where alpha = 1 the map is G_in, A_prev's, and S's is zero.

    Why S's and not A_prev's: in a compiled graph S's gradient goes into the products for the gradients of Q
    and K, which read a map as it is, while A_prev's is added to the previous layer's softmax gradient, a
    pointwise kernel into which inductor fuses the multiplication (no map is written for it).

    Example:
        >>> grad_in = torch.ones(1, 1, 2, 2)
        >>> grad_scores, grad_previous = split_map_gradient((1 - 0.2) * grad_in, torch.zeros(1, 1, 2, 2), 0.2)
        >>> torch.allclose(grad_scores, 0.8 * grad_in), torch.allclose(grad_previous, 0.2 * grad_in)
        (True, True)
    """
    if previous is None:
        return grad_map, None
    if alpha == 1.0:
        return torch.zeros_like(grad_map), grad_map
    return grad_map, grad_map * (alpha / (1.0 - alpha))


def _one_map_backward(scores, previous, keep, grad, gate, weight, alpha, blend, context_rows):
    """The gradients of S, A_prev (``None`` without it), the weight and the bias through the operator
    ``ea_hf::evolve_backward_one_map`` and :func:`split_map_gradient`: what compiled graphs call."""
    grad_map, grad_weight, grad_bias = torch.ops.ea_hf.evolve_backward_one_map(
        scores, previous, keep, grad, gate, weight, alpha, blend, context_rows
    )
    return (*split_map_gradient(grad_map, previous, alpha), grad_weight, grad_bias)


# --------------------------------------------------------------------------------------------------------------
# The kernel as torch operators: what the evolution calls (see ``ea_hf.modeling.convolution.FusedKernel``).
# --------------------------------------------------------------------------------------------------------------

#: The operators' schemas. Maps are float32 [B, H, Q, K] on CPU; ``keep`` is a float mask broadcastable to
#: [B, 1, Q, K]; ``weight`` and ``bias`` are the beta-scaled kernel; ``blend`` is 1 - beta.
EVOLVE_SCHEMA = (
    "(Tensor scores, Tensor? previous, Tensor? keep, Tensor weight, Tensor bias, float alpha, float blend, "
    "int context_rows) -> (Tensor, Tensor)"
)
EVOLVE_IN_PLACE_SCHEMA = (
    "(Tensor(a!) scores, Tensor? previous, Tensor? keep, Tensor weight, Tensor bias, float alpha, float blend, "
    "int context_rows) -> ()"
)
CONVOLVE_SCHEMA = "(Tensor x, Tensor weight, Tensor bias, int row_shift) -> Tensor"
EVOLVE_BACKWARD_SCHEMA = (
    "(Tensor scores, Tensor? previous, Tensor? keep, Tensor grad, Tensor gate, Tensor weight, float alpha, "
    "float blend, int context_rows) -> (Tensor, Tensor, Tensor)"
)


# Named for its gate: torch.compile's caches key a graph by the operators' names, not their fake implementations,
# so a graph cached with an earlier version of this operator (which returned a bool gate, ``ea_hf::evolve``)
# must not match it. Such a graph failed at run time, in inductor's output size check.
@torch.library.custom_op("ea_hf::evolve_with_gate_bits", mutates_args=(), device_types="cpu", schema=EVOLVE_SCHEMA)
def evolve_operator(scores, previous, keep, weight, bias, alpha, blend, context_rows):
    """(ReLU(Conv(A_in * keep)) + blend * A_in, its bit-packed ReLU gate), A_in = lerp(S, A_prev, alpha): the
    evolution step's forward pass, differentiable (its backward is ``ea_hf::evolve_backward_one_map``)."""
    return evolve_by_correlation(
        correlate,
        scores,
        previous,
        keep,
        weight,
        bias,
        alpha,
        blend,
        context_rows,
        in_place=False,
        new_gate=packed_gate,
    )


@evolve_operator.register_fake
def _(scores, previous, keep, weight, bias, alpha, blend, context_rows):
    return scores.new_empty(scores.shape), packed_gate(scores)


def _save_for_evolve_backward(ctx, inputs, output):
    scores, previous, keep, weight, _, alpha, blend, context_rows = inputs
    ctx.save_for_backward(scores, previous, keep, output[1], weight)
    ctx.constants = (alpha, blend, context_rows)


def _evolve_backward(ctx, grad_logits, _grad_gate):
    scores, previous, keep, gate, weight = ctx.saved_tensors
    alpha, blend, context_rows = ctx.constants
    grad_scores, grad_previous, grad_weight, grad_bias = _one_map_backward(
        scores, previous, keep, grad_logits, gate, weight, alpha, blend, context_rows
    )
    return grad_scores, grad_previous, None, grad_weight, grad_bias, None, None, None


evolve_operator.register_autograd(_evolve_backward, setup_context=_save_for_evolve_backward)


def evolve_in_place(
    scores, previous, keep, weight, bias, alpha, blend, context_rows, skip_masked_tails: bool = False
) -> None:
    """``ea_hf::evolve_with_gate_bits`` written over ``scores``, without the gate (inference: one map less): the
    body of ``ea_hf::evolve_``, which :func:`evolve` also calls directly outside torch.compile (there also
    ``skip_masked_tails``, see :func:`forward_correlation`)."""
    correlation = forward_correlation(skip_masked_tails)
    if scores.is_contiguous():
        evolve_by_correlation(
            correlation, scores, previous, keep, weight, bias, alpha, blend, context_rows, in_place=True
        )
    else:
        step = (scores, previous, keep, weight, bias, alpha, blend, context_rows)
        scores.copy_(evolve_by_correlation(correlation, *step, in_place=False, gate=False)[0])


@torch.library.custom_op("ea_hf::evolve_", mutates_args=("scores",), device_types="cpu", schema=EVOLVE_IN_PLACE_SCHEMA)
def evolve_in_place_operator(scores, previous, keep, weight, bias, alpha, blend, context_rows):
    """``ea_hf::evolve_with_gate_bits`` written over ``scores``, without the gate (see :func:`evolve_in_place`)."""
    evolve_in_place(scores, previous, keep, weight, bias, alpha, blend, context_rows)


@evolve_in_place_operator.register_fake
def _(scores, previous, keep, weight, bias, alpha, blend, context_rows):
    return None


@torch.library.custom_op("ea_hf::convolve", mutates_args=(), device_types="cpu", schema=CONVOLVE_SCHEMA)
def convolve_operator(x, weight, bias, row_shift):
    """A plain correlation plus bias whose output row i reads rows ``i + row_shift ..`` of ``x``."""
    return correlate(x, weight, bias, row_shift=row_shift)


@convolve_operator.register_fake
def _(x, weight, bias, row_shift):
    return x.new_empty(x.shape)


# One map out instead of the gradients of S and A_prev apart: glibc returns two fresh maps to the system after
# every call, and the next call faults all their pages in again, which at BERT-Base dimensions (N = 512, batch 2,
# AMD EPYC) takes the operator alone nearly twice as long. Named anew for torch.compile's caches (see above): the
# operator that wrote both gradients was ``ea_hf::evolve_backward``.
@torch.library.custom_op(
    "ea_hf::evolve_backward_one_map", mutates_args=(), device_types="cpu", schema=EVOLVE_BACKWARD_SCHEMA
)
def evolve_backward_operator(scores, previous, keep, grad, gate, weight, alpha, blend, context_rows):
    """The gradient map of ``ea_hf::evolve_with_gate_bits`` (see :func:`split_map_gradient`) and the gradients
    of its weight and bias."""
    grad_map, _, grad_weight, grad_bias = _backward(
        scores, previous, alpha, keep, grad, gate, weight, context_rows, blend, scores_map=True
    )
    return grad_map, grad_weight, grad_bias


@evolve_backward_operator.register_fake
def _(scores, previous, keep, grad, gate, weight, alpha, blend, context_rows):
    heads = scores.shape[1]
    return scores.new_empty(scores.shape), scores.new_empty(heads, heads, *weight.shape[-2:]), scores.new_empty(heads)


def evolve(
    scores: torch.Tensor,
    previous: torch.Tensor | None,
    keep: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    alpha: float,
    blend: float,
    context_rows: int,
    *,
    in_place: bool,
    gate: bool | None = None,
    skip_masked_tails: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The evolution step's forward (see ``ea_hf.modeling.convolution.FusedKernel``): through the operators while
    torch.compile traces (never in place: a compiled graph plans its own buffers) and where autograd differentiates
    the result; elsewhere, in place, the operators' bodies directly, which skip masked tails with
    ``skip_masked_tails`` (see :func:`forward_correlation`; the operators correlate the masked tails too)."""
    gate = not in_place if gate is None else gate
    # Outside torch.compile the operators' bodies run directly where the result is not differentiated: the
    # dispatch of a Python custom operator costs about 15 us a call warm and 80 to 110 us inside a decoding
    # step (measured on AMD EPYC, a ~125M Llama at N = 512), as much as the correlation of a decoded row itself.
    if in_place and not torch.compiler.is_compiling():
        if gate:  # the attention core's forward (never compiled): S is spent, A_logit and the gate are kept
            return evolve_by_correlation(
                forward_correlation(skip_masked_tails), scores, previous, keep, weight, bias, alpha, blend,
                context_rows, in_place=True, gate=True, new_gate=packed_gate,
            )  # fmt: skip
        evolve_in_place(scores, previous, keep, weight, bias, alpha, blend, context_rows, skip_masked_tails)
        return scores, None
    logits, saved = torch.ops.ea_hf.evolve_with_gate_bits(
        scores, previous, keep, weight, bias, alpha, blend, context_rows
    )
    return logits, saved if gate else None


def convolve(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, row_shift: int) -> torch.Tensor:
    """A plain correlation plus bias (the kept rows of a decoding step): ``ea_hf::convolve``, whose body runs
    directly outside torch.compile (see :func:`evolve`)."""
    if not torch.compiler.is_compiling():
        return correlate(x, weight, bias, row_shift=row_shift)
    return torch.ops.ea_hf.convolve(x, weight, bias, row_shift)

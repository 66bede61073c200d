"""The CPU kernel's library through ctypes: loading it (built by :mod:`ea_hf.ops.cpu.build`), and one Python
function per entry point that checks and lays out its tensors and calls it.

``csrc/evolve_cpu.cpp`` computes one correlation over [B, H, Q, K] maps with its input mask, ReLU, output mask and
blend in a single pass (:func:`correlate`, ``ea_correlate``): the forward step ``ReLU(Conv(A_in * keep)) +
(1 - beta) * A_in``, and plain correlations; the step's whole backward in one pass over the rows
(:func:`backward_pass`, ``ea_backward``); and the attention core's masked passes (:func:`select_kept`). On CPU it
is faster than torch's convolution for H-channel maps, which reorders NCHW maps to a blocked layout and back around
every call, and it allocates nothing but its output. The evolution calls these through
:mod:`ea_hf.ops.cpu.evolution` (and the torch operators of :mod:`ea_hf.ops.cpu.operators`); callers check
:func:`ea_hf.ops.cpu.evolution.applicable` first.

:func:`correlate` mirrors ``ea_correlate``'s arguments: a general correlation whose input may be mixed with
another map (``lerp_end``, ``lerp_weight``) and whose output may be blended with one (``blend``, ``blend_coef``).
The evolution step's own arguments (an :class:`~ea_hf.modeling.step.EvolutionStep`) are unpacked into them in
one place, ``ea_hf.ops.fused_step``; :func:`backward_pass` unpacks them for ``ea_backward``.

Without a compiler, or with ``EA_HF_KERNELS=0``, :func:`cpu_kernel` returns ``None`` and the evolution uses torch
operations (same results to float rounding).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import subprocess
import threading
from collections.abc import Iterator

import torch

from ...modeling.step import EvolutionStep, GradientIn, ScaledMap, StepMaps, checked_packed_gate, pack_gate
from ..fused_step import CorrelationOptions, tracing_without_kernels
from . import build

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}
_NOT_LOADED = object()


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


def _load(compiler: str, flags: tuple[str, ...] = build.FLAGS) -> ctypes.CDLL:
    """The kernel built with ``flags`` (cached), loaded and its entry points declared."""
    return _declare(ctypes.CDLL(str(build.build(compiler, flags))))


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
            compiler = build.find_compiler()
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
    compiler = build.find_compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler: the fused CPU kernel cannot be built on this machine")
    return _load(compiler, (*build.FLAGS, *extra_flags))


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


#: Maps smaller than this take torch's operators instead of :func:`select_kept`'s kernel pass: a decoding step's one-row
#: maps, where the checks and the ctypes call cost more than the pass saves (docs/performance.md, "Choices in the fused
#: kernels").
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
    broadcasts to it and is contiguous along the keys, and no jit trace running
    (:func:`~ea_hf.ops.fused_step.tracing_without_kernels`). Called directly, outside autograd and compilation (see
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
    if (x.shape[-1] > 1 and keep.stride(-1) != 1) or library is None or tracing_without_kernels():
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
    skip_masked_tails: bool = False,
    **options,
) -> torch.Tensor:
    """One fused pass of the kernel (see ``csrc/evolve_cpu.cpp``), called directly (the operators of
    :mod:`~ea_hf.ops.cpu.operators` wrap it); callers check :func:`ea_hf.ops.cpu.evolution.applicable` first.
    ``options`` are :class:`~ea_hf.ops.fused_step.CorrelationOptions`' fields (masks are read as float32 maps; in
    place, one map less is allocated).

    ``skip_masked_tails`` (with ``in_keep``): each row's correlation stops after its last kept column, rounded up
    to 64 columns; from there on the gate is 0 and the output 0, or in place ``x`` left as it is (no pass over
    a causal map's future half). A row without a kept column is correlated whole. For callers whose softmax
    masks, in every layer, the entries right of a row's last kept column: a causal map's future, a batch's
    padded keys (see :func:`forward_correlation`).
    With or without it, a row whose every input row ``in_keep`` masks whole (a padding query's, or outside the
    map) takes its bias for the correlation without computing the products, which would add zeros: the same
    bits, with finite weights.
    """
    options = CorrelationOptions(**options)
    library = cpu_kernel()
    batch, heads, rows, cols = x.shape
    x = x.contiguous()
    weight = weight.detach().to(torch.float32).contiguous()
    bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
    blend = None if options.blend is None else options.blend.contiguous()
    lerp_end = None if options.lerp_end is None else options.lerp_end.contiguous()
    in_keep = kernel_keep(options.in_keep, batch, rows, cols)
    out_keep = kernel_keep(options.out_keep, batch, rows, cols)
    out = x if options.in_place else torch.empty_like(x)
    status = library.ea_correlate(
        x.data_ptr(),
        _pointer(lerp_end),
        float(options.lerp_weight),
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
        int(options.relu),
        _pointer(checked_packed_gate(options.saved, x)),
        _pointer(out_keep),
        _pointer(blend),
        float(options.blend_coef),
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
    """The correlation of the evolution's forward: :func:`correlate`, skipping masked tails where the caller says every
    layer of its chain masks them in its softmax (see :attr:`AttentionMapEvolution.skip_masked_tails
    <ea_hf.modeling.evolution.AttentionMapEvolution.skip_masked_tails>`): each layer's logits then differ from the
    reference formulation's only in entries every layer's softmax masks, and no output or gradient depends on them; a
    causal map's correlation then skips nearly half its work (docs/performance.md, "Choices in the fused kernels")."""
    return functools.partial(correlate, skip_masked_tails=True) if skip_masked_tails else correlate


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


def backward_pass(
    step: EvolutionStep,
    maps: StepMaps,
    grad: GradientIn,
    gate: torch.Tensor,
    weight: torch.Tensor,
    *,
    into: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    shared_map: bool = False,
    scores_map: bool = False,
) -> tuple[torch.Tensor | ScaledMap, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The evolution step's whole backward in one pass over the rows (``ea_backward``).

    Returns the gradients of S, of A_prev (``None`` without it), and of the beta-scaled kernel's weight and bias,
    for A_logit = ReLU(Conv(A_in * keep)) + (1 - beta) * A_in, A_in = lerp(S, A_prev, alpha), the ReLU gate
    ``gate`` (bit-packed as :func:`correlate` writes it; a bool map is packed first), the beta-scaled ``weight``
    and the incoming gradient ``grad``.
    ``into`` names maps the caller no longer needs that the gradients of S and of A_prev may be written to
    (``grad.grad`` itself may hold the first: each row is read before it is overwritten; ``grad.spent`` names
    it). ``grad.addend``, a second incoming gradient, is added to ``grad.grad`` as its rows are read (one pass
    over the maps less than adding first).

    ``shared_map``: the gradient of A_in, G_in, is written once. With A_prev and alpha != 0 that map is A_prev's
    gradient, alpha * G_in, and S's is returned as ``ScaledMap(it, (1 - alpha) / alpha)``; with alpha = 0 it is S's,
    ``ScaledMap(G_in, 1.0)``, and A_prev's is ``None`` (none flows): a second map would cost time and a map of memory
    (docs/performance.md, "Choices in the fused kernels").
    ``scores_map``: G_in is written once too, as S's gradient (see
    :func:`~ea_hf.ops.cpu.operators.split_map_gradient`), and A_prev's is returned as ``None``.
    ``step.skip_masked_tails`` (with ``keep``): each row stops at its masked tail, as :func:`forward_correlation`'s
    does forward; the gradients there are 0, as they are where every layer's softmax masks those entries (the
    incoming gradient is 0 there).
    """
    library = cpu_kernel()
    alpha = step.alpha
    scores, previous, keep = maps
    batch, heads, rows, cols = scores.shape
    kernel_rows, kernel_cols = weight.shape[-2:]
    transposed = weight.detach().to(torch.float32).flip(-2, -1).transpose(0, 1).contiguous()
    gate = checked_packed_gate(pack_gate(gate).contiguous(), scores)
    scores, incoming = scores.contiguous(), grad.grad.contiguous()
    previous = None if previous is None else previous.contiguous()
    addend = None if grad.addend is None else grad.addend.contiguous()
    if grad.spent and into[0] is None:
        into = (grad.grad, into[1])
    keep = kernel_keep(keep, batch, rows, cols)
    grad_scores = _output_map(into[0], scores, (scores, previous, addend))
    grad_previous = None
    if previous is not None and not (shared_map or scores_map):
        grad_previous = _output_map(into[1], scores, (scores, previous, incoming, addend, grad_scores))
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
        incoming.data_ptr(),
        _pointer(addend),
        gate.data_ptr(),
        transposed.data_ptr(),
        batch,
        heads,
        rows,
        cols,
        kernel_rows,
        kernel_cols,
        -step.context_rows,
        -(kernel_rows - 1 - step.context_rows),
        1.0 - step.beta,
        grad_scores.data_ptr(),
        out_scale,
        _pointer(grad_previous),
        float(alpha),
        grad_weight.data_ptr(),
        grad_bias.data_ptr(),
        torch.get_num_threads(),
        int(step.skip_masked_tails and keep is not None),
    )
    if status != 0:
        raise RuntimeError(f"ea_hf CPU kernel rejected a map with {heads} heads")
    if shares:
        return ScaledMap(grad_scores, (1.0 - alpha) / alpha), grad_scores, grad_weight, grad_bias
    if shared_map:
        return ScaledMap(grad_scores, 1.0), None, grad_weight, grad_bias
    return grad_scores, grad_previous, grad_weight, grad_bias

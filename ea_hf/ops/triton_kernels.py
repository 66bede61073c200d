"""Triton kernels of the evolution's convolution step: the fused-kernel protocol of ``ea_hf.ops.cpu`` for GPUs.

The module provides the three functions of ``ea_hf.modeling.convolution.FusedKernel`` with the semantics of
:mod:`ea_hf.ops.cpu` (see ``csrc/evolve_cpu.cpp`` for the reference definition of every option):

- :func:`correlate`: one Triton program per (batch, output head, block of rows, block of columns) accumulates
  the H x kh x kw correlation in float32, reading the input mixed with ``lerp_end`` and masked as it loads
  (zeros outside the map), then adds the bias, applies ReLU, writes the bool gate, masks and blends in the
  same pass. Maps may be float32, bfloat16 or float16; weights and accumulators are float32.
- :func:`backward`: one kernel computes the input gradient (the transposed correlation of the gated
  gradient, masked, blended with the incoming gradient and split by the residual weights) straight from
  ``grad`` and the bool gate; a second computes the weight and bias gradients from S, A_prev, the mask and
  the gated gradient, per (output head, kernel tap, block of rows), with per-program partial sums reduced by
  torch (deterministic, no atomics). Neither materialises A_in, the gated gradient or the masked input.

Opt-in only. These kernels have been verified against the torch formulation and the CPU kernel with
Triton's CPU interpreter (``TRITON_INTERPRET=1``, ``tests/ops/test_triton_kernel.py``) but have never been
compiled for or run on a real GPU, so :func:`applicable` is False unless ``EA_HF_TRITON=1``: for CUDA tensors
it takes that variable alone, for CPU tensors (the interpreter, for tests) also ``TRITON_INTERPRET=1``. Both
are read at call time. Without triton installed the module still imports and :func:`applicable` is False.

Triton decides when a function is decorated whether it will be interpreted, so the kernels below are plain
functions wrapped by ``triton.jit`` on first use, once per interpreter setting (:func:`_kernels`). They call
only Triton builtins (``tl.full``, not ``tl.zeros``; no ``tl.sum``): the helpers that ``triton.language``
itself defines with ``@triton.jit`` are decorated when triton is imported, and torch imports it early
(``torch._dynamo``), usually before a test sets ``TRITON_INTERPRET``; the interpreter cannot call them then.
"""

import math
import os
import threading
from types import SimpleNamespace

import torch

from ..modeling.convolution import plus_addend
from .fused_step import evolve_by_correlation

try:  # optional dependency: the module must import (and decline every map) without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

#: Limits mirrored from the CPU kernel: the weight-gradient kernel holds a power-of-two block of heads, and
#: every tap is unrolled at compile time.
MAX_HEADS = 64
MAX_KERNEL_ROWS = 8
MAX_KERNEL_COLUMNS = 33
#: Tile sizes (powers of two; untuned: never timed on a GPU). The correlation kernels compute a
#: BLOCK_ROWS x BLOCK_COLS output tile; the weight-gradient kernel reads WEIGHT_BLOCK_ROWS x WEIGHT_BLOCK_COLS
#: tiles of all heads at once. Tests make them small to exercise several partial tiles.
BLOCK_ROWS = 16
BLOCK_COLS = 32
WEIGHT_BLOCK_ROWS = 4
WEIGHT_BLOCK_COLS = 32
#: About how many programs the weight-gradient kernel is split into (over row blocks) to fill a GPU.
WEIGHT_GRAD_PROGRAMS = 512
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_lock = threading.Lock()
_compiled: dict[bool, SimpleNamespace] = {}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _opted_in() -> bool:
    return os.environ.get("EA_HF_TRITON", "0") == "1"


def applicable(*tensors: torch.Tensor | None, keep: torch.Tensor | None = None, weight: torch.Tensor) -> bool:
    """Whether these kernels take these maps and this kernel weight.

    True only with triton importable, ``EA_HF_TRITON=1`` (and ``TRITON_INTERPRET=1`` for CPU tensors),
    4-D maps of one dtype (float32, bfloat16 or float16) on one CUDA or CPU device, a mask shared by the
    heads, and a kernel of odd width within the CPU kernel's limits.
    """
    if triton is None or not _opted_in():
        return False
    if weight.dim() != 4 or weight.shape[-1] % 2 == 0:  # an even width has no centre column
        return False
    if weight.shape[-2] > MAX_KERNEL_ROWS or weight.shape[-1] > MAX_KERNEL_COLUMNS:
        return False
    maps = [t for t in tensors if t is not None]
    if not maps:
        return False
    device, dtype = maps[0].device, maps[0].dtype
    if any(t.dim() != 4 or t.device != device or t.dtype != dtype for t in maps) or dtype not in DTYPES:
        return False
    heads = maps[0].shape[1]
    if not 1 <= heads <= MAX_HEADS or tuple(weight.shape[:2]) != (heads, heads):
        return False
    if keep is not None:
        # Broadcast from the right, keep's third-last dimension is the heads: it must be 1 (a shared mask).
        if keep.device != device or keep.dim() > 4 or (keep.dim() >= 3 and keep.shape[-3] != 1):
            return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and _interpreting()


def _keep_view(
    keep: torch.Tensor | None, batch: int, rows: int, cols: int
) -> tuple[torch.Tensor | None, int, int, int]:
    """``keep`` broadcast to [B, 1, Q, K] as a view and its (batch, row, column) strides: broadcast dimensions
    get stride 0, so a [B, 1, 1, K] or [Q, K] mask is read where it lies instead of being expanded."""
    if keep is None:
        return None, 0, 0, 0
    view = keep.expand(batch, 1, rows, cols)
    return view, view.stride(0), view.stride(2), view.stride(3)


def _float32(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach().to(device=device, dtype=torch.float32).contiguous()


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
) -> torch.Tensor:
    """One fused correlation pass, as :func:`ea_hf.ops.cpu.correlate`; callers check :func:`applicable` first.

    Output row i reads rows ``i + row_shift .. i + row_shift + kh - 1`` of ``x`` (zeros outside) and columns
    ``j - kw // 2 .. j + kw // 2``. With ``lerp_end``, ``x`` and ``blend`` are first mixed with it:
    ``x + lerp_weight * (lerp_end - x)``. Masks broadcast to [B, 1, Q, K]; ``saved`` (bool, like ``x``)
    receives where the (ReLU) output is positive. ``in_place`` writes the result over ``x`` and returns it.

    In place, programs still reading ``x`` would race with those writing it, so the result is computed one
    batch element at a time into a scratch map of one element (an output element reads only its own batch
    element of ``x``) and copied over it: the result is identical to the out-of-place one.
    """
    kernels = _kernels()
    batch, heads, rows, cols = x.shape
    x = x.contiguous()
    weight = _float32(weight, x.device)
    bias = _float32(bias, x.device)
    lerp_end = None if lerp_end is None else lerp_end.contiguous()
    blend = None if blend is None else blend.contiguous()
    if saved is not None and not saved.is_contiguous():
        raise ValueError("saved must be a contiguous bool map")
    in_keep, *in_strides = _keep_view(in_keep, batch, rows, cols)
    out_keep, *out_strides = _keep_view(out_keep, batch, rows, cols)

    def launch(elements: slice, out: torch.Tensor) -> None:
        def part(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor[elements]

        count = len(range(*elements.indices(batch)))
        grid = (count * heads, triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(cols, BLOCK_COLS))
        kernels.correlate[grid](
            part(x),
            part(lerp_end),
            float(lerp_weight),
            part(in_keep),
            *in_strides,
            weight,
            bias,
            part(saved),
            part(out_keep),
            *out_strides,
            part(blend),
            float(blend_coef),
            out,
            heads,
            rows,
            cols,
            row_shift,
            KERNEL_ROWS=weight.shape[-2],
            KERNEL_COLS=weight.shape[-1],
            HAS_END=lerp_end is not None,
            HAS_IN_KEEP=in_keep is not None,
            HAS_BIAS=bias is not None,
            RELU=bool(relu),
            HAS_SAVED=saved is not None,
            HAS_OUT_KEEP=out_keep is not None,
            HAS_BLEND=blend is not None,
            BLOCK_Q=BLOCK_ROWS,
            BLOCK_K=BLOCK_COLS,
        )

    if not in_place:
        out = torch.empty_like(x)
        launch(slice(None), out)
        return out
    scratch = torch.empty_like(x[:1])
    for element in range(batch):
        launch(slice(element, element + 1), scratch)
        x[element : element + 1].copy_(scratch)
    return x


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
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The evolution step's backward, as :func:`ea_hf.ops.cpu.backward`; callers check :func:`applicable`.
    (``into``, the spent maps the CPU kernel may write to, is not used: the gradients get new maps; ``addend``
    is added to ``grad`` first, over it where ``into`` names it as spent.)

    Returns the gradients of S, of A_prev (``None`` without ``previous``), and of the beta-scaled kernel's
    weight and bias (float32), for A_logit = ReLU(Conv(A_in * keep)) + (1 - beta) * A_in with
    A_in = lerp(S, A_prev, alpha), the bool ReLU gate ``gate`` and the output gradient ``grad``. Output row i
    of the forward step read input rows ``i - context_rows .. i - context_rows + kh - 1``.
    """
    kernels = _kernels()
    batch, heads, rows, cols = scores.shape
    kernel_rows, kernel_cols = scaled_weight.shape[-2:]
    device = scores.device
    weight = _float32(scaled_weight, device)
    grad = plus_addend(grad, addend, owned=into[0] is grad)
    scores, grad, gate = scores.contiguous(), grad.contiguous(), gate.contiguous()
    previous = None if previous is None else previous.contiguous()
    keep, *keep_strides = _keep_view(keep, batch, rows, cols)
    grad_scores = torch.empty_like(scores)
    grad_previous = None if previous is None else torch.empty_like(scores)
    grid = (batch * heads, triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(cols, BLOCK_COLS))
    kernels.input_grad[grid](
        grad,
        gate,
        weight,
        keep,
        *keep_strides,
        grad_scores,
        grad_previous,
        1.0 if previous is None else 1.0 - float(alpha),
        float(alpha),
        1.0 - float(beta),
        heads,
        rows,
        cols,
        context_rows,
        KERNEL_ROWS=kernel_rows,
        KERNEL_COLS=kernel_cols,
        HAS_KEEP=keep is not None,
        HAS_SECOND=grad_previous is not None,
        BLOCK_Q=BLOCK_ROWS,
        BLOCK_K=BLOCK_COLS,
    )
    # Split the row blocks of all batch elements so that about WEIGHT_GRAD_PROGRAMS programs run; each writes
    # its whole accumulator tile, which torch adds up in a fixed order (deterministic, no atomics). That is
    # about WEIGHT_GRAD_PROGRAMS x next_power_of_2(H) x WEIGHT_BLOCK_ROWS x WEIGHT_BLOCK_COLS floats (4 MiB for
    # 16 heads), independent of the map size.
    row_blocks = triton.cdiv(rows, WEIGHT_BLOCK_ROWS)
    total_blocks, taps = batch * row_blocks, kernel_rows * kernel_cols
    splits = max(1, min(total_blocks, math.ceil(WEIGHT_GRAD_PROGRAMS / (heads * taps))))
    blocks_per_split = math.ceil(total_blocks / splits)
    splits = math.ceil(total_blocks / blocks_per_split)
    block_heads = triton.next_power_of_2(heads)
    tile = WEIGHT_BLOCK_ROWS * WEIGHT_BLOCK_COLS
    partial_weight = torch.empty(splits, heads, taps, block_heads, tile, device=device)
    partial_bias = torch.empty(splits, heads, taps, tile, device=device)
    kernels.weight_grad[(heads, taps, splits)](
        scores,
        previous,
        float(alpha),
        keep,
        *keep_strides,
        grad,
        gate,
        partial_weight,
        partial_bias,
        heads,
        rows,
        cols,
        context_rows,
        row_blocks,
        total_blocks,
        blocks_per_split,
        KERNEL_ROWS=kernel_rows,
        KERNEL_COLS=kernel_cols,
        HAS_PREVIOUS=previous is not None,
        HAS_KEEP=keep is not None,
        BLOCK_C=block_heads,
        BLOCK_R=WEIGHT_BLOCK_ROWS,
        BLOCK_K=WEIGHT_BLOCK_COLS,
    )
    # [split, o, tap, c, tile] -> [o, c, tap]; every tap's program summed the same gradient for the bias.
    grad_weight = partial_weight.sum((0, 4))[:, :, :heads].transpose(1, 2)
    grad_bias = partial_bias[:, :, 0].sum((0, 2))
    return grad_scores, grad_previous, grad_weight.reshape(heads, heads, kernel_rows, kernel_cols), grad_bias


def _kernels() -> SimpleNamespace:
    """The jitted kernels for the current ``TRITON_INTERPRET`` setting, wrapped on first use."""
    if triton is None:
        raise RuntimeError("ea_hf Triton kernels need triton installed (check applicable() first)")
    interpret = _interpreting()
    with _lock:
        if interpret not in _compiled:
            # triton.jit reads TRITON_INTERPRET itself, now: the wrappers for one setting are never reused for
            # the other.
            _compiled[interpret] = SimpleNamespace(
                correlate=triton.jit(_correlate_kernel),
                input_grad=triton.jit(_input_grad_kernel),
                weight_grad=triton.jit(_weight_grad_kernel),
            )
        return _compiled[interpret]


if tl is not None:

    def _correlate_kernel(
        x_ptr,
        end_ptr,
        lerp_weight,
        in_keep_ptr,
        in_keep_batch_stride,
        in_keep_row_stride,
        in_keep_col_stride,
        w_ptr,
        bias_ptr,
        saved_ptr,
        out_keep_ptr,
        out_keep_batch_stride,
        out_keep_row_stride,
        out_keep_col_stride,
        blend_ptr,
        blend_coef,
        out_ptr,
        heads,
        rows,
        cols,
        row_shift,
        KERNEL_ROWS: tl.constexpr,
        KERNEL_COLS: tl.constexpr,
        HAS_END: tl.constexpr,
        HAS_IN_KEEP: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        RELU: tl.constexpr,
        HAS_SAVED: tl.constexpr,
        HAS_OUT_KEEP: tl.constexpr,
        HAS_BLEND: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """out[b, o, i, j] = epilogue(bias[o] + sum_{c,dy,dx} w[o,c,dy,dx] * a[b, c, i+dy+row_shift, j+dx-kw//2]),
        a = (x mixed with lerp_end) * in_keep, zero outside the map."""
        pid = tl.program_id(0)
        # int64 offsets: B * H * Q * K overflows int32 for long sequences.
        b = (pid // heads).to(tl.int64)
        o = pid % heads
        i = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        j = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
        plane = rows * cols
        acc = tl.full([BLOCK_Q, BLOCK_K], 0.0, tl.float32)
        # Taps outside, heads inside: the bounds and the mask (shared by the heads) are computed once per tap.
        for dy in tl.static_range(KERNEL_ROWS):
            r = i + dy + row_shift
            row_inside = (r >= 0) & (r < rows)
            for dx in tl.static_range(KERNEL_COLS):
                s = j + dx - KERNEL_COLS // 2
                inside = row_inside[:, None] & ((s >= 0) & (s < cols))[None, :]
                at = r[:, None] * cols + s[None, :]
                if HAS_IN_KEEP:
                    keep_at = b * in_keep_batch_stride + r[:, None] * in_keep_row_stride
                    keep_at = keep_at + s[None, :] * in_keep_col_stride
                    keep = tl.load(in_keep_ptr + keep_at, mask=inside, other=0.0).to(tl.float32)
                for c in range(heads):
                    head_at = (b * heads + c) * plane + at
                    a = tl.load(x_ptr + head_at, mask=inside, other=0.0).to(tl.float32)
                    if HAS_END:
                        end = tl.load(end_ptr + head_at, mask=inside, other=0.0).to(tl.float32)
                        a = a + lerp_weight * (end - a)
                    if HAS_IN_KEEP:
                        a = a * keep
                    acc += tl.load(w_ptr + ((o * heads + c) * KERNEL_ROWS + dy) * KERNEL_COLS + dx) * a
        if HAS_BIAS:
            acc += tl.load(bias_ptr + o)
        if RELU:
            acc = tl.maximum(acc, 0.0)
        inside = (i < rows)[:, None] & (j < cols)[None, :]
        at = (b * heads + o) * plane + i[:, None] * cols + j[None, :]
        if HAS_SAVED:
            tl.store(saved_ptr + at, acc > 0.0, mask=inside)
        if HAS_OUT_KEEP:
            keep_at = b * out_keep_batch_stride + i[:, None] * out_keep_row_stride + j[None, :] * out_keep_col_stride
            acc = acc * tl.load(out_keep_ptr + keep_at, mask=inside, other=0.0).to(tl.float32)
        if HAS_BLEND:
            mixed = tl.load(blend_ptr + at, mask=inside, other=0.0).to(tl.float32)
            if HAS_END:  # the CPU kernel mixes blend with lerp_end like x (blend is S: the blend adds A_in)
                end = tl.load(end_ptr + at, mask=inside, other=0.0).to(tl.float32)
                mixed = mixed + lerp_weight * (end - mixed)
            acc += blend_coef * mixed
        tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=inside)

    def _input_grad_kernel(
        grad_ptr,
        gate_ptr,
        w_ptr,
        keep_ptr,
        keep_batch_stride,
        keep_row_stride,
        keep_col_stride,
        out_ptr,
        out2_ptr,
        out_scale,
        out2_scale,
        blend_coef,
        heads,
        rows,
        cols,
        context_rows,
        KERNEL_ROWS: tl.constexpr,
        KERNEL_COLS: tl.constexpr,
        HAS_KEEP: tl.constexpr,
        HAS_SECOND: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """v[b, c, r, s] = keep * sum_{o,dy,dx} w[o,c,dy,dx] * gy[b, o, r-dy+context_rows, s-dx+kw//2]
        + blend_coef * grad[b, c, r, s] with gy = grad * gate; out = out_scale * v, out2 = out2_scale * v.

        Reading w[o, c] at mirrored offsets is the correlation with the flipped, transposed kernel that the CPU
        kernel precomputes, without a copy of the kernel."""
        pid = tl.program_id(0)
        b = (pid // heads).to(tl.int64)
        c = pid % heads
        i = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        j = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
        plane = rows * cols
        acc = tl.full([BLOCK_Q, BLOCK_K], 0.0, tl.float32)
        for dy in tl.static_range(KERNEL_ROWS):
            r = i - dy + context_rows
            row_inside = (r >= 0) & (r < rows)
            for dx in tl.static_range(KERNEL_COLS):
                s = j - dx + KERNEL_COLS // 2
                inside = row_inside[:, None] & ((s >= 0) & (s < cols))[None, :]
                at = r[:, None] * cols + s[None, :]
                for o in range(heads):
                    head_at = (b * heads + o) * plane + at
                    g = tl.load(grad_ptr + head_at, mask=inside, other=0.0).to(tl.float32)
                    open_gate = tl.load(gate_ptr + head_at, mask=inside, other=0).to(tl.int1)
                    w = tl.load(w_ptr + ((o * heads + c) * KERNEL_ROWS + dy) * KERNEL_COLS + dx)
                    acc += w * tl.where(open_gate, g, 0.0)
        inside = (i < rows)[:, None] & (j < cols)[None, :]
        if HAS_KEEP:
            keep_at = b * keep_batch_stride + i[:, None] * keep_row_stride + j[None, :] * keep_col_stride
            acc = acc * tl.load(keep_ptr + keep_at, mask=inside, other=0.0).to(tl.float32)
        at = (b * heads + c) * plane + i[:, None] * cols + j[None, :]
        acc += blend_coef * tl.load(grad_ptr + at, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + at, (out_scale * acc).to(out_ptr.dtype.element_ty), mask=inside)
        if HAS_SECOND:
            tl.store(out2_ptr + at, (out2_scale * acc).to(out2_ptr.dtype.element_ty), mask=inside)

    def _weight_grad_kernel(
        scores_ptr,
        previous_ptr,
        alpha,
        keep_ptr,
        keep_batch_stride,
        keep_row_stride,
        keep_col_stride,
        grad_ptr,
        gate_ptr,
        partial_weight_ptr,
        partial_bias_ptr,
        heads,
        rows,
        cols,
        context_rows,
        row_blocks,
        total_blocks,
        blocks_per_split,
        KERNEL_ROWS: tl.constexpr,
        KERNEL_COLS: tl.constexpr,
        HAS_PREVIOUS: tl.constexpr,
        HAS_KEEP: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """partial_weight[split, o, tap] = the [BLOCK_C, BLOCK_R, BLOCK_K] sums over the split's row blocks of
        gy[b, o, i, j] times the masked A_in[b, c, i+dy-context_rows, j+dx-kw//2] (c along BLOCK_C);
        partial_bias[split, o, tap] = the [BLOCK_R, BLOCK_K] sums of gy[b, o] (the same for every tap).

        A gradient tile of head o multiplies the tiles of all input heads at once, mixed and masked where they
        are read. The accumulators are stored whole and summed by torch rather than reduced with tl.sum, which
        the interpreter may be unable to run (see the module docstring)."""
        o = tl.program_id(0)
        tap = tl.program_id(1)
        split = tl.program_id(2)
        dy = tap // KERNEL_COLS
        dx = tap % KERNEL_COLS
        channels = tl.arange(0, BLOCK_C)
        lanes_r = tl.arange(0, BLOCK_R)
        lanes_k = tl.arange(0, BLOCK_K)
        channel_inside = channels < heads
        acc = tl.full([BLOCK_C, BLOCK_R, BLOCK_K], 0.0, tl.float32)
        acc_bias = tl.full([BLOCK_R, BLOCK_K], 0.0, tl.float32)
        first = split * blocks_per_split
        last = tl.minimum(first + blocks_per_split, total_blocks)
        for block in range(first, last):
            b = (block // row_blocks).to(tl.int64)
            i = (block % row_blocks) * BLOCK_R + lanes_r
            r = i + dy - context_rows
            row_inside = (r >= 0) & (r < rows)
            grad_rows = ((b * heads + o) * rows + i) * cols
            input_rows = ((b * heads + channels) * rows)[:, None] + r[None, :]
            for start in range(0, cols, BLOCK_K):
                j = start + lanes_k
                inside = (i < rows)[:, None] & (j < cols)[None, :]
                g = tl.load(grad_ptr + grad_rows[:, None] + j[None, :], mask=inside, other=0.0).to(tl.float32)
                open_gate = tl.load(gate_ptr + grad_rows[:, None] + j[None, :], mask=inside, other=0).to(tl.int1)
                g = tl.where(open_gate, g, 0.0)
                acc_bias += g
                s = j + dx - KERNEL_COLS // 2
                source_inside = row_inside[:, None] & ((s >= 0) & (s < cols))[None, :]
                loaded = channel_inside[:, None, None] & source_inside[None, :, :]
                at = input_rows[:, :, None] * cols + s[None, None, :]
                a = tl.load(scores_ptr + at, mask=loaded, other=0.0).to(tl.float32)
                if HAS_PREVIOUS:
                    p = tl.load(previous_ptr + at, mask=loaded, other=0.0).to(tl.float32)
                    a = a + alpha * (p - a)
                if HAS_KEEP:
                    keep_at = b * keep_batch_stride + r[:, None] * keep_row_stride + s[None, :] * keep_col_stride
                    keep = tl.load(keep_ptr + keep_at, mask=source_inside, other=0.0).to(tl.float32)
                    a = a * keep[None, :, :]
                acc += g[None, :, :] * a
        program = (split * heads + o) * (KERNEL_ROWS * KERNEL_COLS) + tap
        tile = lanes_r[:, None] * BLOCK_K + lanes_k[None, :]
        weight_at = program * (BLOCK_C * BLOCK_R * BLOCK_K) + channels[:, None, None] * (BLOCK_R * BLOCK_K)
        tl.store(partial_weight_ptr + weight_at + tile[None, :, :], acc)
        tl.store(partial_bias_ptr + program * (BLOCK_R * BLOCK_K) + tile, acc_bias)


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The evolution step's forward pass (see ``ea_hf.modeling.convolution.FusedKernel``) in one launch."""
    return evolve_by_correlation(
        correlate, scores, previous, keep, weight, bias, alpha, blend, context_rows, in_place=in_place, gate=gate
    )


def convolve(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, row_shift: int) -> torch.Tensor:
    """A plain correlation plus bias (the kept rows of a decoding step), as :func:`correlate` computes it."""
    return correlate(x, weight, bias, row_shift=row_shift)

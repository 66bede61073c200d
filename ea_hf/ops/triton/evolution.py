"""Triton kernels of the evolution step: the ``FusedKernel`` protocol of ``ea_hf.modeling`` (:func:`applicable`,
:func:`evolve`, :func:`convolve`, :func:`backward`, :func:`select_kept`) for GPUs, with the semantics of
:mod:`ea_hf.ops.cpu` (see ``cpu/csrc/evolve_cpu.cpp`` for the reference definition of every option).

- :func:`correlate`: one Triton program per (batch element, tile of pixels) computes every output head of its
  tile as one matrix product (``tl.dot``): the [H, H*kh*kw] weights times the input's taps, gathered as they
  are loaded (an implicit im2col: each value mixed with ``lerp_end`` and masked as it is read, zeros outside
  the map), in blocks of (input head, tap) pairs; then it adds the bias, applies ReLU, writes the gate
  (bit-packed, ``ea_hf.modeling.step.packed_gate``: the CPU kernel's form, an eighth of a bool map, which is
  what a training step keeps of it a layer), masks and blends in the same pass. Maps may be float32, bfloat16
  or float16, with float32 accumulators.
- :func:`backward_pass`: one kernel computes the input gradient the same way (the transposed weights times the
  gated gradient's taps; masked, blended with the incoming gradient and split by the residual weights)
  straight from ``grad`` and the packed gate; a second computes the weight and bias gradients as products of
  the gated gradient and the masked A_in's taps (plus a column of ones: the bias), per block of (input head,
  tap) pairs and run of tiles, with per-program partial sums reduced by torch (deterministic, no atomics).
  Neither materialises A_in, the gated gradient or the masked input.

Each kernel stands beside its launcher, and launches over a few configurations of tiles, warps and stages
(:data:`CONFIGS`), which autotune searches on a GPU. Where they run (``EA_HF_TRITON``), how products are multiplied,
how a launch's configuration is chosen and why the kernels are jitted on first use (:data:`jitted`) are
:mod:`.common`'s. Whole models in half precision evolve maps in their own dtype.
``tests/ops/triton/test_evolution.py`` runs every kernel in Triton's CPU interpreter (and compiled where a GPU is),
``tests/ops/triton/test_compilation.py`` compiles every launch and every configuration for sm_90 where no GPU is.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from ...modeling.convolution import plus_addend
from ...modeling.step import EvolutionStep, GradientIn, StepMaps, checked_packed_gate, pack_gate, packed_gate_shape
from ..fused_step import CorrelationOptions, evolve_by_correlation, schema_arguments
from ..limits import MAX_HEADS, MAX_KERNEL_COLUMNS, MAX_KERNEL_ROWS
from . import common
from .common import JittedPerSetting, tile_product, tl, triton


def _config(rows: int, cols: int, taps: int, warps: int, stages: int = 3) -> dict[str, int]:
    return {"BLOCK_Q": rows, "BLOCK_K": cols, "BLOCK_TAPS": taps, "num_warps": warps, "num_stages": stages}


#: The configurations each kernel's launches search on a GPU (:func:`configs`; see :mod:`.common`), by the maps'
#: dtype: a tile of BLOCK_Q x BLOCK_K pixels, BLOCK_TAPS (head, tap) pairs a product, warps and pipeline stages.
#: The correlation kernels compute all heads of a tile per program; the weight-gradient kernel reduces over the
#: tiles of a run. A tile's pixels and the tap blocks are sides of tl.dot, so each is at least 16, and a tile's
#: columns are whole bytes of the packed gate (a multiple of 8). The first of each list is the best known
#: (``bench/benchmarks/triton_kernels.py --sweep`` on BERT-Base maps, N = 512, batch 8: the half-precision tiles on an
#: H100, the float32 ones on an H200 in TF32; docs/performance.md, "Choices in the fused kernels"): it is what runs
#: in the interpreter and under torch's deterministic algorithms. The rest are the sweep's other settings and
#: their neighbours. Half-precision maps take half the bytes a value, so larger weight-gradient tap blocks fit in a
#: program's shared memory (float32 maps with 128 need more than the 227 KiB of sm_90);
#: ``tests/ops/triton/test_compilation.py`` compiles every one for sm_90.
CONFIGS: dict[str, dict[str, tuple[dict, ...]]] = {
    "float32": {
        "correlate": (_config(8, 32, 16, 4), _config(4, 32, 32, 4), _config(16, 32, 16, 8), _config(8, 32, 16, 4, 2)),
        "input_grad": (_config(8, 32, 16, 4), _config(4, 32, 32, 4), _config(8, 32, 32, 8), _config(16, 32, 16, 8)),
        "weight_grad": (_config(8, 32, 16, 4), _config(4, 32, 32, 4), _config(4, 16, 64, 8)),
    },
    "half": {
        "correlate": (
            _config(8, 32, 16, 4), _config(4, 32, 32, 4), _config(8, 32, 32, 8), _config(16, 32, 16, 8),
            _config(8, 64, 32, 8),
        ),
        "input_grad": (_config(8, 32, 16, 4), _config(4, 32, 32, 4), _config(8, 32, 32, 8), _config(8, 64, 32, 8)),
        "weight_grad": (_config(4, 16, 128, 8), _config(8, 32, 16, 4), _config(4, 32, 32, 4), _config(4, 16, 64, 4)),
    },
}  # fmt: skip
#: How many runs of tiles the weight-gradient kernel shares a batch's tiles out in (program axis 0): one per
#: WEIGHT_GRAD_SPLIT_PIXELS pixels of the batch's maps, at most WEIGHT_GRAD_SPLITS. With its blocks of taps, enough
#: programs to fill a GPU whatever the configuration, each writing its own partial sums (:func:`backward_pass`),
#: which stay a small fraction of a map (BERT-Base, N = 512, batch 8: 7 MB against a 50 MB bfloat16 map).
WEIGHT_GRAD_SPLITS = 1024
WEIGHT_GRAD_SPLIT_PIXELS = 1024
#: About how many pixels an in-place correlation launches at once (see :func:`correlate`).
IN_PLACE_PIXELS = 1 << 22


def configs(kernel: str, dtype: torch.dtype, heads: int, device: torch.device) -> list[dict]:
    """The configurations a launch of ``kernel`` (``correlate``, ``input_grad`` or ``weight_grad``) on ``heads``
    maps of ``dtype`` on ``device`` may use: :data:`CONFIGS` of the dtype, narrowed by the tuned-tile table
    (:func:`~.common.launch_configs`, bucket :func:`tile_bucket`). Read at call time, so that tests can set them.

    Example:
        >>> configs("weight_grad", torch.bfloat16, 12, torch.device("cpu"))[0]
        {'BLOCK_Q': 4, 'BLOCK_K': 16, 'BLOCK_TAPS': 128, 'num_warps': 8, 'num_stages': 3}
    """
    listed = CONFIGS[common.precision(dtype)][kernel]
    return common.launch_configs("evolution", kernel, listed, device, dtype, tile_bucket(heads))


def applicable(*tensors: torch.Tensor | None, keep: torch.Tensor | None = None, weight: torch.Tensor) -> bool:
    """Whether these kernels take these maps and this kernel weight.

    True only where the kernels may run on the maps' device and dtype (:func:`.common.enabled`: triton importable,
    no ONNX export or jit trace running; on CUDA ``EA_HF_TRITON=1`` or, unset, the default for the GPU and the
    precision; on CPU ``EA_HF_TRITON=1`` and ``TRITON_INTERPRET=1``), 4-D maps of one dtype (float32, bfloat16 or
    float16) on one CUDA or CPU device, fewer than 2**31 entries in one batch element's map (offsets within it are
    int32), a mask shared by the heads, and a kernel of odd width within the CPU kernel's limits.
    """
    if common.TOO_OLD_TRITON is not None and common.opted_in():
        warnings.warn(
            f"EA_HF_TRITON=1, but triton {common.TOO_OLD_TRITON} is older than the {common.MIN_TRITON} the "
            f"kernels need; using torch operations (pip install 'triton>={common.MIN_TRITON}')",
            stacklevel=2,
        )
        return False
    if weight.dim() != 4 or weight.shape[-1] % 2 == 0:  # an even width has no centre column
        return False
    if weight.shape[-2] > MAX_KERNEL_ROWS or weight.shape[-1] > MAX_KERNEL_COLUMNS:
        return False
    maps = [t for t in tensors if t is not None]
    if not maps:
        return False
    device, dtype = maps[0].device, maps[0].dtype
    if any(t.dim() != 4 or t.device != device or t.dtype != dtype for t in maps) or dtype not in common.DTYPES:
        return False
    if not common.enabled(device, dtype):
        return False
    heads = maps[0].shape[1]
    if not 1 <= heads <= MAX_HEADS or tuple(weight.shape[:2]) != (heads, heads):
        return False
    if maps[0][0].numel() >= 2**31:  # offsets within a batch element are int32
        return False
    if keep is not None:
        # Broadcast from the right, keep's third-last dimension is the heads: it must be 1 (a shared mask).
        if keep.device != device or keep.dim() > 4 or (keep.dim() >= 3 and keep.shape[-3] != 1):
            return False
    return True


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


# Device functions the kernels call by name, jitted with them (see :mod:`.common`).


def _input_taps(
    x_ptr, end_ptr, lerp_weight, element, at, keep_ptr, keep_element, r, s, keep_row_stride, keep_col_stride,
    inside, HAS_END: tl.constexpr, HAS_KEEP: tl.constexpr,
):  # fmt: skip
    """A_in's taps as float32: ``x`` at ``element + at`` mixed with ``end`` (A_prev), masked by ``keep`` at
    ``keep_element`` + rows ``r``, columns ``s``; zeros outside ``inside``."""
    a = tl.load(x_ptr + element + at, mask=inside, other=0.0).to(tl.float32)
    if HAS_END:
        end = tl.load(end_ptr + element + at, mask=inside, other=0.0).to(tl.float32)
        a = a + lerp_weight * (end - a)
    if HAS_KEEP:
        keep_at = r * keep_row_stride + s * keep_col_stride
        a = a * tl.load(keep_ptr + keep_element + keep_at, mask=inside, other=0.0).to(tl.float32)
    return a


def _tile_pixels(BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr):
    """(rows, columns) of the pixels of the program's BLOCK_Q x BLOCK_K tile (program axes 1 and 2), row by
    row: the columns of a product's pixel side."""
    pixel = tl.arange(0, BLOCK_Q * BLOCK_K)
    return tl.program_id(1) * BLOCK_Q + pixel // BLOCK_K, tl.program_id(2) * BLOCK_K + pixel % BLOCK_K


def _gated_gradient(grad_ptr, gate_ptr, at, gate_at, column, inside):
    """The incoming gradient at ``at`` where the ReLU gate is open, else zero, as float32: the gate is
    bit-packed (``packed_gate``), its byte at ``gate_at`` holding the pixel's ``column`` at bit column % 8."""
    g = tl.load(grad_ptr + at, mask=inside, other=0.0)
    byte = tl.load(gate_ptr + gate_at, mask=inside, other=0).to(tl.int32)
    return tl.where(((byte >> (column & 7)) & 1) != 0, g, 0.0).to(tl.float32)


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
    gate_cols,
    row_shift,
    rows_bucket,
    cols_bucket,
    KERNEL_ROWS: tl.constexpr,
    KERNEL_COLS: tl.constexpr,
    HAS_END: tl.constexpr,
    HAS_IN_KEEP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RELU: tl.constexpr,
    HAS_SAVED: tl.constexpr,
    HAS_OUT_KEEP: tl.constexpr,
    HAS_BLEND: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_TAPS: tl.constexpr,
    HALF: tl.constexpr,
    TENSOR_CORES: tl.constexpr,
    FP32_PRECISION: tl.constexpr,
):
    """out[b, o, i, j] = epilogue(bias[o] + sum_{c,dy,dx} w[o,c,dy,dx] * a[b, c, i+dy+row_shift, j+dx-kw//2]),
    a = (x mixed with lerp_end) * in_keep, zero outside the map.

    One program computes every output head of a BLOCK_Q x BLOCK_K tile of pixels as a matrix product:
    [heads, heads * taps] weights times the [heads * taps, pixels] input taps (an implicit im2col, gathered
    BLOCK_TAPS rows at a time as it is loaded), so each input value is read once per tap, not once per tap
    and output head."""
    # The pointers move to the program's batch element in int64 (B * H * Q * K overflows int32 for long
    # sequences); offsets within an element are int32 (applicable() checks H * Q * K fits), which keeps the
    # index arithmetic of the gathered taps cheap.
    b = tl.program_id(0).to(tl.int64)
    element = b * heads * rows * cols
    x_ptr += element
    out_ptr += element
    if HAS_END:
        end_ptr += element
    if HAS_SAVED:
        saved_ptr += b * heads * rows * gate_cols
    if HAS_BLEND:
        blend_ptr += element
    if HAS_IN_KEEP:
        in_keep_ptr += b * in_keep_batch_stride
    if HAS_OUT_KEEP:
        out_keep_ptr += b * out_keep_batch_stride
    i, j = _tile_pixels(BLOCK_Q, BLOCK_K)
    o = tl.arange(0, BLOCK_H)
    plane = rows * cols
    taps_per_head = KERNEL_ROWS * KERNEL_COLS
    reduction = heads * taps_per_head
    acc = tl.full([BLOCK_H, BLOCK_Q * BLOCK_K], 0.0, tl.float32)
    for start in range(0, reduction, BLOCK_TAPS):
        k = start + tl.arange(0, BLOCK_TAPS)  # (input head, tap) pairs
        c = k // taps_per_head
        dy = (k % taps_per_head) // KERNEL_COLS
        dx = k % KERNEL_COLS
        r = i[None, :] + (dy + row_shift)[:, None]
        s = j[None, :] + (dx - KERNEL_COLS // 2)[:, None]
        inside = (k < reduction)[:, None] & (r >= 0) & (r < rows) & (s >= 0) & (s < cols)
        at = c[:, None] * plane + r * cols + s
        a = _input_taps(
            x_ptr, end_ptr, lerp_weight, 0, at, in_keep_ptr, 0, r, s, in_keep_row_stride, in_keep_col_stride,
            inside, HAS_END, HAS_IN_KEEP,
        )  # fmt: skip
        w_inside = (o < heads)[:, None] & (k < reduction)[None, :]
        w = tl.load(w_ptr + o[:, None] * reduction + k[None, :], mask=w_inside, other=0.0)
        acc = tile_product(w, a, acc, x_ptr, HALF, TENSOR_CORES, FP32_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + o, mask=o < heads, other=0.0)[:, None]
    if RELU:
        acc = tl.maximum(acc, 0.0)
    pixel_inside = (i < rows) & (j < cols)
    inside = (o < heads)[:, None] & pixel_inside[None, :]
    at = o[:, None] * plane + (i * cols + j)[None, :]
    if HAS_SAVED:
        # The gate bit-packed (packed_gate's form): a row's 8 columns from a multiple of 8 to a byte (a tile
        # starts at one: BLOCK_K is a multiple of 8), bit j % 8, zero outside the map.
        bits = tl.where(inside & (acc > 0.0), 1, 0) << (j % 8)[None, :]
        packed = tl.reduce(tl.reshape(bits, [BLOCK_H, BLOCK_Q * BLOCK_K // 8, 8]), 2, tl.standard._sum_combine)
        byte = tl.arange(0, BLOCK_Q * BLOCK_K // 8)
        byte_row = tl.program_id(1) * BLOCK_Q + byte // (BLOCK_K // 8)
        byte_col = tl.program_id(2) * (BLOCK_K // 8) + byte % (BLOCK_K // 8)
        byte_inside = (o < heads)[:, None] & ((byte_row < rows) & (byte_col < gate_cols))[None, :]
        byte_at = o[:, None] * (rows * gate_cols) + (byte_row * gate_cols + byte_col)[None, :]
        tl.store(saved_ptr + byte_at, packed.to(tl.uint8), mask=byte_inside)
    if HAS_OUT_KEEP:
        keep_at = i * out_keep_row_stride + j * out_keep_col_stride
        acc = acc * tl.load(out_keep_ptr + keep_at, mask=pixel_inside, other=0.0).to(tl.float32)[None, :]
    if HAS_BLEND:
        mixed = tl.load(blend_ptr + at, mask=inside, other=0.0).to(tl.float32)
        if HAS_END:  # the CPU kernel mixes blend with lerp_end like x (blend is S: the blend adds A_in)
            end = tl.load(end_ptr + at, mask=inside, other=0.0).to(tl.float32)
            mixed = mixed + lerp_weight * (end - mixed)
        acc += blend_coef * mixed
    tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=inside)


def correlate(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    row_shift: int,
    **options,
) -> torch.Tensor:
    """One fused correlation pass, as :func:`ea_hf.ops.cpu.binding.correlate`; callers check :func:`applicable` first.
    ``options`` are :class:`~ea_hf.ops.fused_step.CorrelationOptions`' fields (masks are read where they lie,
    broadcast dimensions with stride 0).

    In place, programs still reading ``x`` would race with those writing it, so the result is computed a few
    batch elements at a time into a scratch map (an output element reads only its own batch element of ``x``)
    and copied over them: the result is identical to the out-of-place one, and every launch (autotune's timed
    ones too) writes a map that no launch reads. A launch takes at least a quarter of the batch, and enough
    elements for about IN_PLACE_PIXELS pixels (one element of a short map leaves most of a GPU idle), so the
    scratch is at most the map itself and usually a fraction of it.
    """
    options = CorrelationOptions(**options)
    batch, heads, rows, cols = x.shape
    listed = configs("correlate", x.dtype, heads, x.device)
    x = x.contiguous()
    weight = _float32(weight, x.device)
    bias = _float32(bias, x.device)
    lerp_end = None if options.lerp_end is None else options.lerp_end.contiguous()
    blend = None if options.blend is None else options.blend.contiguous()
    saved = checked_packed_gate(options.saved, x)
    if saved is not None and any(config["BLOCK_K"] % 8 for config in listed):
        raise ValueError(
            "a tile writes whole bytes of the packed gate: BLOCK_K must be a multiple of 8, not "
            f"{[config['BLOCK_K'] for config in listed]}"
        )
    in_keep, *in_strides = _keep_view(options.in_keep, batch, rows, cols)
    out_keep, *out_strides = _keep_view(options.out_keep, batch, rows, cols)
    switches = {
        "KERNEL_ROWS": weight.shape[-2],
        "KERNEL_COLS": weight.shape[-1],
        "HAS_END": lerp_end is not None,
        "HAS_IN_KEEP": in_keep is not None,
        "HAS_BIAS": bias is not None,
        "RELU": bool(options.relu),
        "HAS_SAVED": saved is not None,
        "HAS_OUT_KEEP": out_keep is not None,
        "HAS_BLEND": blend is not None,
        **product_switches(heads, x.dtype),
    }

    def launch(elements: slice, out: torch.Tensor) -> None:
        def part(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor[elements]

        count = len(range(*elements.indices(batch)))
        arguments = (
            part(x), part(lerp_end), float(options.lerp_weight), part(in_keep), *in_strides, weight, bias,
            part(saved), part(out_keep), *out_strides, part(blend), float(options.blend_coef), out, heads, rows,
            cols, packed_gate_shape(x.shape)[-1], row_shift, common.size_bucket(rows), common.size_bucket(cols),
        )  # fmt: skip
        common.launch(jitted, "correlate", listed, _pixel_grid(count, rows, cols), arguments, switches)

    if not options.in_place:
        out = torch.empty_like(x)
        launch(slice(None), out)
        return out
    chunk = min(batch, max(triton.cdiv(batch, 4), triton.cdiv(IN_PLACE_PIXELS, rows * cols)))
    scratch = torch.empty_like(x[:chunk])
    for first in range(0, batch, chunk):
        elements = slice(first, min(first + chunk, batch))
        count = elements.stop - first
        launch(elements, scratch[:count])
        x[elements].copy_(scratch[:count])
    return x


def _pixel_grid(batch: int, rows: int, cols: int):
    """The grid of the correlation kernels under a configuration: one program per batch element and tile."""
    return lambda tiles: (batch, triton.cdiv(rows, tiles["BLOCK_Q"]), triton.cdiv(cols, tiles["BLOCK_K"]))


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
    gate_cols,
    context_rows,
    rows_bucket,
    cols_bucket,
    KERNEL_ROWS: tl.constexpr,
    KERNEL_COLS: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    HAS_SECOND: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_TAPS: tl.constexpr,
    HALF: tl.constexpr,
    TENSOR_CORES: tl.constexpr,
    FP32_PRECISION: tl.constexpr,
):
    """v[b, c, r, s] = keep * sum_{o,dy,dx} w[o,c,dy,dx] * gy[b, o, r-dy+context_rows, s-dx+kw//2]
    + blend_coef * grad[b, c, r, s] with gy = grad * gate; out = out_scale * v, out2 = out2_scale * v.

    As in the forward kernel, one program computes every head of a tile of pixels as one matrix product,
    of the transposed weights ([c, (o, tap)], read at mirrored offsets: the correlation with the flipped,
    transposed kernel, without a copy of it) and the gated gradient's taps."""
    b = tl.program_id(0).to(tl.int64)  # int64 to the batch element, int32 within it (see above)
    element = b * heads * rows * cols
    grad_ptr += element
    gate_ptr += b * heads * rows * gate_cols
    out_ptr += element
    if HAS_SECOND:
        out2_ptr += element
    if HAS_KEEP:
        keep_ptr += b * keep_batch_stride
    i, j = _tile_pixels(BLOCK_Q, BLOCK_K)
    c = tl.arange(0, BLOCK_H)
    plane = rows * cols
    taps_per_head = KERNEL_ROWS * KERNEL_COLS
    reduction = heads * taps_per_head
    acc = tl.full([BLOCK_H, BLOCK_Q * BLOCK_K], 0.0, tl.float32)
    for start in range(0, reduction, BLOCK_TAPS):
        k = start + tl.arange(0, BLOCK_TAPS)  # (output head, tap) pairs
        o = k // taps_per_head
        tap = k % taps_per_head
        r = i[None, :] + (context_rows - tap // KERNEL_COLS)[:, None]
        s = j[None, :] + (KERNEL_COLS // 2 - k % KERNEL_COLS)[:, None]
        inside = (k < reduction)[:, None] & (r >= 0) & (r < rows) & (s >= 0) & (s < cols)
        at = o[:, None] * plane + r * cols + s
        gate_at = o[:, None] * (rows * gate_cols) + r * gate_cols + (s >> 3)
        g = _gated_gradient(grad_ptr, gate_ptr, at, gate_at, s, inside)
        w_inside = (c < heads)[:, None] & (k < reduction)[None, :]
        w_at = (o[None, :] * heads + c[:, None]) * taps_per_head + tap[None, :]
        w = tl.load(w_ptr + w_at, mask=w_inside, other=0.0)
        acc = tile_product(w, g, acc, grad_ptr, HALF, TENSOR_CORES, FP32_PRECISION)
    pixel_inside = (i < rows) & (j < cols)
    inside = (c < heads)[:, None] & pixel_inside[None, :]
    if HAS_KEEP:
        keep_at = i * keep_row_stride + j * keep_col_stride
        acc = acc * tl.load(keep_ptr + keep_at, mask=pixel_inside, other=0.0).to(tl.float32)[None, :]
    at = c[:, None] * plane + (i * cols + j)[None, :]
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
    partial_ptr,
    heads,
    rows,
    cols,
    gate_cols,
    context_rows,
    batch,
    rows_bucket,
    cols_bucket,
    KERNEL_ROWS: tl.constexpr,
    KERNEL_COLS: tl.constexpr,
    HAS_PREVIOUS: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_TAPS: tl.constexpr,
    HALF: tl.constexpr,
    TENSOR_CORES: tl.constexpr,
    FP32_PRECISION: tl.constexpr,
):
    """partial[split, o, k] = the sums over the split's tiles of gy[b, o, i, j] * a_k[b, i, j], where for
    k = (c, dy, dx) < heads * taps a_k is the masked A_in[b, c, i+dy-context_rows, j+dx-kw//2] and for
    k = heads * taps it is 1 (so that column holds the bias gradient).

    Each program takes one block of BLOCK_TAPS columns k (program axis 1) and a run of tiles (axis 0): the
    batch's BLOCK_Q x BLOCK_K tiles are shared out in runs of equal length (the last shorter, some empty where
    the tiles are fewer than the splits) over the splits; per tile, the [heads, pixels] gated gradient times
    the [pixels, BLOCK_TAPS] gathered input taps. Each program writes its [BLOCK_H, BLOCK_TAPS] block of
    partial, zeros for an empty run, so that every entry is written whatever the tiles; the per-split partial
    sums are added up by torch, in a fixed order (deterministic, no atomics)."""
    split = tl.program_id(0)
    row_blocks = (rows + BLOCK_Q - 1) // BLOCK_Q  # (tl.cdiv is a jitted helper: see .common)
    col_blocks = (cols + BLOCK_K - 1) // BLOCK_K
    total_blocks = batch * row_blocks * col_blocks
    blocks_per_split = (total_blocks + tl.num_programs(0) - 1) // tl.num_programs(0)
    o = tl.arange(0, BLOCK_H)
    k = tl.program_id(1) * BLOCK_TAPS + tl.arange(0, BLOCK_TAPS)
    taps_per_head = KERNEL_ROWS * KERNEL_COLS
    reduction = heads * taps_per_head
    c = k // taps_per_head
    dy = (k % taps_per_head) // KERNEL_COLS
    dx = k % KERNEL_COLS
    pixel = tl.arange(0, BLOCK_Q * BLOCK_K)
    plane = rows * cols
    acc = tl.full([BLOCK_H, BLOCK_TAPS], 0.0, tl.float32)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, total_blocks)
    tiles = row_blocks * col_blocks
    for block in range(first, last):
        b = (block // tiles).to(tl.int64)  # int64 to the batch element, int32 within it (see above)
        element = b * heads * plane
        keep_base = b * keep_batch_stride
        i = ((block % tiles) // col_blocks) * BLOCK_Q + pixel // BLOCK_K
        j = (block % col_blocks) * BLOCK_K + pixel % BLOCK_K
        pixel_inside = (i < rows) & (j < cols)
        grad_inside = (o < heads)[:, None] & pixel_inside[None, :]
        grad_at = o[:, None] * plane + (i * cols + j)[None, :]
        gate_at = o[:, None] * (rows * gate_cols) + (i * gate_cols + (j >> 3))[None, :]
        gate_element = b * heads * rows * gate_cols
        g = _gated_gradient(grad_ptr + element, gate_ptr + gate_element, grad_at, gate_at, j[None, :], grad_inside)
        r = i[:, None] + (dy - context_rows)[None, :]
        s = j[:, None] + (dx - KERNEL_COLS // 2)[None, :]
        inside = pixel_inside[:, None] & (k < reduction)[None, :] & (r >= 0) & (r < rows) & (s >= 0) & (s < cols)
        at = c[None, :] * plane + r * cols + s
        a = _input_taps(
            scores_ptr, previous_ptr, alpha, element, at,
            keep_ptr, keep_base, r, s, keep_row_stride, keep_col_stride, inside, HAS_PREVIOUS, HAS_KEEP,
        )  # fmt: skip
        a = tl.where(pixel_inside[:, None] & (k == reduction)[None, :], 1.0, a)  # the bias column
        acc = tile_product(g, a, acc, grad_ptr, HALF, TENSOR_CORES, FP32_PRECISION)
    columns = reduction + 1
    at = (split * BLOCK_H + o)[:, None] * columns + k[None, :]
    tl.store(partial_ptr + at, acc, mask=(k < columns)[None, :])


def backward_pass(
    step: EvolutionStep, maps: StepMaps, grad: GradientIn, gate: Tensor, weight: Tensor
) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """The evolution step's backward on the kernels (the body of :func:`backward` and of its operator).
    (A spent ``grad.grad`` is not written over: the gradients get new maps; ``grad.addend`` is added to it first,
    over it where it is spent. Every row is differentiated whole: ``step.skip_masked_tails``, which the CPU kernel
    takes, is not implemented here.)

    Returns the gradients of S, of A_prev (``None`` without it), and of the beta-scaled kernel's weight and bias
    (float32), for A_logit = ReLU(Conv(A_in * keep)) + (1 - beta) * A_in with A_in = lerp(S, A_prev, alpha), the
    ReLU gate ``gate`` (packed as :func:`correlate` writes it; a bool map is packed first), the beta-scaled
    ``weight`` and the incoming gradient. Output row i of the forward step read input rows
    ``i - context_rows .. i - context_rows + kh - 1``.
    """
    alpha, context_rows = step.alpha, step.context_rows
    scores, previous, keep = maps
    batch, heads, rows, cols = scores.shape
    kernel_rows, kernel_cols = weight.shape[-2:]
    device = scores.device
    weight = _float32(weight, device)
    incoming = plus_addend(grad.grad, grad.addend, owned=grad.spent)
    scores, incoming = scores.contiguous(), incoming.contiguous()
    gate = checked_packed_gate(pack_gate(gate).contiguous(), scores)
    gate_cols = gate.shape[-1]
    previous = None if previous is None else previous.contiguous()
    keep, *keep_strides = _keep_view(keep, batch, rows, cols)
    grad_scores = torch.empty_like(scores)
    grad_previous = None if previous is None else torch.empty_like(scores)
    switches = {"KERNEL_ROWS": kernel_rows, "KERNEL_COLS": kernel_cols, **product_switches(heads, scores.dtype)}
    buckets = (common.size_bucket(rows), common.size_bucket(cols))
    arguments = (
        incoming, gate, weight, keep, *keep_strides, grad_scores, grad_previous,
        1.0 if previous is None else 1.0 - float(alpha), float(alpha), 1.0 - float(step.beta), heads, rows, cols,
        gate_cols, context_rows, *buckets,
    )  # fmt: skip
    common.launch(
        jitted, "input_grad", configs("input_grad", scores.dtype, heads, device), _pixel_grid(batch, rows, cols),
        arguments, switches | {"HAS_KEEP": keep is not None, "HAS_SECOND": grad_previous is not None},
    )  # fmt: skip
    # The weight gradient's columns are (input head, tap) pairs plus one for the bias, in blocks of BLOCK_TAPS
    # (program axis 1); the tiles of all batch elements are shared out in WEIGHT_GRAD_SPLITS runs (axis 0). Each
    # program writes its [BLOCK_H, BLOCK_TAPS] partial sums, which torch adds up in a fixed order (deterministic,
    # no atomics). The partial sums' shape is the configurations' common one, so that any of them fills it whole.
    columns = heads * kernel_rows * kernel_cols + 1
    splits = max(1, min(WEIGHT_GRAD_SPLITS, batch * rows * cols // WEIGHT_GRAD_SPLIT_PIXELS))
    partial = torch.empty(splits, switches["BLOCK_H"], columns, device=device)
    arguments = (
        scores, previous, float(alpha), keep, *keep_strides, incoming, gate, partial, heads, rows, cols, gate_cols,
        context_rows, batch, *buckets,
    )  # fmt: skip
    common.launch(
        jitted, "weight_grad", configs("weight_grad", scores.dtype, heads, device),
        lambda tiles: (splits, triton.cdiv(columns, tiles["BLOCK_TAPS"])), arguments,
        switches | {"HAS_PREVIOUS": previous is not None, "HAS_KEEP": keep is not None},
    )  # fmt: skip
    sums = partial.sum(0)[:heads]
    # Copies, not views of one tensor: an operator's outputs may not alias each other (see operators.py).
    grad_weight = sums[:, : columns - 1].reshape(heads, heads, kernel_rows, kernel_cols).contiguous()
    return grad_scores, grad_previous, grad_weight, sums[:, columns - 1].contiguous()


def tile_bucket(heads: int) -> int:
    """The heads padded to a power of two of at least 16, as the products pad them (BLOCK_H, tl.dot's smallest
    side): the tuned-tile table's bucket, so that configurations tuned on 12 heads serve 16.

    Example:
        >>> tile_bucket(12), tile_bucket(16), tile_bucket(40)
        (16, 16, 64)
    """
    return common.padded_side(heads)


def product_switches(heads: int, dtype: torch.dtype) -> dict[str, object]:
    """A launch's constexpr arguments besides its configuration: the heads padded (:func:`tile_bucket`), and how
    the maps are multiplied (:func:`~.common.product_switches`)."""
    return {"BLOCK_H": tile_bucket(heads), **common.product_switches(dtype)}


#: The kernels above, jitted with their device functions for the current ``TRITON_INTERPRET`` setting on first use.
#: Autotune's key for each (with the maps' dtype): the padded heads, the kernel's size and the map's buckets.
jitted = JittedPerSetting(
    {"correlate": _correlate_kernel, "input_grad": _input_grad_kernel, "weight_grad": _weight_grad_kernel},
    helpers=(_tile_pixels, _input_taps, _gated_gradient, tile_product),
    tuning_keys=dict.fromkeys(
        ("correlate", "input_grad", "weight_grad"),
        ("BLOCK_H", "KERNEL_ROWS", "KERNEL_COLS", "rows_bucket", "cols_bucket"),
    ),
)


def evolve(
    step: EvolutionStep, maps: StepMaps, weight: Tensor, bias: Tensor, *, in_place: bool, gate: bool | None = None
) -> tuple[Tensor, Tensor | None]:
    """The evolution step's forward pass (see the ``FusedKernel`` protocol) in one launch; while
    torch.compile traces, the operator ``ea_hf::triton_evolve_with_gate_bits`` (:mod:`.operators`;
    never in place: a compiled graph plans its own buffers). Every row is correlated whole
    (``step.skip_masked_tails``, which the CPU kernel takes, is not implemented here)."""
    if torch.compiler.is_compiling():
        logits, saved = torch.ops.ea_hf.triton_evolve_with_gate_bits(*maps, weight, bias, *schema_arguments(step))
        return logits, saved if (not in_place if gate is None else gate) else None
    return evolve_by_correlation(correlate, step, maps, weight, bias, in_place=in_place, gate=gate)


def convolve(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, row_shift: int) -> torch.Tensor:
    """A plain correlation plus bias (the kept rows of a decoding step), as :func:`correlate` computes it (while
    torch.compile traces, through the operator ``ea_hf::triton_convolve``)."""
    if torch.compiler.is_compiling():
        return torch.ops.ea_hf.triton_convolve(x, weight, bias, row_shift)
    return correlate(x, weight, bias, row_shift=row_shift)


def backward(
    step: EvolutionStep, maps: StepMaps, grad: GradientIn, gate: Tensor, weight: Tensor, *, shared_map: bool = False
) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """The evolution step's backward, as :func:`ea_hf.ops.cpu.evolution.backward`; callers check :func:`applicable`. The
    kernels write S's and A_prev's gradients as two maps (``shared_map`` is not used: callers take S's as a
    ScaledMap of scale 1). While torch.compile traces, the operator ``ea_hf::triton_evolve_backward``.

    Returns the gradients of S, of A_prev (``None`` without it), and of the beta-scaled kernel's weight and bias
    (float32)."""
    if not torch.compiler.is_compiling():
        return backward_pass(step, maps, grad, gate, weight)
    incoming = grad.grad if grad.addend is None else grad.grad + grad.addend
    return backward_through_operator(step, maps, incoming, gate, weight)


def backward_through_operator(
    step: EvolutionStep, maps: StepMaps, grad: Tensor, gate: Tensor, weight: Tensor
) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """:func:`backward_pass` through the operator ``ea_hf::triton_evolve_backward`` (what compiled graphs call),
    whose schema returns an empty tensor where A_prev has no gradient: ``None`` here."""
    grad_scores, grad_previous, grad_weight, grad_bias = torch.ops.ea_hf.triton_evolve_backward(
        *maps, grad, gate, weight, *schema_arguments(step)
    )
    return grad_scores, None if maps.previous is None else grad_previous, grad_weight, grad_bias


def select_kept(
    x: torch.Tensor, keep: torch.Tensor, scale: float, fill: float, out: torch.Tensor | None
) -> torch.Tensor | None:
    """None: on GPUs the attention core's masked passes (``keep ? scale * x : fill``) are single fused kernels of
    torch already (``torch.where``, ``native_dropout_backward``), so nothing is taken here."""
    return None

"""Triton kernels of the attention tail after the evolution: the masked softmax over the evolved logits and the
product with the values, flash-style, without writing P.

The evolution writes A_logit anyway (the next layer reads it as A_prev). What eager attention does with it next
writes and reads P in full precision, P in the values' dtype, dropout(P), and in backward P again (recomputed),
dO @ V^T and the softmax's gradient: several map passes a layer. Here:

- :func:`forward`: one program per (batch element, head, block of query rows) reads its rows of A_logit block by
  block, masks them as eager attention does (a bool mask fills with float32's minimum, an additive one is added,
  in float32), keeps a running maximum and sum (online softmax) and accumulates the unnormalised weights times V;
  it writes the output and each row's maximum and sum, not P. With dropout, a bool map of the kept weights (drawn
  by torch's generator, ``bernoulli_``) scales them before the product.
- :func:`backward`: one program per (batch element, head, block of key columns) recomputes P's tiles from
  A_logit and the rows' maximum and sum (not their log-sum-exp: a fully masked row's is float32's minimum plus
  log K, which rounds to the minimum, and P would come out 1 instead of 1/K), accumulates dV = dropout(P)^T dO,
  forms dP = dO V^T tile by tile and writes the softmax's gradient P * (dP - delta) as A_logit's gradient (zero
  where a bool mask filled), in one pass. Each row's delta = sum_j dropout(P)_ij dP_ij equals rowsum(dO * O),
  which is what flash attention computes it from; but O rounded to half precision makes A_logit's gradient miss
  the tests' accuracy rule, and keeping O for it would keep [B, H, Q, D] more a layer (docs/performance.md,
  "Choices in the fused kernels"). So a first pass sums it from the tiles of P and dP (one more read of A_logit,
  no map written), and nothing but the rows' maximum and sum is kept from the forward pass. An addend, where
  given (the next layer's gradient of this layer's A_logit, through its A_prev), is read as each tile of
  A_logit's gradient is written: one read of it, where adding it after the kernel would be a map pass of its own.
  Per-head partial dV are summed by torch over the query heads of a key/value head (grouped-query attention):
  deterministic, no atomics.

Products run as the evolution kernels' do (:func:`~.common.tile_product`): half-precision values on tensor cores
in their dtype, float32 in TF32 where cuDNN may use it, else as three TF32 products; float32 accumulators, and
float32 for the softmax's sums everywhere.

It runs where the evolution kernels do (:func:`.common.enabled`; on CPU tensors under ``TRITON_INTERPRET=1``, for
tests), and only where nobody reads the attention weights (the attention core asks): P is never formed. The
kernels stand beside their launchers, jitted on first use (:data:`jitted`), and launched over a few configurations
of tiles, warps and stages (:data:`CONFIGS`), which autotune searches on a GPU (see :mod:`.common`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import common
from .common import JittedPerSetting, tile_product, tl, triton

#: The largest head dimension taken (a tile holds a [BLOCK_N, head_dim] block of V and of dV).
MAX_HEAD_DIM = 256


def _config(queries: int, keys: int, warps: int, stages: int = 3) -> dict[str, int]:
    return {"BLOCK_M": queries, "BLOCK_N": keys, "num_warps": warps, "num_stages": stages}


#: The configurations each kernel's launches search on a GPU (:func:`configs`; see :mod:`.common`), by the maps'
#: dtype: BLOCK_M query rows and BLOCK_N key columns a tile (powers of two, at least 16: sides of tl.dot), warps
#: and pipeline stages. The first of each is what runs in the interpreter and under torch's deterministic
#: algorithms: 64 x 64 tiles on 4 warps, flash attention's usual start. The forward and row-term kernels loop over
#: key blocks for a block of query rows; the backward kernel over query blocks for a block of key columns.
#: ``tests/ops/triton/test_compilation.py`` compiles every one for sm_90 at BERT's head size.
CONFIGS: dict[str, dict[str, tuple[dict, ...]]] = {
    "float32": {
        "forward": (_config(64, 64, 4), _config(128, 64, 8), _config(64, 32, 4)),
        "row_terms": (_config(64, 64, 4), _config(128, 64, 8), _config(64, 32, 4)),
        "backward": (_config(64, 64, 4), _config(32, 64, 4), _config(64, 32, 4)),
    },
    "half": {
        "forward": (_config(64, 64, 4), _config(128, 64, 8), _config(64, 128, 8, 2)),
        "row_terms": (_config(64, 64, 4), _config(128, 64, 8), _config(64, 128, 8, 2)),
        "backward": (_config(64, 64, 4), _config(32, 64, 4), _config(64, 128, 8, 2)),
    },
}  # fmt: skip


def applicable(logits: Tensor, allowed: Tensor | None, additive: Tensor | None, value: Tensor) -> bool:
    """Whether these kernels take this tail: where the kernels may run on the logits' device and dtype (as the
    evolution kernels, :func:`.common.enabled`),
    [B, H, Q, K] logits and [B, H_kv, K, D] values (H a multiple of H_kv, D at most MAX_HEAD_DIM) of the kernels'
    dtypes on one device, masks that broadcast to the logits, and fewer than 2**31 entries in a batch element's
    map."""
    dtypes = common.DTYPES
    if logits.dim() != 4 or value.dim() != 4 or logits.dtype not in dtypes or value.dtype not in dtypes:
        return False
    if not common.enabled(logits.device, logits.dtype):
        return False
    batch, heads, rows, cols = logits.shape
    if value.shape[0] != batch or value.shape[2] != cols or value.shape[1] == 0 or heads % value.shape[1]:
        return False
    if value.shape[3] > MAX_HEAD_DIM or logits[0].numel() >= 2**31:
        return False
    for mask in (allowed, additive):
        if mask is None:
            continue
        if mask.device != logits.device or mask.dim() > 4 or mask.is_complex():
            return False
        try:
            torch.broadcast_shapes(mask.shape, logits.shape)
        except RuntimeError:
            return False
    return value.device == logits.device


def _mask_view(mask: Tensor | None, shape: torch.Size) -> tuple[Tensor | None, tuple[int, int, int, int]]:
    """``mask`` broadcast to ``shape`` as a view and its four strides (0 where broadcast)."""
    if mask is None:
        return None, (0, 0, 0, 0)
    view = mask.expand(shape)
    return view, tuple(view.stride())


def _pointers(logits: Tensor, *optional: Tensor | None) -> list[Tensor]:
    """The optional maps, with ``logits`` standing in for each absent one: the kernels' helper that moves the
    pointers to a program's map returns them all, and Triton 3.6 refuses a jitted function that returns a
    ``None`` pointer. The kernels never read a stand-in (its ``HAS_*`` switch is off)."""
    return [logits if tensor is None else tensor for tensor in optional]


def head_bucket(head_dim: int) -> int:
    """The head dimension padded to a power of two of at least 16 (BLOCK_D, a side of tl.dot): the tuned-tile
    table's bucket.

    Example:
        >>> head_bucket(64), head_bucket(80), head_bucket(8)
        (64, 128, 16)
    """
    return common.padded_side(head_dim)


def configs(kernel: str, dtype: torch.dtype, head_dim: int, device: torch.device) -> list[dict]:
    """The configurations a launch of ``kernel`` (``forward``, ``row_terms`` or ``backward``) on values of
    ``head_dim`` and ``dtype`` on ``device`` may use: :data:`CONFIGS` of the dtype, narrowed by the tuned-tile
    table (:func:`~.common.launch_configs`, bucket :func:`head_bucket`). Read at call time.

    Example:
        >>> configs("forward", torch.bfloat16, 64, torch.device("cpu"))[0]
        {'BLOCK_M': 64, 'BLOCK_N': 64, 'num_warps': 4, 'num_stages': 3}
    """
    listed = CONFIGS["float32" if dtype == torch.float32 else "half"][kernel]
    return common.launch_configs("attention_tail", kernel, listed, device, dtype, head_bucket(head_dim))


def launch_switches(head_dim: int, dtype: torch.dtype) -> dict[str, object]:
    """A launch's constexpr arguments besides its configuration: the head dimension padded
    (:func:`head_bucket`), and how the maps are multiplied (:func:`~.common.product_switches`)."""
    return {"BLOCK_D": head_bucket(head_dim), **common.product_switches(dtype)}


# Device functions the kernels call by name, jitted with them (see :mod:`.common`).


def _masked_logits(
    logits_ptr, allowed_ptr, a_q, a_k, additive_ptr, d_q, d_k, i, j, rows, cols, fill,
    HAS_ALLOWED: tl.constexpr, HAS_ADDITIVE: tl.constexpr,
):  # fmt: skip
    """The [len(i), len(j)] tile of the masked logits in float32 (as eager attention masks them: a bool mask
    fills with ``fill``, an additive one is added) and where it lies inside the map; -inf outside it, so
    that the softmax gives it no weight. The pointers are at the program's map already."""
    inside = (i < rows)[:, None] & (j < cols)[None, :]
    x = tl.load(logits_ptr + i[:, None] * cols + j[None, :], mask=inside, other=0.0).to(tl.float32)
    if HAS_ALLOWED:
        allowed = tl.load(allowed_ptr + i[:, None] * a_q + j[None, :] * a_k, mask=inside, other=0).to(tl.int1)
        x = tl.where(allowed, x, fill)
    if HAS_ADDITIVE:
        x = x + tl.load(additive_ptr + i[:, None] * d_q + j[None, :] * d_k, mask=inside, other=0.0).to(tl.float32)
    return tl.where(inside, x, float("-inf")), inside


def _probabilities(
    logits_ptr, allowed_ptr, a_q, a_k, additive_ptr, d_q, d_k, i, j, rows, cols, fill, row_max, row_sum,
    HAS_ALLOWED: tl.constexpr, HAS_ADDITIVE: tl.constexpr,
):  # fmt: skip
    """P's [len(i), len(j)] tile recomputed from the masked logits and the rows' maximum and sum that the
    forward kernel wrote (0 outside the map, where the logits are -inf), and where the tile lies inside it."""
    x, inside = _masked_logits(
        logits_ptr, allowed_ptr, a_q, a_k, additive_ptr, d_q, d_k, i, j, rows, cols, fill, HAS_ALLOWED,
        HAS_ADDITIVE,
    )  # fmt: skip
    return tl.exp(x - row_max[:, None]) / row_sum[:, None], inside


def _kept_weights(keep_ptr, i, j, cols, inside):
    """Dropout's bool map at the tile's rows ``i`` and columns ``j``: where the weights are kept."""
    return tl.load(keep_ptr + i[:, None] * cols + j[None, :], mask=inside, other=0).to(tl.int1)


def _map_pointers(
    bh, heads, group, rows, cols, head_dim, logits_ptr, allowed_ptr, a_b, a_h, additive_ptr, d_b, d_h, keep_ptr,
    v_ptr, HAS_ALLOWED: tl.constexpr, HAS_ADDITIVE: tl.constexpr, HAS_DROPOUT: tl.constexpr,
):  # fmt: skip
    """The pointers moved to the program's (batch element, head) map, in int64 (B * H * Q * K overflows
    int32 for long sequences; offsets within a map are int32, see applicable()); V at its key/value head."""
    b, h = (bh // heads).to(tl.int64), (bh % heads).to(tl.int64)
    element = bh.to(tl.int64) * rows * cols
    logits_ptr += element
    if HAS_ALLOWED:
        allowed_ptr += b * a_b + h * a_h
    if HAS_ADDITIVE:
        additive_ptr += b * d_b + h * d_h
    if HAS_DROPOUT:
        keep_ptr += element
    v_ptr += (b * (heads // group) + h // group) * cols * head_dim
    return logits_ptr, allowed_ptr, additive_ptr, keep_ptr, v_ptr


def _forward_kernel(
    logits_ptr, allowed_ptr, a_b, a_h, a_q, a_k, additive_ptr, d_b, d_h, d_q, d_k, keep_ptr, dropout_scale,
    v_ptr, out_ptr, stats_ptr, heads, group, rows, cols, head_dim, fill, rows_bucket, cols_bucket,
    HAS_ALLOWED: tl.constexpr, HAS_ADDITIVE: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HALF: tl.constexpr, TENSOR_CORES: tl.constexpr, FP32_PRECISION: tl.constexpr,
):  # fmt: skip
    """out[b, h, i] = sum_j softmax_j(masked logits[b, h, i]) * keep * scale * v[b, h // group, j], and the
    row's maximum and sum of exp(logit - maximum) in stats[0, b, h, i] and stats[1, b, h, i], by an online
    softmax over blocks of BLOCK_N keys."""
    bh = tl.program_id(0)
    logits_ptr, allowed_ptr, additive_ptr, keep_ptr, v_ptr = _map_pointers(
        bh, heads, group, rows, cols, head_dim, logits_ptr, allowed_ptr, a_b, a_h, additive_ptr, d_b, d_h,
        keep_ptr, v_ptr, HAS_ALLOWED, HAS_ADDITIVE, HAS_DROPOUT,
    )  # fmt: skip
    i = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    for start in range(0, cols, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        x, inside = _masked_logits(
            logits_ptr, allowed_ptr, a_q, a_k, additive_ptr, d_q, d_k, i, j, rows, cols, fill, HAS_ALLOWED,
            HAS_ADDITIVE,
        )  # fmt: skip
        # Rows past the map are all -inf: their maximum is taken as 0 so that no NaN arises (never stored).
        block_max = tl.reduce(x, 1, tl.standard._elementwise_max)
        new_max = tl.maximum(running_max, tl.where(i < rows, block_max, 0.0))
        rescale = tl.exp(running_max - new_max)
        p = tl.exp(x - new_max[:, None])
        running_sum = running_sum * rescale + tl.reduce(p, 1, tl.standard._sum_combine)
        if HAS_DROPOUT:
            p = tl.where(_kept_weights(keep_ptr, i, j, cols, inside), p * dropout_scale, 0.0)
        v_inside = (j < cols)[:, None] & (d < head_dim)[None, :]
        v = tl.load(v_ptr + j[:, None] * head_dim + d[None, :], mask=v_inside, other=0.0)
        acc = tile_product(p, v, acc * rescale[:, None], v_ptr, HALF, TENSOR_CORES, FP32_PRECISION)
        running_max = new_max
    row_inside = i < rows
    out_at = (bh.to(tl.int64) * rows + i[:, None]) * head_dim + d[None, :]
    out = acc / tl.where(row_inside, running_sum, 1.0)[:, None]
    tl.store(out_ptr + out_at, out.to(out_ptr.dtype.element_ty), mask=row_inside[:, None] & (d < head_dim)[None, :])
    stats_at = bh.to(tl.int64) * rows + i
    tl.store(stats_ptr + stats_at, running_max, mask=row_inside)
    tl.store(stats_ptr + tl.num_programs(0).to(tl.int64) * rows + stats_at, running_sum, mask=row_inside)


def forward(
    logits: Tensor,
    allowed: Tensor | None,
    additive: Tensor | None,
    value: Tensor,
    dropout_keep: Tensor | None = None,
    dropout_scale: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """(softmax(mask(logits)) with dropout @ value [B, H, Q, D] in the values' dtype, the rows' statistics
    [2, B, H, Q] in float32: each row's maximum and its sum of exp(logit - maximum)); callers check
    :func:`applicable` first. ``dropout_keep``: bool [B, H, Q, K], the kept
    weights, which are scaled by ``dropout_scale``. While torch.compile traces, the operator
    ``ea_hf::triton_attention_tail`` (:mod:`.operators`)."""
    if torch.compiler.is_compiling():  # (the operator's body, run outside tracing, comes back here)
        return torch.ops.ea_hf.triton_attention_tail(logits, allowed, additive, value, dropout_keep, dropout_scale)
    batch, heads, rows, cols = logits.shape
    head_dim = value.shape[-1]
    logits, value = logits.contiguous(), value.contiguous()
    allowed, allowed_strides = _mask_view(allowed, logits.shape)
    additive, additive_strides = _mask_view(additive, logits.shape)
    keep = None if dropout_keep is None else dropout_keep.contiguous()
    output = torch.empty(batch, heads, rows, head_dim, dtype=value.dtype, device=value.device)
    stats = torch.empty(2, batch, heads, rows, dtype=torch.float32, device=value.device)
    allowed_ptr, additive_ptr, keep_ptr = _pointers(logits, allowed, additive, keep)
    arguments = (
        logits, allowed_ptr, *allowed_strides, additive_ptr, *additive_strides, keep_ptr, float(dropout_scale), value,
        output, stats, heads, heads // value.shape[1], rows, cols, head_dim, torch.finfo(torch.float32).min,
        common.size_bucket(rows), common.size_bucket(cols),
    )  # fmt: skip
    switches = {"HAS_ALLOWED": allowed is not None, "HAS_ADDITIVE": additive is not None,
                "HAS_DROPOUT": keep is not None, **launch_switches(head_dim, value.dtype)}  # fmt: skip
    common.launch(
        jitted, "forward", configs("forward", value.dtype, head_dim, value.device),
        lambda tiles: (batch * heads, triton.cdiv(rows, tiles["BLOCK_M"])), arguments, switches,
    )  # fmt: skip
    return output, stats


def _row_terms_kernel(
    logits_ptr, allowed_ptr, a_b, a_h, a_q, a_k, additive_ptr, d_b, d_h, d_q, d_k, keep_ptr, dropout_scale,
    v_ptr, grad_out_ptr, stats_ptr, delta_ptr, heads, group, rows, cols, head_dim, fill, rows_bucket, cols_bucket,
    HAS_ALLOWED: tl.constexpr, HAS_ADDITIVE: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HALF: tl.constexpr, TENSOR_CORES: tl.constexpr, FP32_PRECISION: tl.constexpr,
):  # fmt: skip
    """delta[b, h, i] = sum_j dropout(P)[i, j] * (dO[i] . V[j]) for the program's block of query rows, P
    recomputed as in the backward kernel."""
    bh = tl.program_id(0)
    logits_ptr, allowed_ptr, additive_ptr, keep_ptr, v_ptr = _map_pointers(
        bh, heads, group, rows, cols, head_dim, logits_ptr, allowed_ptr, a_b, a_h, additive_ptr, d_b, d_h,
        keep_ptr, v_ptr, HAS_ALLOWED, HAS_ADDITIVE, HAS_DROPOUT,
    )  # fmt: skip
    i = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    row_inside = i < rows
    rows_at = bh.to(tl.int64) * rows + i
    row_max = tl.load(stats_ptr + rows_at, mask=row_inside, other=0.0)
    row_sum = tl.load(stats_ptr + tl.num_programs(0).to(tl.int64) * rows + rows_at, mask=row_inside, other=1.0)
    do_at = (bh.to(tl.int64) * rows + i[:, None]) * head_dim + d[None, :]
    do = tl.load(grad_out_ptr + do_at, mask=row_inside[:, None] & (d < head_dim)[None, :], other=0.0)
    delta = tl.full([BLOCK_M], 0.0, tl.float32)
    for start in range(0, cols, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        p, inside = _probabilities(
            logits_ptr, allowed_ptr, a_q, a_k, additive_ptr, d_q, d_k, i, j, rows, cols, fill, row_max, row_sum,
            HAS_ALLOWED, HAS_ADDITIVE,
        )  # fmt: skip
        if HAS_DROPOUT:
            p = tl.where(_kept_weights(keep_ptr, i, j, cols, inside), p * dropout_scale, 0.0)
        v = tl.load(v_ptr + j[:, None] * head_dim + d[None, :], mask=(j < cols)[:, None] & (d < head_dim)[None, :],
                    other=0.0)  # fmt: skip
        dp = tile_product(do, tl.trans(v), tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32), v_ptr, HALF,
                           TENSOR_CORES, FP32_PRECISION)  # fmt: skip
        delta += tl.reduce(p * dp, 1, tl.standard._sum_combine)
    tl.store(delta_ptr + rows_at, delta, mask=row_inside)


def _backward_kernel(
    logits_ptr, allowed_ptr, a_b, a_h, a_q, a_k, additive_ptr, d_b, d_h, d_q, d_k, keep_ptr, dropout_scale,
    v_ptr, grad_out_ptr, stats_ptr, delta_ptr, addend_ptr, grad_logits_ptr, grad_v_ptr, heads, group, rows, cols,
    head_dim, fill, rows_bucket, cols_bucket,
    HAS_ALLOWED: tl.constexpr, HAS_ADDITIVE: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_ADDEND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HALF: tl.constexpr, TENSOR_CORES: tl.constexpr, FP32_PRECISION: tl.constexpr,
):  # fmt: skip
    """For the program's block of key columns j: grad_logits[b, h, :, j] = P * (dP - delta) (zero where a
    bool mask filled) plus addend[b, h, :, j] (with HAS_ADDEND), dP = dropout'(dO @ V_j^T), and grad_v[b, h, j] =
    dropout(P)^T @ dO, P recomputed as exp(masked logits - row maximum) / row sum."""
    bh = tl.program_id(0)
    logits_ptr, allowed_ptr, additive_ptr, keep_ptr, v_ptr = _map_pointers(
        bh, heads, group, rows, cols, head_dim, logits_ptr, allowed_ptr, a_b, a_h, additive_ptr, d_b, d_h,
        keep_ptr, v_ptr, HAS_ALLOWED, HAS_ADDITIVE, HAS_DROPOUT,
    )  # fmt: skip
    grad_logits_ptr += bh.to(tl.int64) * rows * cols
    if HAS_ADDEND:
        addend_ptr += bh.to(tl.int64) * rows * cols
    grad_out_ptr += bh.to(tl.int64) * rows * head_dim
    sum_ptr = stats_ptr + (tl.num_programs(0) + bh).to(tl.int64) * rows
    stats_ptr += bh.to(tl.int64) * rows
    delta_ptr += bh.to(tl.int64) * rows
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    v_inside = (j < cols)[:, None] & (d < head_dim)[None, :]
    v = tl.load(v_ptr + j[:, None] * head_dim + d[None, :], mask=v_inside, other=0.0)
    grad_v = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
    for start in range(0, rows, BLOCK_M):
        i = start + tl.arange(0, BLOCK_M)
        row_max = tl.load(stats_ptr + i, mask=i < rows, other=0.0)
        row_sum = tl.load(sum_ptr + i, mask=i < rows, other=1.0)
        p, inside = _probabilities(
            logits_ptr, allowed_ptr, a_q, a_k, additive_ptr, d_q, d_k, i, j, rows, cols, fill, row_max, row_sum,
            HAS_ALLOWED, HAS_ADDITIVE,
        )  # fmt: skip
        do_inside = (i < rows)[:, None] & (d < head_dim)[None, :]
        do = tl.load(grad_out_ptr + i[:, None] * head_dim + d[None, :], mask=do_inside, other=0.0)
        dp = tile_product(do, tl.trans(v), tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32), v_ptr, HALF,
                           TENSOR_CORES, FP32_PRECISION)  # fmt: skip
        dropped = p
        if HAS_DROPOUT:
            kept = _kept_weights(keep_ptr, i, j, cols, inside)
            dropped = tl.where(kept, p * dropout_scale, 0.0)
            dp = tl.where(kept, dp * dropout_scale, 0.0)
        grad_v = tile_product(tl.trans(dropped), do, grad_v, v_ptr, HALF, TENSOR_CORES, FP32_PRECISION)
        delta = tl.load(delta_ptr + i, mask=i < rows, other=0.0)
        grad_x = p * (dp - delta[:, None])
        if HAS_ALLOWED:  # masked_fill passes no gradient to the filled entries
            allowed = tl.load(allowed_ptr + i[:, None] * a_q + j[None, :] * a_k, mask=inside, other=0)
            grad_x = tl.where(allowed.to(tl.int1), grad_x, 0.0)
        at = i[:, None] * cols + j[None, :]
        if HAS_ADDEND:  # after the mask: the next layer's gradient reaches the filled entries too
            grad_x += tl.load(addend_ptr + at, mask=inside, other=0.0).to(tl.float32)
        tl.store(grad_logits_ptr + at, grad_x.to(grad_logits_ptr.dtype.element_ty), mask=inside)
    grad_v_at = (bh.to(tl.int64) * cols + j[:, None]) * head_dim + d[None, :]
    tl.store(grad_v_ptr + grad_v_at, grad_v, mask=v_inside)


def backward(
    logits: Tensor,
    allowed: Tensor | None,
    additive: Tensor | None,
    value: Tensor,
    dropout_keep: Tensor | None,
    dropout_scale: float,
    stats: Tensor,
    grad_output: Tensor,
    grad_dtype: torch.dtype,
    addend: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(the gradient of ``logits`` in ``grad_dtype``, plus ``addend`` where given (a [B, H, Q, K] map, added in
    float32 as the kernel writes the gradient: A_logit's other gradient, through the next layer's A_prev), the
    gradient of ``value``) of :func:`forward`, from its ``stats`` and the output's gradient; while torch.compile
    traces, through the operator ``ea_hf::triton_attention_tail_backward`` (which gives the logits' gradient in
    their dtype)."""
    if torch.compiler.is_compiling():
        grad_logits, grad_value = torch.ops.ea_hf.triton_attention_tail_backward(
            logits, allowed, additive, value, dropout_keep, dropout_scale, stats, grad_output, addend
        )
        return grad_logits.to(grad_dtype), grad_value
    batch, heads, rows, cols = logits.shape
    value_heads, head_dim = value.shape[1], value.shape[-1]
    logits, value, grad_output = logits.contiguous(), value.contiguous(), grad_output.contiguous()
    allowed, allowed_strides = _mask_view(allowed, logits.shape)
    additive, additive_strides = _mask_view(additive, logits.shape)
    keep = None if dropout_keep is None else dropout_keep.contiguous()
    allowed_ptr, additive_ptr, keep_ptr = _pointers(logits, allowed, additive, keep)
    arguments = (logits, allowed_ptr, *allowed_strides, additive_ptr, *additive_strides, keep_ptr,
                 float(dropout_scale), value, grad_output, stats)  # fmt: skip
    sizes = (heads, heads // value_heads, rows, cols, head_dim, torch.finfo(torch.float32).min,
             common.size_bucket(rows), common.size_bucket(cols))  # fmt: skip
    switches = {
        "HAS_ALLOWED": allowed is not None,
        "HAS_ADDITIVE": additive is not None,
        "HAS_DROPOUT": keep is not None,
        **launch_switches(head_dim, value.dtype),
    }
    # The softmax gradient's row terms (see the module docstring), summed from the tiles of P and dP.
    delta = torch.empty(batch, heads, rows, dtype=torch.float32, device=logits.device)
    common.launch(
        jitted, "row_terms", configs("row_terms", value.dtype, head_dim, value.device),
        lambda tiles: (batch * heads, triton.cdiv(rows, tiles["BLOCK_M"])), (*arguments, delta, *sizes), switches,
    )  # fmt: skip
    # The addend is only read and the logits' gradient is a new map written whole (not written over the addend):
    # autotune's repeated launches then all see the same inputs and need no restore_value.
    if addend is not None and addend.shape != logits.shape:
        raise ValueError(f"the addend's shape {tuple(addend.shape)} is not the logits' {tuple(logits.shape)}")
    addend = None if addend is None else addend.contiguous()
    grad_logits = torch.empty(logits.shape, dtype=grad_dtype, device=logits.device)
    # dV per query head, in float32; summed over each key/value head's group below.
    grad_value = torch.empty(batch, heads, cols, head_dim, dtype=torch.float32, device=value.device)
    common.launch(
        jitted, "backward", configs("backward", value.dtype, head_dim, value.device),
        lambda tiles: (batch * heads, triton.cdiv(cols, tiles["BLOCK_N"])),
        (*arguments, delta, *_pointers(logits, addend), grad_logits, grad_value, *sizes),
        switches | {"HAS_ADDEND": addend is not None},
    )  # fmt: skip
    group = heads // value_heads
    grad_value = grad_value.view(batch, value_heads, group, cols, head_dim).sum(2)
    return grad_logits, grad_value.to(value.dtype)


def attend(
    logits: Tensor,
    allowed: Tensor | None,
    additive: Tensor | None,
    value: Tensor,
    dropout_keep: Tensor | None,
    dropout_scale: float,
) -> Tensor:
    """:func:`forward`'s output, differentiable in ``logits`` and ``value`` through the operator
    ``ea_hf::triton_attention_tail`` (whose backward is :func:`backward`'s operator): the tail of a layer that
    autograd differentiates op by op, as a compiled graph does."""
    return torch.ops.ea_hf.triton_attention_tail(logits, allowed, additive, value, dropout_keep, dropout_scale)[0]


#: The kernels above, jitted with their device functions for the current ``TRITON_INTERPRET`` setting on first use.
#: Autotune's key for each (with the maps' dtypes): the padded head dimension and the map's buckets.
jitted = JittedPerSetting(
    {"forward": _forward_kernel, "row_terms": _row_terms_kernel, "backward": _backward_kernel},
    helpers=(_masked_logits, _probabilities, _kept_weights, _map_pointers, tile_product),
    tuning_keys=dict.fromkeys(("forward", "row_terms", "backward"), ("BLOCK_D", "rows_bucket", "cols_bucket")),
)

"""The Triton kernels of the evolution step against the torch formulation (``ea_hf.modeling.convolution`` with
no fused kernel, on CPU, in float64) and the CPU kernel: every test runs twice, on CPU tensors in Triton's
interpreter (everywhere, CI included) and compiled on a CUDA GPU (where there is one).

The interpreter runs every program in numpy, slowly: shapes are tiny, and tiles are set small enough (see the
fixtures) that maps of 5, 7 or 13 rows and columns span several partial tiles and weight-gradient splits.
"""

import os

# Set before triton is imported where this module imports it first (the root conftest's ``import ea_hf`` may
# already have, through torch._dynamo: the kernels use only builtins, which the interpreter patches either way).
# ea_hf.ops.triton reads it when it first wraps its kernels; it is restored after this module.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from testing import METHODS, patched_model, spy_on, tiny_inputs  # noqa: E402

from ea_hf.modeling import convolution  # noqa: E402
from ea_hf.modeling import kernels as registry  # noqa: E402
from ea_hf.modeling.history import ConvolutionHistory  # noqa: E402
from ea_hf.modeling.step import EvolutionStep, GradientIn, StepMaps, pack_gate, packed_gate  # noqa: E402
from ea_hf.ops.cpu import binding as cpu_binding  # noqa: E402
from ea_hf.ops.cpu import evolution as cpu_evolution  # noqa: E402
from ea_hf.ops.triton import common  # noqa: E402
from ea_hf.ops.triton import evolution as kernels  # noqa: E402

# Compiled on a GPU the kernels need the release ea_hf uses them from; the interpreter, INTERPRETER_TRITON.
triton = pytest.importorskip(
    "triton", minversion=common.MIN_TRITON, reason="the Triton kernels need the optional triton package"
)


def only(correlation: dict, weight_grad: dict) -> dict:
    """CONFIGS with one configuration per kernel, for every dtype: the correlation kernels' and the
    weight-gradient kernel's tiles (warps and stages do not matter in the interpreter)."""
    launch = {"num_warps": 4, "num_stages": 3}
    kernels_tiles = {"correlate": correlation, "input_grad": correlation, "weight_grad": weight_grad}
    return {kind: {name: (tiles | launch,) for name, tiles in kernels_tiles.items()} for kind in kernels.CONFIGS}


#: Tiles for most tests: one or two tiles per map, few interpreted programs.
TILES = {"CONFIGS": only(dict(BLOCK_Q=8, BLOCK_K=16, BLOCK_TAPS=32), dict(BLOCK_Q=8, BLOCK_K=16, BLOCK_TAPS=32))}
#: Tiles that split a 7 x 11 map (a tile's columns are whole bytes of the packed gate: a multiple of 8), a
#: reduction split into several blocks of (head, tap) pairs, and a weight gradient split into runs of several
#: tiles, the last one shorter (each side of a product at least 16).
SMALL_TILES = {
    "CONFIGS": only(dict(BLOCK_Q=4, BLOCK_K=8, BLOCK_TAPS=16), dict(BLOCK_Q=2, BLOCK_K=8, BLOCK_TAPS=16)),
    "WEIGHT_GRAD_SPLITS": 5,  # 24 tiles of a [3, 3, 7, 11] map: runs of 5, the last of 4
    "WEIGHT_GRAD_SPLIT_PIXELS": 1,
    "IN_PLACE_PIXELS": 150,  # in-place correlation in launches of 2 batch elements (of 3), the last one shorter
}
#: The module's own configurations (the first of each list runs in the interpreter), for whole models.
DEFAULT_TILES = {name: getattr(kernels, name) for name in (*TILES, *SMALL_TILES)}
#: Max error relative to the reference's largest magnitude: fp32 kernels, and half-precision maps.
FP32_TOLERANCE = 1e-5
HALF_TOLERANCE = 2e-2


@pytest.fixture(autouse=True)
def triton_on(monkeypatch, device):
    monkeypatch.setenv("EA_HF_TRITON", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1" if device == "cpu" else "0")
    # float32 accuracy on a GPU (three TF32 products a product; see test_float32_precision_follows_cudnn)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    for name, value in TILES.items():  # (on a GPU too: one configuration, so autotune does not choose)
        monkeypatch.setattr(kernels, name, value)


@pytest.fixture
def small_tiles(monkeypatch):
    for name, value in SMALL_TILES.items():
        monkeypatch.setattr(kernels, name, value)


@pytest.fixture
def calls(monkeypatch):
    """Names of the Triton kernel functions called: proof that the evolution ran on them."""
    return spy_on(monkeypatch, kernels)


def relative_error(got, want):
    got, want = got.cpu().double(), want.cpu().double()
    return ((got - want).abs().max() / want.abs().max()).item()


def to(device, *tensors):
    """The tensors (``None`` passes through) on ``device``; references stay on CPU."""
    return [None if t is None else t.to(device) for t in tensors]


def padding_keep(batch, rows, cols, form="full"):
    """A 0/1 float mask: per batch element, a different number of trailing rows and columns zeroed (padding),
    in the shapes the evolution passes: [B, 1, Q, K], [B, 1, 1, K] (key padding) or [B, 1, Q, 1]."""
    valid_rows = torch.tensor([rows - 1 - b % 2 for b in range(batch)]).clamp(min=1)
    valid_cols = torch.tensor([cols - 2 - b for b in range(batch)]).clamp(min=1)
    row_keep = (torch.arange(rows)[None, :] < valid_rows[:, None])[:, None, :, None]
    col_keep = (torch.arange(cols)[None, :] < valid_cols[:, None])[:, None, None, :]
    if form == "columns":
        return col_keep.float()
    if form == "rows":
        return row_keep.float()
    return (row_keep & col_keep).float()


def make_inputs(batch, heads, rows, cols, kernel_size, causal, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    context = kernel_size // 2
    kernel_rows = context + 1 if causal else kernel_size

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    scores, previous, upstream = (randn(batch, heads, rows, cols) for _ in range(3))
    weight = randn(heads, heads, kernel_rows, kernel_size, scale=0.4).float()
    bias = randn(heads, scale=0.2).float()
    return scores, previous, upstream, weight, bias, context


def evolution(
    monkeypatch, fused, scores, previous, keep, weight, bias, upstream, *, alpha, beta, causal, context, device="cpu"
):
    """A_logit and the gradients of (S, A_prev, weight, bias) through ``evolve_convolution`` with autograd, with
    ``fused`` as the registered fused kernels (``[]``: the torch operations), computed on ``device``."""
    monkeypatch.setattr(registry, "FUSED_KERNELS", fused)
    scores, previous, keep, weight, bias, upstream = to(device, scores, previous, keep, weight, bias, upstream)
    s = scores.detach().clone().requires_grad_()
    p = None if previous is None else previous.detach().clone().requires_grad_()
    w, b = weight.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    step = EvolutionStep(alpha, beta, context, causal)
    out = convolution.evolve_convolution(step, StepMaps(s, p, keep), w, b)
    out.backward(upstream)
    return out.detach(), [s.grad, None if p is None else p.grad, w.grad, b.grad]


def correlate_with_torch(
    x,
    weight,
    bias,
    row_shift,
    *,
    lerp_end=None,
    lerp_weight=0.0,
    in_keep=None,
    relu=False,
    out_keep=None,
    blend=None,
    blend_coef=0.0,
):
    """What ``correlate`` computes, step by step, in float64: output row i reads rows i + row_shift + dy."""
    x, weight = x.double(), weight.double()
    a = x if lerp_end is None else torch.lerp(x, lerp_end.double(), lerp_weight)
    if in_keep is not None:
        a = a * in_keep.double()
    rows, kernel_rows = x.shape[-2], weight.shape[-2]
    padded = F.pad(a, (weight.shape[-1] // 2,) * 2 + (-row_shift, kernel_rows - 1 + row_shift))
    out = F.conv2d(padded, weight, None if bias is None else bias.double())[..., :rows, :]
    if relu:
        out = torch.relu(out)
    saved = out > 0
    if out_keep is not None:
        out = out * out_keep.double()
    if blend is not None:
        mixed = blend.double() if lerp_end is None else torch.lerp(blend.double(), lerp_end.double(), lerp_weight)
        out = out + blend_coef * mixed
    return out, saved


# (kernel size, causal, with previous, keep form, heads, rows, columns). Rows < columns with 1 or 2 rows: the
# maps of cached decoding (a step's few query rows over all keys) and of cross attention.
STEP_CASES = [
    (1, False, True, "full", 3, 5, 7),
    (3, False, False, None, 2, 7, 13),
    (3, False, True, "full", 4, 13, 5),
    (3, False, True, "columns", 3, 7, 7),
    (3, True, True, "full", 3, 7, 7),
    (3, True, False, "rows", 2, 13, 7),
    (5, False, True, None, 2, 7, 5),
    (5, False, False, "full", 3, 5, 13),
    (5, True, True, "full", 2, 13, 13),
    (5, True, False, None, 3, 7, 7),
    (3, True, True, "full", 3, 1, 7),
    (5, True, False, "columns", 2, 2, 7),
    (3, False, True, "full", 2, 2, 5),
]


@pytest.mark.parametrize(("kernel_size", "causal", "with_previous", "keep_form", "heads", "rows", "cols"), STEP_CASES)
def test_evolution_step_matches_torch_and_cpu(
    monkeypatch, calls, device, kernel_size, causal, with_previous, keep_form, heads, rows, cols
):
    """Forward and all four gradients through evolve_convolution, on the Triton kernels, against the torch
    operations in float64 and the CPU kernel."""
    batch, alpha, beta = 2, 0.3, 0.6
    scores, previous, upstream, weight, bias, context = make_inputs(batch, heads, rows, cols, kernel_size, causal)
    previous = previous if with_previous else None
    keep = None if keep_form is None else padding_keep(batch, rows, cols, keep_form)
    options = dict(alpha=alpha, beta=beta, causal=causal, context=context)
    got, got_grads = evolution(
        monkeypatch, [kernels], scores, previous, keep, weight, bias, upstream, **options, device=device
    )
    assert calls == ["correlate", "backward"]

    def double(t):
        return None if t is None else t.double()

    doubles = [double(t) for t in (scores, previous, keep, weight, bias, upstream)]
    want, want_grads = evolution(monkeypatch, [], *doubles, **options)
    assert relative_error(got, want) <= FP32_TOLERANCE
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        assert (got_grad is None) == (want_grad is None)
        if want_grad is not None:
            assert got_grad.dtype == torch.float32
            assert relative_error(got_grad, want_grad) <= FP32_TOLERANCE
    if cpu_evolution.applicable(scores, previous, keep=keep, weight=weight):
        on_cpu, cpu_grads = evolution(
            monkeypatch, [cpu_evolution], scores, previous, keep, weight, bias, upstream, **options
        )
        assert relative_error(got, on_cpu) <= FP32_TOLERANCE
        for got_grad, cpu_grad in zip(got_grads, cpu_grads, strict=True):
            if cpu_grad is not None:
                assert relative_error(got_grad, cpu_grad) <= FP32_TOLERANCE


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("kernel_size", "causal", "rows", "cols"), [(3, True, 7, 13), (5, False, 7, 5)])
def test_half_precision_maps(monkeypatch, calls, device, dtype, kernel_size, causal, rows, cols):
    """bfloat16 and float16 maps (float32 accumulation) against the float32 torch operations on the same
    values: the forward without autograd (in place) and with it, and the map gradients."""
    batch, heads, alpha, beta = 2, 3, 0.3, 0.6
    scores, previous, upstream, weight, bias, context = make_inputs(
        batch, heads, rows, cols, kernel_size, causal, dtype
    )
    keep = padding_keep(batch, rows, cols).to(dtype)
    options = dict(alpha=alpha, beta=beta, causal=causal, context=context)
    monkeypatch.setattr(registry, "FUSED_KERNELS", [kernels])
    with torch.no_grad():
        on_scores, on_keep, on_weight, on_bias = to(device, scores.clone(), keep, weight, bias)
        maps = StepMaps(on_scores, previous.to(device), on_keep)
        step = EvolutionStep(alpha, beta, context, causal)
        inference = convolution.evolve_convolution(step, maps, on_weight, on_bias)
    got, got_grads = evolution(
        monkeypatch, [kernels], scores, previous, keep, weight, bias, upstream, **options, device=device
    )
    assert calls == ["correlate", "correlate", "backward"]
    floats = [t.float() for t in (scores, previous, keep, weight, bias, upstream)]
    want, want_grads = evolution(monkeypatch, [], *floats, **options)
    assert inference.dtype == got.dtype == dtype
    assert relative_error(inference, want) <= HALF_TOLERANCE
    assert relative_error(got, want) <= HALF_TOLERANCE
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        assert relative_error(got_grad, want_grad) <= HALF_TOLERANCE


def paper_attention(step, query, key, value, previous, weight, bias, keep, allowed, scaling):
    """(output, A_logit) of one evolving layer as the paper's equations, one torch operation each (autograd
    through them is the torch path): the maps in the inputs' dtype, the mask and softmax in fp32 or float64 as
    eager attention's softmax runs, P back in the values' dtype."""
    scores = query @ key.transpose(-1, -2) * scaling
    attention_in = step.alpha * previous + (1.0 - step.alpha) * scores
    c = step.context_rows
    padded = F.pad(attention_in * keep, (weight.shape[-1] // 2,) * 2 + (c, weight.shape[-2] - 1 - c))
    logits = step.beta * F.relu(F.conv2d(padded, weight, bias)) + (1.0 - step.beta) * attention_in
    softmax_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    masked = logits.to(softmax_dtype).masked_fill(~allowed, torch.finfo(softmax_dtype).min)
    return masked.softmax(-1).to(value.dtype) @ value, logits


@pytest.mark.parametrize("path", ["triton", "torch-ops"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
def test_half_precision_layer_meets_flash_attentions_accuracy_rule(monkeypatch, calls, device, dtype, causal, path):
    """A half-precision layer evolves maps in its own dtype, on the kernels and on the attention core's torch
    operations (A_logit, which backward keeps and the next layer reads, is half the bytes of an fp32 one), and is
    as accurate as flash-attention's rule asks: against a float64 reference, the error of its output, its A_logit
    and every gradient is at most twice that of torch's operations in the same dtype (autograd through the
    paper's equations). With right padding."""
    from ea_hf.modeling.attention_core import CoreConstants, CoreMasks, EvolvingAttentionCore
    from ea_hf.modeling.masks import AttentionMask

    monkeypatch.setattr(registry, "FUSED_KERNELS", [kernels] if path == "triton" else [])
    batch, heads, rows, head_dim, kernel_size = 2, 4, 13, 16, 3
    step = EvolutionStep(alpha=0.3, beta=0.5, context_rows=kernel_size // 2, causal=causal)
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(batch, heads, rows, head_dim, generator=generator) for _ in range(3))
    previous = 2 * torch.randn(batch, heads, rows, rows, generator=generator)
    kernel_rows = kernel_size // 2 + 1 if causal else kernel_size
    weight = torch.randn(heads, heads, kernel_rows, kernel_size, generator=generator) / (heads * kernel_size)
    bias = 0.1 * torch.randn(heads, generator=generator)
    # The attention mask, also the convolution's: right padding, and in a decoder no future keys.
    allowed = padding_keep(batch, rows, rows).bool()
    if causal:
        allowed = allowed & torch.ones(rows, rows, dtype=torch.bool).tril()
    upstream = torch.randn(batch, heads, rows, head_dim, generator=generator)
    upstream_logits = torch.randn(batch, heads, rows, rows, generator=generator)
    leaves = (query, key, value, previous, weight, bias)
    scaling = head_dim**-0.5

    def run(where, cast, core):
        tensors = [t.to(where, cast).requires_grad_() for t in leaves]
        q, k, v, prev, w, b = tensors
        mask = allowed.to(where)
        if core:
            constants, masks = CoreConstants(step, scaling), CoreMasks(mask, AttentionMask(mask))
            output, logits, _ = EvolvingAttentionCore.apply(constants, masks, q, k, v, prev, None, w, b)
        else:
            output, logits = paper_attention(step, q, k, v, prev, w, b, mask.to(cast), mask, scaling)
        loss = (output.double() * upstream.to(where, torch.float64)).sum()
        loss = loss + (logits.double() * upstream_logits.to(where, torch.float64)).sum()
        loss.backward()
        return [output, logits, *(t.grad for t in tensors)], logits.dtype

    reference, _ = run("cpu", torch.float64, core=False)
    ours, logits_dtype = run(device, dtype, core=True)
    assert calls == (["correlate", "backward"] if path == "triton" else [])  # which path the evolution took
    assert logits_dtype == dtype  # in the model's precision, not upcast
    torch_ops, _ = run(device, dtype, core=False)
    names = ["output", "A_logit", "query", "key", "value", "A_prev", "weight", "bias"]
    for name, got, baseline, want in zip(names, ours, torch_ops, reference, strict=True):
        got_error = (got.cpu().double() - want).abs().max().item()
        torch_error = (baseline.cpu().double() - want).abs().max().item()
        # Plus what storing the exact result in the dtype costs (flash-attention's tests add the same): both
        # paths round their results to it last, which decides the error of a tensor of a few entries (the bias).
        rounding = (want.to(dtype).double() - want).abs().max().item()
        assert got_error <= 2 * torch_error + rounding, (name, got_error, torch_error, rounding)


@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize(
    ("options", "kernel_rows", "kernel_cols", "row_shift"),
    [
        ("all", 3, 3, -1),
        ("all", 2, 3, -1),  # causal: row i reads rows i - 1 .. i
        ("all", 2, 3, 0),  # rows i .. i + 1
        ("all", 5, 5, -2),
        ("bare", 3, 3, -1),  # no bias, ReLU, masks or blend
        ("blend", 1, 1, 0),  # blend and output mask without lerp_end, no ReLU
    ],
)
def test_correlate_options_match_torch(device, options, kernel_rows, kernel_cols, row_shift):
    """Each option of correlate, over tiles that split the map and the heads, against torch and the CPU kernel."""
    generator = torch.Generator().manual_seed(3)
    batch, heads, rows, cols = 2, 3, 7, 11
    x, end = (torch.randn(batch, heads, rows, cols, generator=generator) for _ in range(2))
    weight = torch.randn(heads, heads, kernel_rows, kernel_cols, generator=generator)
    bias = torch.randn(heads, generator=generator)
    keep = padding_keep(batch, rows, cols)
    choices = {
        "all": dict(lerp_end=end, lerp_weight=0.3, in_keep=keep, relu=True, out_keep=keep, blend=x, blend_coef=0.6),
        "bare": dict(),
        "blend": dict(out_keep=padding_keep(batch, rows, cols, "columns"), blend=end, blend_coef=-0.4),
    }[options]
    with_bias = None if options == "bare" else bias
    saved = packed_gate(x)
    on_device = {name: value.to(device) if torch.is_tensor(value) else value for name, value in choices.items()}
    saved_on_device = saved.to(device)
    out = kernels.correlate(*to(device, x, weight, with_bias), row_shift=row_shift, saved=saved_on_device, **on_device)
    want, want_saved = correlate_with_torch(x, weight, with_bias, row_shift, **choices)
    assert relative_error(out, want) <= FP32_TOLERANCE
    saved = saved_on_device.cpu()
    assert torch.equal(saved, pack_gate(want_saved))  # bit for bit, zeros past the last column included
    if cpu_evolution.applicable(x, keep=keep, weight=weight):
        cpu_saved = packed_gate(x)
        on_cpu = cpu_binding.correlate(x, weight, with_bias, row_shift=row_shift, saved=cpu_saved, **choices)
        assert relative_error(out, on_cpu) <= FP32_TOLERANCE
        assert torch.equal(saved, cpu_saved)


@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize(("kernel_size", "causal", "with_previous"), [(3, False, True), (3, True, False)])
def test_backward_over_small_tiles_matches_cpu(device, kernel_size, causal, with_previous):
    """backward with tiles, head blocks and weight-gradient splits that do not divide the map, against the CPU
    kernel's backward on the same arguments and against the float64 torch operations."""
    batch, heads, rows, cols, alpha, beta = 3, 3, 7, 11, 0.25, 0.4
    scores, previous, upstream, weight, bias, context = make_inputs(batch, heads, rows, cols, kernel_size, causal)
    previous = previous if with_previous else None
    keep = padding_keep(batch, rows, cols)
    convolved, gate = correlate_with_torch(
        scores, weight * beta, bias * beta, -context, lerp_end=previous, lerp_weight=alpha, in_keep=keep, relu=True
    )
    step = EvolutionStep(alpha, beta, context, causal)
    arguments = (StepMaps(scores, previous, keep), GradientIn(upstream), gate, weight * beta)
    on_device = to(device, scores, previous, keep, upstream, gate, weight * beta)
    grads = kernels.backward(step, StepMaps(*on_device[:3]), GradientIn(on_device[3]), *on_device[4:])
    # The torch operations' backward, written out (convolution.EvolveConvolution.backward without a kernel).
    grad_convolved = convolution.relu_gate(upstream.double(), gate)
    scales = (1.0, None) if previous is None else (1.0 - alpha, alpha)
    weight64 = (weight * beta).double()
    want = list(
        convolution.convolution_input_grad(step, grad_convolved, weight64, keep.double(), upstream.double(), scales)
    )
    a_in = scores.double() if previous is None else torch.lerp(scores.double(), previous.double(), alpha)
    want.extend(convolution.convolution_weight_grad(a_in * keep, grad_convolved, *weight.shape[-2:], context))
    for got_grad, want_grad in zip(grads, want, strict=True):
        assert (got_grad is None) == (want_grad is None)
        if want_grad is not None:
            assert relative_error(got_grad, want_grad) <= FP32_TOLERANCE
    if cpu_evolution.applicable(scores, previous, upstream, keep=keep, weight=weight):
        for got_grad, cpu_grad in zip(grads, cpu_evolution.backward(step, *arguments), strict=True):
            if cpu_grad is not None:
                assert relative_error(got_grad, cpu_grad) <= FP32_TOLERANCE


@pytest.mark.parametrize("kernel_size", [3, 5])
def test_cached_decoding_prefill_and_steps_on_triton(monkeypatch, calls, device, kernel_size):
    """Cached decoding: the first step (no earlier rows) runs on the Triton kernel and leaves its last rows in the
    history; later one-row steps run on it too, over those rows and their own (the kept-row form). Outputs and
    kept rows match an all-torch decode."""
    batch, heads, prompt, beta, alpha = 2, 3, 5, 0.6, 0.3
    scores, previous, _, weight, bias, context = make_inputs(batch, heads, prompt + 2, prompt + 2, kernel_size, True)
    keep = torch.ones(batch, 1, prompt + 2, prompt + 2).tril()  # the decoder's causal mask
    keep[1, :, :, 0] = 0  # left padding in batch element 1
    outputs = {}
    for name, fused, where in (("triton", [kernels], device), ("torch", [], "cpu")):
        monkeypatch.setattr(registry, "FUSED_KERNELS", fused)
        history, steps = ConvolutionHistory(), []
        on_device = to(where, scores, keep, weight, bias, previous)
        with torch.no_grad():
            for first, last in ((0, prompt), (prompt, prompt + 1), (prompt + 1, prompt + 2)):
                rows = (slice(None), slice(None), slice(first, last), slice(0, last))
                step_scores, step_keep, step_weight, step_bias, step_previous = on_device
                maps = StepMaps(step_scores[rows].clone(), step_previous[rows], step_keep[rows])
                step = EvolutionStep(alpha, beta, context, causal=True)
                steps.append(convolution.evolve_convolution(step, maps, step_weight, step_bias, history))
        outputs[name] = steps, history.rows
    assert calls == ["correlate"] * 3  # the prefill and both steps with earlier rows
    (triton_steps, triton_rows), (torch_steps, torch_rows) = outputs["triton"], outputs["torch"]
    for got, want in zip(triton_steps, torch_steps, strict=True):
        assert got.shape == want.shape
        assert relative_error(got, want) <= FP32_TOLERANCE
    assert relative_error(triton_rows, torch_rows) <= FP32_TOLERANCE


@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize(("dtype", "kernel_rows", "row_shift"), [(torch.float32, 3, -1), (torch.bfloat16, 2, -1)])
def test_in_place_output_equals_a_separate_one(device, dtype, kernel_rows, row_shift):
    """Writing over the input gives the same bits as a separate output, though every tile reads rows and heads
    that other tiles write."""
    generator = torch.Generator().manual_seed(0)
    batch, heads, rows, cols = 3, 3, 7, 11
    x, end = (torch.randn(batch, heads, rows, cols, generator=generator).to(dtype) for _ in range(2))
    weight, bias = torch.randn(heads, heads, kernel_rows, 3, generator=generator), torch.randn(heads)
    keep = padding_keep(batch, rows, cols).to(dtype)
    x, end, weight, bias, keep = to(device, x, end, weight, bias, keep)
    options = dict(row_shift=row_shift, lerp_end=end, lerp_weight=0.3, in_keep=keep, relu=True, blend_coef=0.6)
    separate_saved, saved = packed_gate(x), packed_gate(x)
    separate = kernels.correlate(x, weight, bias, blend=x, saved=separate_saved, **options)
    overwritten = x.clone()
    result = kernels.correlate(overwritten, weight, bias, blend=overwritten, saved=saved, in_place=True, **options)
    assert result.data_ptr() == overwritten.data_ptr()
    assert torch.equal(result, separate)
    assert torch.equal(saved, separate_saved)
    assert not torch.equal(result, x)


def test_correlate_takes_only_a_packed_gate_in_whole_bytes(monkeypatch, device):
    """The gate is the CPU kernel's bit-packed form, and a tile writes whole bytes of it: anything else is a
    ValueError before a launch, not a gate written past its end."""
    x, weight = to(device, torch.zeros(1, 2, 5, 20), torch.zeros(2, 2, 3, 3))
    with pytest.raises(ValueError, match=r"bit-packed \(packed_gate\).*\(1, 2, 5, 4\), not torch.bool"):
        kernels.correlate(x, weight, None, row_shift=-1, saved=torch.zeros_like(x, dtype=torch.bool))
    monkeypatch.setattr(
        kernels,
        "CONFIGS",
        only(dict(BLOCK_Q=8, BLOCK_K=4, BLOCK_TAPS=16), TILES["CONFIGS"]["float32"]["weight_grad"][0]),
    )
    with pytest.raises(ValueError, match=r"BLOCK_K must be a multiple of 8, not \[4\]"):
        kernels.correlate(x, weight, None, row_shift=-1, saved=packed_gate(x))
    assert kernels.correlate(x, weight, None, row_shift=-1).shape == x.shape  # no gate: any tile


def test_applicable_needs_the_opt_in_and_on_cpu_the_interpreter(monkeypatch, device):
    maps, weight, keep = to(device, torch.zeros(1, 4, 5, 5), torch.zeros(4, 4, 3, 3), torch.ones(1, 1, 5, 5))
    assert kernels.applicable(maps, keep=keep, weight=weight)
    monkeypatch.setenv("EA_HF_TRITON", "0")
    assert not kernels.applicable(maps, weight=weight)  # off unless asked for
    monkeypatch.delenv("EA_HF_TRITON")
    assert not kernels.applicable(maps, weight=weight)
    monkeypatch.setenv("EA_HF_TRITON", "1")
    monkeypatch.delenv("TRITON_INTERPRET")
    # CPU tensors only through the interpreter; CUDA tensors compiled.
    assert kernels.applicable(maps, weight=weight) == (device == "cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "1" if device == "cpu" else "0")
    monkeypatch.setattr(common, "triton", None)
    assert not kernels.applicable(maps, weight=weight)  # triton not installed


def test_applicable_declines_what_it_does_not_take(device):
    maps, weight = to(device, torch.zeros(2, 4, 5, 5), torch.zeros(4, 4, 3, 3))

    def ones(*shape):
        return torch.ones(*shape, device=device)

    def zeros(*shape):
        return torch.zeros(*shape, device=device)

    assert kernels.applicable(maps, maps.bfloat16(), keep=None, weight=weight) is False  # mixed dtypes
    assert not kernels.applicable(maps.double(), weight=weight)
    assert not kernels.applicable(maps[0], weight=weight)  # 3-D map
    assert not kernels.applicable(maps, keep=ones(2, 4, 5, 5), weight=weight)  # a mask per head
    assert not kernels.applicable(maps, keep=ones(4, 5, 5), weight=weight)  # the same, broadcast
    assert not kernels.applicable(maps, keep=torch.ones(2, 1, 5, 5, device="meta"), weight=weight)  # elsewhere
    assert not kernels.applicable(maps, weight=zeros(4, 4, 3, 4))  # even width: no centre column
    assert not kernels.applicable(maps, weight=zeros(4, 4, 9, 9))  # taller than 8 rows
    assert not kernels.applicable(maps, weight=zeros(3, 3, 3, 3))  # kernel for other heads
    assert not kernels.applicable(zeros(1, 65, 5, 5), weight=zeros(65, 65, 3, 3))
    assert not kernels.applicable(maps.to("meta"), weight=weight)  # neither CUDA nor CPU
    # One batch element's map must have fewer than 2**31 entries (int32 offsets); expanded views, no memory.
    big_weight = zeros(64, 64, 3, 3)
    assert kernels.applicable(zeros(1, 1, 1, 1).expand(2, 64, 8192, 4095), weight=big_weight)
    assert not kernels.applicable(zeros(1, 1, 1, 1).expand(2, 64, 8192, 4096), weight=big_weight)
    assert kernels.applicable(maps, keep=ones(5, 5), weight=weight)  # broadcast to [B, 1, Q, K]
    assert kernels.applicable(maps.half(), maps.half(), keep=ones(2, 1, 1, 5), weight=weight)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, FP32_TOLERANCE), (torch.bfloat16, 5e-2)])
def test_patched_model_on_triton_matches_torch_operations(monkeypatch, calls, device, dtype, tolerance):
    """A whole EA BERT (three chained layers, right padding) on the Triton kernels: its output and every
    parameter's gradient match the same model on CPU in float32 on torch operations. The module's own tiles."""
    for name, value in DEFAULT_TILES.items():
        monkeypatch.setattr(kernels, name, value)
    inputs = tiny_inputs("bert")
    evolved_dtypes = []
    correlate = kernels.correlate

    def recording(x, *args, **kwargs):
        evolved_dtypes.append(x.dtype)
        return correlate(x, *args, **kwargs)

    monkeypatch.setattr(kernels, "correlate", recording)
    results = {}
    for name, fused, where, model_dtype in (("triton", [kernels], device, dtype), ("torch", [], "cpu", None)):
        monkeypatch.setattr(registry, "FUSED_KERNELS", fused)
        model = patched_model("bert", METHODS["conv"]).to(dtype)  # in eval mode: no dropout
        if model_dtype is None:
            model = model.float()  # the same (rounded) weights, computed in float32
        model = model.to(where)
        output = model(**{key: value.to(where) for key, value in inputs.items()}).last_hidden_state
        (output.float() * torch.linspace(-1, 1, output.shape[-1], device=where)).sum().backward()
        results[name] = output, {key: p.grad for key, p in model.named_parameters() if p.grad is not None}
    assert calls.count("correlate") == calls.count("backward") == 3  # one of each per layer
    assert evolved_dtypes == [dtype] * 3  # maps in the model's precision
    (got, got_grads), (want, want_grads) = results["triton"], results["torch"]
    assert got.dtype == dtype
    assert relative_error(got, want) <= tolerance
    assert got_grads.keys() == want_grads.keys()
    assert sum("evolving_attention" in key for key in got_grads) == 6  # weight and bias of 3 layers
    # Relative to the largest gradient entry of the model: some gradients are zero up to rounding (the last
    # layer's evolution bias, where every gate is open, sums a softmax gradient's rows, which sum to zero).
    scale = max(grad.abs().max().item() for grad in want_grads.values())
    for key, want_grad in want_grads.items():
        assert (got_grads[key].cpu().double() - want_grad.double()).abs().max().item() <= tolerance * scale, key


def test_compiled_model_runs_the_kernels_as_operators(monkeypatch, device):
    """Under ``torch.compile(fullgraph=True)`` the kernels run as the operators of ``ea_hf.ops.triton.operators``
    (one per layer in each graph, no graph break: traced, dynamo followed the launch into Triton's runtime and
    failed), and the compiled model gives eager mode's outputs and gradients."""
    from torch._dynamo.backends.common import aot_autograd

    monkeypatch.setattr(registry, "FUSED_KERNELS", [kernels])
    model = patched_model("bert", METHODS["conv"]).to(device)
    inputs = {key: value.to(device) for key, value in tiny_inputs("bert").items()}
    called: list[str] = []

    def record(graph, example_inputs):
        # The evolution's operators (the fused attention tail's have a test of their own)
        called.extend(
            str(node.target) for node in graph.graph.nodes if str(node.target).startswith("ea_hf.triton_evolve")
        )
        return graph

    def step(model):
        model.zero_grad()
        output = model(**inputs).last_hidden_state
        (output * torch.linspace(-1, 1, output.shape[-1], device=device)).sum().backward()
        named = model.named_parameters()
        grads = {name.removeprefix("_orig_mod."): p.grad.clone() for name, p in named if p.grad is not None}
        return output.detach(), grads

    torch._dynamo.reset()
    try:
        backend = aot_autograd(fw_compiler=record, bw_compiler=record)
        with torch.no_grad():
            inference = torch.compile(model, fullgraph=True, backend=backend)(**inputs).last_hidden_state
        assert called == ["ea_hf.triton_evolve_with_gate_bits.default"] * 3
        called.clear()
        got, got_grads = step(torch.compile(model, fullgraph=True, backend=backend))
        assert (
            sorted(called)
            == ["ea_hf.triton_evolve_backward.default"] * 3 + ["ea_hf.triton_evolve_with_gate_bits.default"] * 3
        )
    finally:
        torch._dynamo.reset()
    want, want_grads = step(model)
    assert relative_error(inference, want) <= FP32_TOLERANCE
    assert relative_error(got, want) <= FP32_TOLERANCE
    assert sum("evolving_attention" in name for name in want_grads) == 6
    # Relative to the model's largest gradient entry: the last layer's evolution bias sums rows of a softmax
    # gradient, which sum to zero, so its own entries are rounding noise (eager mode runs the fused attention
    # tail, the compiled graph torch's softmax).
    scale = max(grad.abs().max().item() for grad in want_grads.values())
    for name, want_grad in want_grads.items():
        assert (got_grads[name].cpu().double() - want_grad.cpu().double()).abs().max() <= FP32_TOLERANCE * scale, name


def test_float32_precision_follows_cudnn(monkeypatch):
    """Compiled, float32 maps are multiplied in TF32 where cuDNN's convolutions may be (torch's default, as the
    torch operations' F.conv2d), else as three TF32 products; the interpreter always multiplies in float32."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    assert kernels.product_switches(12, torch.float32)["FP32_PRECISION"] == "tf32"
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    assert kernels.product_switches(12, torch.float32)["FP32_PRECISION"] == "tf32x3"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    switches = kernels.product_switches(12, torch.bfloat16)
    assert switches["FP32_PRECISION"] == "ieee" and switches["HALF"] and not switches["TENSOR_CORES"]
    assert switches["BLOCK_H"] == 16


def test_autotune_times_every_configuration_and_the_result_is_the_chosen_ones(monkeypatch, device):
    """Under ``triton.autotune`` (which a compiled launch with more than one configuration runs; see
    ``ea_hf.ops.triton.common.launch``) every kernel runs once per configuration of its list, timed, and then the
    fastest: the results (a gated forward step out of place and in place, and its backward) are bit for bit those
    of the chosen configuration alone, so no kernel reads what it writes. The same tuning key is not timed again;
    a map of another size bucket is. In the interpreter, which never autotunes by itself, a stand-in timer
    prefers each list's second configuration; on a GPU, autotune's own timer chooses."""
    two = only(dict(BLOCK_Q=4, BLOCK_K=8, BLOCK_TAPS=16), dict(BLOCK_Q=2, BLOCK_K=8, BLOCK_TAPS=16))
    second = {"correlate": dict(BLOCK_Q=2, BLOCK_K=16, BLOCK_TAPS=32), "weight_grad": dict(BLOCK_Q=4, BLOCK_TAPS=32)}
    for lists in two.values():  # a second configuration per kernel, with other tiles and other tap blocks
        for name, (first,) in lists.items():
            lists[name] = (first, first | second.get(name, second["correlate"]))
    monkeypatch.setattr(kernels, "CONFIGS", two)
    monkeypatch.setattr(kernels, "WEIGHT_GRAD_SPLITS", 5)
    monkeypatch.setattr(kernels, "WEIGHT_GRAD_SPLIT_PIXELS", 1)
    timed = []

    def stand_in_timer(kernel_call, quantiles):
        kernel_call()
        timed.append(kernel_call)
        return [2.0 if len(timed) % 2 else 1.0] * len(quantiles)

    timer = stand_in_timer if device == "cpu" else None
    autotuners = {}

    def autotuned_launch(family, name, configs, grid, args, switches):
        autotuners[name] = family.autotuned(name, configs, do_bench=timer)
        autotuners[name][grid](*args, **switches)

    def step(rows, cols):
        batch, heads, alpha, beta = 3, 3, 0.3, 0.6
        scores, previous, upstream, weight, bias, context = make_inputs(batch, heads, rows, cols, 3, False)
        scores, previous, upstream, weight, bias = to(device, scores, previous, upstream, weight, bias)
        maps, step = StepMaps(scores, previous, None), EvolutionStep(alpha, beta, context)
        logits, gate = kernels.evolve(step, maps, weight * beta, bias * beta, in_place=False, gate=True)
        in_place_maps = StepMaps(scores.clone(), previous, None)
        in_place, _ = kernels.evolve(step, in_place_maps, weight * beta, bias * beta, in_place=True)
        return [logits, gate, in_place, *kernels.backward(step, maps, GradientIn(upstream), gate, weight * beta)]

    with monkeypatch.context() as patch:
        patch.setattr(common, "launch", autotuned_launch)
        got = step(7, 11)
        # Two configurations for each of the four tuning keys: the correlation with a gate and in place (autotune's
        # key holds the dtypes of the tensors passed: the in-place launch passes no gate), and both gradients.
        assert len(timed) == (8 if device == "cpu" else 0)
        again = step(7, 11)  # the same tuning keys: no timing
        assert len(timed) == (8 if device == "cpu" else 0)
        step(7, 20)  # 20 columns: another bucket, timed again
        assert len(timed) == (16 if device == "cpu" else 0)
    chosen = {name: autotuner.best_config for name, autotuner in autotuners.items()}
    for name, config in chosen.items():
        chosen[name] = dict(config.kwargs) | {"num_warps": config.num_warps, "num_stages": config.num_stages}
        assert chosen[name] in two["float32"][name]
        if device == "cpu":
            assert chosen[name] == two["float32"][name][1]
        monkeypatch.setitem(two["float32"], name, (chosen[name],))
    want = step(7, 11)
    for got_map, again_map, want_map in zip(got, again, want, strict=True):
        assert torch.equal(got_map, want_map) and torch.equal(again_map, want_map)

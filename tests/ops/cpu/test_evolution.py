"""The fused CPU kernels against the same steps written as torch operations, and their build and fallback."""

import logging

import pytest
import torch
import torch.nn.functional as F
from testing import CAUSAL_LM_FAMILIES, VOCAB_SIZE, cached_and_uncached_generation, left_padded_inputs, tiny_model
from transformers import AutoModel, AutoModelForCausalLM

import ea_hf
from ea_hf.modeling import convolution
from ea_hf.modeling import kernels as registry
from ea_hf.modeling.evolution import AttentionMapEvolution
from ea_hf.modeling.step import EvolutionStep, GradientIn, StepMaps, pack_gate, packed_gate, unpacked_gate
from ea_hf.ops.cpu import binding, build
from ea_hf.ops.cpu import evolution as kernels

needs_compiler = pytest.mark.skipif(build.find_compiler() is None, reason="no C++ compiler on this machine")


def correlate_with_torch(
    x, weight, bias, row_shift, *, lerp_end=None, lerp_weight=0.0, in_keep=None, relu=False, blend=None, blend_coef=0.0
):
    """What `binding.correlate` computes, step by step: output row i reads rows i + row_shift + dy."""
    a = x if lerp_end is None else torch.lerp(x, lerp_end, lerp_weight)
    if in_keep is not None:
        a = a * in_keep
    rows, kernel_rows = x.shape[-2], weight.shape[-2]
    padded = F.pad(a, (weight.shape[-1] // 2,) * 2 + (-row_shift, kernel_rows - 1 + row_shift))
    out = F.conv2d(padded, weight, bias)[..., :rows, :]
    if relu:
        out = torch.relu(out)
    saved = out > 0
    if blend is not None:
        mixed = blend if lerp_end is None else torch.lerp(blend, lerp_end, lerp_weight)
        out = out + blend_coef * mixed
    return out, saved


@needs_compiler
def test_the_kernel_builds_and_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("EA_HF_CACHE", str(tmp_path))
    monkeypatch.setattr(binding, "_loaded", {})
    assert kernels.cpu_kernel() is not None
    built = list((tmp_path / "kernels").glob("evolve_cpu-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(binding, "_loaded", {})
    assert kernels.cpu_kernel() is not None
    assert built[0].stat().st_mtime_ns == stamp  # loaded again, not rebuilt


@needs_compiler
@pytest.mark.parametrize("heads", [3, 4, 12])  # 4 and 12 are specialised, 3 takes the generic code
@pytest.mark.parametrize(
    ("kernel_rows", "kernel_cols", "row_shift"), [(3, 3, -1), (2, 3, -1), (2, 3, 0), (1, 1, 0), (5, 5, -2)]
)
# The blend is the input itself (as every caller has it; the kernel reads it from its row ring) or another map.
@pytest.mark.parametrize("blend_is_input", [True, False])
def test_correlate_matches_torch(heads, kernel_rows, kernel_cols, row_shift, blend_is_input):
    torch.manual_seed(0)
    batch, rows, cols = 2, 9, 37  # 37 columns: a partial last vector block
    x, end, other = (torch.randn(batch, heads, rows, cols) for _ in range(3))
    weight, bias = torch.randn(heads, heads, kernel_rows, kernel_cols), torch.randn(heads)
    keep = (torch.rand(batch, 1, rows, cols) > 0.2).float()
    blend = x if blend_is_input else other
    options = dict(lerp_end=end, lerp_weight=0.3, in_keep=keep, relu=True, blend=blend, blend_coef=0.6)
    saved = packed_gate(x)
    out = binding.correlate(x, weight, bias, row_shift=row_shift, saved=saved, **options)
    expected, expected_saved = correlate_with_torch(x, weight, bias, row_shift, **options)
    assert (out - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert torch.equal(saved, pack_gate(expected_saved))  # one bit a value, zeros past the last column


def library_built_with(tmp_path_factory, name: str, *flags: str):
    """The kernel built with ``flags`` added to the usual ones, in a cache of its own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EA_HF_CACHE", str(tmp_path_factory.mktemp(name)))
        return kernels.build_library(*flags)


@pytest.fixture(scope="session")
def direct_form_library(tmp_path_factory):
    """The kernel built with -DEA_HF_DIRECT_CONVOLUTION: the direct form of the correlation everywhere, to
    compare with the default build's Winograd form."""
    return library_built_with(tmp_path_factory, "direct-form", "-DEA_HF_DIRECT_CONVOLUTION")


@pytest.fixture(scope="session")
def avx2_library(tmp_path_factory):
    """The kernel built without AVX-512 (-mno-avx512f after -march=native): what CPUs without it run."""
    return library_built_with(tmp_path_factory, "no-avx512", "-mno-avx512f")


@pytest.fixture(scope="session")
def l1_prefetch_library(tmp_path_factory):
    """The kernel built with -DEA_HF_PREFETCH_LOCALITY=3: cache lines requested into L1 instead of L2."""
    return library_built_with(tmp_path_factory, "l1-prefetch", "-DEA_HF_PREFETCH_LOCALITY=3")


@pytest.fixture(scope="session")
def every_row_library(tmp_path_factory):
    """The kernel built with -DEA_HF_CORRELATE_EVERY_ROW: no bias-only rows, every row's products computed."""
    return library_built_with(tmp_path_factory, "every-row", "-DEA_HF_CORRELATE_EVERY_ROW")


def has_avx512() -> bool:
    return "avx512f" in build.cpu_signature()


@needs_compiler
@pytest.mark.parametrize("heads", [4, 8, 12, 16])
# Winograd's vectors hold 32 columns: fewer, exactly one, one more, two, and a partial second half.
@pytest.mark.parametrize("cols", [1, 5, 31, 32, 33, 64, 77])
@pytest.mark.parametrize(("kernel_rows", "row_shift"), [(3, -1), (2, -1)])
def test_the_winograd_form_matches_the_direct_form(heads, cols, kernel_rows, row_shift, direct_form_library):
    """The correlations of 3-column kernels (forward, and backward's input gradient) take Winograd's F(2, 3) form
    on AVX-512 hosts: within 1e-5 of torch's convolution like the direct form, the same ReLU gate, backward
    within 1e-5 of the direct form's gradients, and (proving the form ran) not the same bits as the direct form."""
    torch.manual_seed(cols)
    x, end, grad = (torch.randn(2, heads, 6, cols) for _ in range(3))
    weight, bias = torch.randn(heads, heads, kernel_rows, 3), torch.randn(heads)
    keep = (torch.rand(2, 1, 6, cols) > 0.2).float()
    options = dict(lerp_end=end, lerp_weight=0.3, in_keep=keep, relu=True, blend=x, blend_coef=0.6)
    step = EvolutionStep(0.3, 0.4, -row_shift)
    backward = (StepMaps(x, end, keep), GradientIn(grad), torch.rand(2, heads, 6, cols) > 0.4, weight)
    saved = packed_gate(x)
    winograd = binding.correlate(x, weight, bias, row_shift=row_shift, saved=saved, **options)
    winograd_grads = kernels.backward(step, *backward)
    with kernels.using_library(direct_form_library):
        direct = binding.correlate(x, weight, bias, row_shift=row_shift, **options)
        direct_grads = kernels.backward(step, *backward)
    expected, expected_saved = correlate_with_torch(x, weight, bias, row_shift, **options)
    for form in (winograd, direct):
        assert (form - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert torch.equal(saved, pack_gate(expected_saved))
    for got, want in zip(winograd_grads, direct_grads, strict=True):
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    if has_avx512() and cols >= 32:
        assert not torch.equal(winograd, direct)
        assert not torch.equal(winograd_grads[0], direct_grads[0])  # the input gradient's form
        assert torch.equal(winograd_grads[2], direct_grads[2])  # the weight gradient is direct in both


@needs_compiler
def test_a_build_requesting_lines_into_l1_gives_the_same_bits(l1_prefetch_library):
    """Where the kernel requests its cache lines (``EA_HF_PREFETCH_LOCALITY``, for bench/benchmarks/attention_cpu.py
    --kernel-build) changes no value: forward, gate and gradients bit for bit, on a map large enough that every
    row requests its next one. ``using_library`` runs the calls on the other build and restores the default."""
    torch.manual_seed(0)
    x, end, grad, addend = (torch.randn(2, 12, 70, 70) for _ in range(4))
    weight, bias = torch.randn(12, 12, 3, 3) * 0.05, torch.randn(12)
    default = kernels.cpu_kernel()

    def step():
        saved = packed_gate(x)
        options = dict(row_shift=-1, saved=saved, lerp_end=end, lerp_weight=0.3, relu=True)
        out = binding.correlate(x, weight, bias, **options)
        incoming = GradientIn(grad, addend)
        grads = kernels.backward(EvolutionStep(0.3, 0.4, 1), StepMaps(x, end, None), incoming, saved, weight)
        return out, saved, *grads

    expected = step()
    with kernels.using_library(l1_prefetch_library):
        assert kernels.cpu_kernel() is l1_prefetch_library
        got = step()
    assert kernels.cpu_kernel() is default
    for a, b in zip(got, expected, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


@needs_compiler
@pytest.mark.parametrize("heads", [3, 12])
@pytest.mark.parametrize("cols", [5, 37, 64])  # a partial vector; whole ones and a partial one; whole ones
def test_a_build_without_avx512_matches_the_default_build(heads, cols, avx2_library):
    """CPUs without AVX-512 (most laptops) run the kernel's other paths: 8-lane vectors, register blocks for 16
    vector registers, the direct form, and the gate's bits a byte a vector from lane comparisons instead of mask
    registers. Built so here: forward and backward within 1e-5 of the default build, the same gate bits (none
    past the last column)."""
    torch.manual_seed(cols)
    x, end, grad = (torch.randn(2, heads, 6, cols) for _ in range(3))
    weight, bias = torch.randn(heads, heads, 3, 3), torch.randn(heads)
    keep = (torch.rand(2, 1, 6, cols) > 0.2).float()
    options = dict(lerp_end=end, lerp_weight=0.3, in_keep=keep, relu=True, blend=x, blend_coef=0.6)
    gate = pack_gate(torch.rand(2, heads, 6, cols) > 0.4)
    backward = (EvolutionStep(0.3, 0.4, 1), StepMaps(x, end, keep), GradientIn(grad), gate, weight)
    results = []
    for library in (kernels.cpu_kernel(), avx2_library):
        saved = packed_gate(x)
        with kernels.using_library(library):
            results.append((binding.correlate(x, weight, bias, row_shift=-1, saved=saved, **options), saved))
            results[-1] += kernels.backward(*backward)
    (out, saved, *grads), (avx2_out, avx2_saved, *avx2_grads) = results
    assert torch.equal(avx2_saved, saved)
    assert torch.equal(saved, pack_gate(unpacked_gate(saved, cols)))  # zeros past the last column
    for got, want in zip((avx2_out, *avx2_grads), (out, *grads), strict=True):
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@needs_compiler
# The weight gradient's register blocks: 6 output heads for 12, 4 for 8; 3 heads take the generic code.
@pytest.mark.parametrize("heads", [3, 8, 12])
@pytest.mark.parametrize(("kernel_size", "causal"), [(3, False), (3, True), (5, False), (5, True), (1, False)])
@pytest.mark.parametrize("with_previous", [True, False])
def test_backward_matches_autograd(heads, kernel_size, causal, with_previous):
    """kernels.backward against autograd through the torch formulation, in float64."""
    torch.manual_seed(1)
    batch, rows, cols, alpha, beta = 2, 8, 21, 0.25, 0.4
    context = kernel_size // 2
    kernel_rows = context + 1 if causal else kernel_size
    scores, previous, upstream = (torch.randn(batch, heads, rows, cols, dtype=torch.float64) for _ in range(3))
    keep = (torch.rand(batch, 1, rows, cols) > 0.2).double()
    weight = torch.randn(heads, heads, kernel_rows, kernel_size, dtype=torch.float64) * 0.3
    bias = torch.randn(heads, dtype=torch.float64) * 0.1
    leaves = [t.clone().requires_grad_() for t in (scores, previous, weight, bias)]
    s, p, w, b = leaves
    a_in = torch.lerp(s, p, alpha) if with_previous else s
    convolved, gate = correlate_with_torch(a_in, w, b, -context, in_keep=keep, relu=True)
    ((convolved + (1 - beta) * a_in) * upstream).sum().backward()
    maps = StepMaps(scores.float(), previous.float() if with_previous else None, keep.float())
    incoming = GradientIn(upstream.float())
    grads = kernels.backward(EvolutionStep(alpha, beta, context), maps, incoming, gate, weight.float())
    expected = [s.grad, p.grad if with_previous else None, w.grad, b.grad]
    for got, want in zip(grads, expected, strict=True):
        if want is None:
            assert got is None
            continue
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_without_a_compiler_evolution_falls_back_to_torch(tmp_path, monkeypatch, caplog):
    torch.manual_seed(0)
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37))
    model = ea_hf.patch(model.eval(), alpha=0.3, beta=0.5)
    inputs = {"input_ids": torch.randint(0, 100, (2, 11)), "attention_mask": torch.ones(2, 11, dtype=torch.long)}
    inputs["attention_mask"][1, 7:] = 0
    with torch.no_grad():
        with_kernel = model(**inputs).last_hidden_state
    monkeypatch.setenv("EA_HF_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(build.shutil, "which", lambda name: str(tmp_path / "broken-c++") if name else None)
    (tmp_path / "broken-c++").write_text("#!/bin/sh\necho 'broken compiler' >&2\nexit 1\n")
    (tmp_path / "broken-c++").chmod(0o755)
    monkeypatch.setattr(binding, "_loaded", {})
    with caplog.at_level(logging.WARNING, logger="ea_hf.ops.cpu.binding"):
        assert kernels.cpu_kernel() is None
    assert "building the CPU kernel failed" in caplog.text and "broken compiler" in caplog.text
    with torch.no_grad():
        without = model(**inputs).last_hidden_state
    assert (with_kernel - without).abs().max() <= 1e-5
    monkeypatch.setattr(binding, "_loaded", {})
    monkeypatch.setenv("EA_HF_KERNELS", "0")
    assert kernels.cpu_kernel() is None  # switched off: not even a build is tried


def test_kernel_declines_what_it_does_not_take():
    weight = torch.zeros(4, 4, 3, 3)
    maps = torch.zeros(1, 4, 5, 5)
    assert not kernels.applicable(maps.double(), weight=weight)  # float32 only
    assert not kernels.applicable(maps, keep=torch.ones(1, 4, 5, 5), weight=weight)  # a mask per head
    assert not kernels.applicable(maps, weight=torch.zeros(4, 4, 9, 9))  # kernels taller than 8 rows
    assert not kernels.applicable(torch.zeros(1, 65, 5, 5), weight=weight)  # more than 64 heads


@needs_compiler
@pytest.mark.parametrize(
    "keep_shape",
    [(2, 3, 5, 37), (2, 1, 5, 37), (2, 1, 1, 37), (1, 1, 5, 37), (5, 37)],
    ids=["dropout", "per-query", "padding", "one-for-the-batch", "2-d"],
)
@pytest.mark.parametrize(("scale", "fill"), [(1 / 0.9, 0.0), (1.0, 0.0), (1.0, torch.finfo(torch.float32).min)])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_select_kept_gives_torch_where_bit_for_bit(keep_shape, scale, fill, in_place, threads, monkeypatch):
    """``keep ? scale * x : fill`` in one pass, with masks broadcast over the batch, heads or queries, into a new
    map or over ``x``: the bits of torch.where (and of native_dropout_backward, dropout's gradient)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 37)  # 37 columns: not a whole number of vectors
    keep = torch.rand(keep_shape) > 0.3
    expected = torch.where(keep, scale * x, torch.tensor(fill))
    if fill == 0.0 and keep_shape == x.shape:  # the same values (its zeros keep x's sign)
        assert torch.equal(expected, torch.ops.aten.native_dropout_backward(x, keep, scale))
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(binding, "SELECT_KEPT_MIN_ENTRIES", 0)  # these small maps too
    out = x.clone() if in_place else None
    result = kernels.select_kept(x if out is None else out, keep, scale, fill, out)
    assert result is not None and (result is out or out is None)
    assert torch.equal(result.view(torch.int32), expected.view(torch.int32))


def test_select_kept_declines_what_the_kernel_does_not_take(monkeypatch):
    x, keep = torch.randn(2, 3, 5, 8), torch.rand(2, 1, 5, 8) > 0.5
    assert kernels.select_kept(x, keep) is None  # smaller than SELECT_KEPT_MIN_ENTRIES: torch's operators
    monkeypatch.setattr(binding, "SELECT_KEPT_MIN_ENTRIES", x.numel())
    assert torch.equal(kernels.select_kept(x, keep), torch.where(keep, x, 0.0))  # from there on, the kernel
    assert kernels.select_kept(x.double(), keep) is None  # float32 only
    assert kernels.select_kept(x.transpose(-1, -2), keep.transpose(-1, -2)) is None  # contiguous maps only
    assert kernels.select_kept(x, keep.float()) is None  # bool masks only
    assert kernels.select_kept(x, torch.rand(3, 1, 5, 8) > 0.5) is None  # does not broadcast
    assert kernels.select_kept(x, keep.transpose(-1, -2).contiguous().transpose(-1, -2)) is None  # strided keys
    assert kernels.select_kept(x, torch.rand(2, 3, 5, 1) > 0.5) is None  # broadcast over the keys
    assert kernels.select_kept(x, keep, out=torch.empty(2, 3, 5, 8).transpose(-1, -2)) is None


def test_select_kept_falls_back_to_torch_with_the_same_numbers(monkeypatch):
    """Without a kernel that takes them (none registered, or under autograd), the core's masked passes run as
    torch operations: the same numbers."""
    torch.manual_seed(0)
    x, keep = torch.randn(2, 3, 5, 8), torch.rand(2, 3, 5, 8) > 0.3
    monkeypatch.setattr(binding, "SELECT_KEPT_MIN_ENTRIES", 0)
    fused = convolution.select_kept(x, keep, 1 / 0.9)
    monkeypatch.setattr(registry, "FUSED_KERNELS", [])
    for scale, fill in ((1 / 0.9, 0.0), (1.0, 0.0), (1.0, -5.0)):
        assert torch.equal(convolution.select_kept(x, keep, scale, fill), torch.where(keep, scale * x, fill))
    assert torch.equal(convolution.select_kept(x, keep, 1 / 0.9), fused)
    out = x.clone()
    assert convolution.select_kept(out, keep, 1 / 0.9, out=out) is out and torch.equal(out, fused)


@needs_compiler
@pytest.mark.parametrize(
    ("batch", "heads", "rows", "kernel_rows", "row_shift"),
    [(2, 12, 9, 3, -1), (3, 4, 5, 5, -2), (1, 3, 2, 3, -1), (2, 4, 7, 2, -1)],
)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_in_place_output_equals_a_separate_one(batch, heads, rows, kernel_rows, row_shift, threads):
    """Writing over the input (inference) gives bit-identical results, also where threads meet (rows a
    neighbour has already overwritten are read from copies)."""
    torch.manual_seed(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, end = torch.randn(batch, heads, rows, 37), torch.randn(batch, heads, rows, 37)
        weight, bias = torch.randn(heads, heads, kernel_rows, 3), torch.randn(heads)
        keep = (torch.rand(batch, 1, rows, 37) > 0.2).float()
        options = dict(row_shift=row_shift, lerp_end=end, lerp_weight=0.3, in_keep=keep, relu=True, blend_coef=0.6)
        separate = binding.correlate(x, weight, bias, blend=x, **options)
        overwritten = x.clone()
        result = binding.correlate(overwritten, weight, bias, blend=overwritten, in_place=True, **options)
    finally:
        torch.set_num_threads(before)
    assert result.data_ptr() == overwritten.data_ptr()
    assert torch.equal(result, separate)


#: (batch, heads, rows, kernel_rows, context_rows) of the backward tests where threads meet.
BACKWARD_SHAPES = [(2, 12, 9, 3, 1), (3, 4, 5, 5, 2), (1, 3, 2, 3, 1), (2, 4, 7, 2, 1)]


@needs_compiler
@pytest.mark.parametrize(("batch", "heads", "rows", "kernel_rows", "context_rows"), BACKWARD_SHAPES)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_spent_maps_take_the_results_bit_identically(batch, heads, rows, kernel_rows, context_rows, threads):
    """What the attention core does to allocate fewer maps: the forward step writes A_logit over S and still
    keeps the gate; backward writes the gradient of S over the incoming gradient (rows a neighbouring thread
    has overwritten are read from copies) and that of A_prev into a spent map. Same bits as new maps."""
    torch.manual_seed(0)
    scores, previous, grad, spent = (torch.randn(batch, heads, rows, 37) for _ in range(4))
    keep = (torch.rand(batch, 1, rows, 37) > 0.2).float()
    weight, bias = torch.randn(heads, heads, kernel_rows, 3) * 0.3, torch.randn(heads) * 0.1
    step = EvolutionStep(0.3, 0.4, context_rows)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        logits, gate = kernels.evolve(step, StepMaps(scores, previous, keep), weight, bias, in_place=False)
        overwritten = scores.clone()
        maps = StepMaps(overwritten, previous, keep)
        logits_over, gate_over = kernels.evolve(step, maps, weight, bias, in_place=True, gate=True)
        maps = StepMaps(scores, previous, keep)
        expected = kernels.backward(step, maps, GradientIn(grad), gate, weight)
        consumed = grad.clone()
        got = binding.backward_pass(step, maps, GradientIn(consumed), gate, weight, into=(consumed, spent))
    finally:
        torch.set_num_threads(before)
    assert logits_over.data_ptr() == overwritten.data_ptr()
    assert torch.equal(logits_over, logits) and torch.equal(gate_over, gate)
    assert got[0].data_ptr() == consumed.data_ptr() and got[1].data_ptr() == spent.data_ptr()
    for got_one, expected_one in zip(got, expected, strict=True):
        assert torch.equal(got_one, expected_one)


@needs_compiler
@pytest.mark.parametrize(("batch", "heads", "rows", "kernel_rows", "context_rows"), BACKWARD_SHAPES)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_second_incoming_gradient_is_added_as_rows_are_read(batch, heads, rows, kernel_rows, context_rows, threads):
    """The next layer's gradient of A_logit (through its A_prev), given as ``addend``: the same bits as adding
    it to the incoming gradient first, also with the gradient of S written over the incoming one (rows a
    neighbouring thread has overwritten are read from copies); the addend itself is left as it was."""
    torch.manual_seed(1)
    scores, previous, grad, second, spent = (torch.randn(batch, heads, rows, 37) for _ in range(5))
    keep = (torch.rand(batch, 1, rows, 37) > 0.2).float()
    weight = torch.randn(heads, heads, kernel_rows, 3) * 0.3
    gate = torch.rand(batch, heads, rows, 37) > 0.4
    step, maps = EvolutionStep(0.3, 0.4, context_rows), StepMaps(scores, previous, keep)
    kept_second = second.clone()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        expected = kernels.backward(step, maps, GradientIn(grad + second), gate, weight)
        consumed = grad.clone()
        incoming = GradientIn(consumed, second)
        got = binding.backward_pass(step, maps, incoming, gate, weight, into=(consumed, spent))
    finally:
        torch.set_num_threads(before)
    assert got[0].data_ptr() == consumed.data_ptr() and torch.equal(second, kept_second)
    for got_one, expected_one in zip(got, expected, strict=True):
        assert torch.equal(got_one, expected_one)


@needs_compiler
def test_maps_that_backward_reads_are_never_written():
    """A spent map that overlaps S or A_prev (which backward reads while it writes) is not used."""
    torch.manual_seed(0)
    scores, previous, grad = (torch.randn(1, 4, 6, 8) for _ in range(3))
    weight = torch.randn(4, 4, 3, 3)
    gate = torch.rand(1, 4, 6, 8) > 0.5
    step, maps = EvolutionStep(0.3, 0.4, 1), StepMaps(scores, previous, None)
    expected = kernels.backward(step, maps, GradientIn(grad), gate, weight)
    kept = scores.clone(), previous.clone()
    got = binding.backward_pass(step, maps, GradientIn(grad), gate, weight, into=(scores, previous))
    assert torch.equal(scores, kept[0]) and torch.equal(previous, kept[1])
    assert got[0].data_ptr() != scores.data_ptr() and got[1].data_ptr() != previous.data_ptr()
    for got_one, expected_one in zip(got, expected, strict=True):
        assert torch.equal(got_one, expected_one)


@needs_compiler
@pytest.mark.parametrize(("alpha", "with_previous"), [(0.3, True), (0.0, True), (0.3, False)])
def test_a_shared_map_holds_both_gradients(alpha, with_previous):
    """``shared_map``: one map is written, A_prev's gradient (the same bits as the two-map call's), and S's is
    that map times (1 - alpha) / alpha; with alpha = 0 the map is S's gradient and A_prev gets none."""
    torch.manual_seed(2)
    scores, previous, grad = (torch.randn(2, 12, 9, 37) for _ in range(3))
    keep = (torch.rand(2, 1, 9, 37) > 0.2).float()
    weight, gate = torch.randn(12, 12, 3, 3) * 0.3, torch.rand(2, 12, 9, 37) > 0.4
    step, maps = EvolutionStep(alpha, 0.4, 1), StepMaps(scores, previous if with_previous else None, keep)
    expected = kernels.backward(step, maps, GradientIn(grad), gate, weight)
    consumed = grad.clone()
    got = kernels.backward(step, maps, GradientIn(consumed, spent=True), gate, weight, shared_map=True)
    scores_gradient, previous_gradient = got[0], got[1]
    assert isinstance(scores_gradient, ea_hf.modeling.step.ScaledMap)
    assert scores_gradient.map.data_ptr() == consumed.data_ptr()  # written over the spent incoming gradient
    scale_expected = (1.0 - alpha) / alpha if with_previous and alpha else 1.0
    assert scores_gradient.scale == pytest.approx(scale_expected)
    torch.testing.assert_close(scores_gradient.scale * scores_gradient.map, expected[0], rtol=1e-6, atol=1e-6)
    if with_previous and alpha:
        assert previous_gradient is scores_gradient.map and torch.equal(previous_gradient, expected[1])
    else:
        assert previous_gradient is None
    for got_one, expected_one in zip(got[2:], expected[2:], strict=True):
        assert torch.equal(got_one, expected_one)


def operator_samples(requires_grad: bool):
    """Arguments of ``ea_hf::evolve_with_gate_bits`` (beta-scaled kernel, blend = 1 - beta): with and without
    A_prev and a padding mask, centred and causal kernels."""
    torch.manual_seed(3)
    samples = []
    for previous, masked, kernel_rows in [(True, True, 3), (False, False, 3), (True, False, 2), (False, True, 2)]:
        scores = torch.randn(2, 4, 6, 7, requires_grad=requires_grad)
        end = torch.randn(2, 4, 6, 7, requires_grad=requires_grad) if previous else None
        keep = (torch.rand(2, 1, 6, 7) > 0.3).float() if masked else None
        weight = (torch.randn(4, 4, kernel_rows, 3) * 0.3).requires_grad_(requires_grad)
        bias = (torch.randn(4) * 0.1).requires_grad_(requires_grad)
        samples.append((scores, end, keep, weight, bias, 0.3, 0.6, 1))
    return samples


@needs_compiler
@pytest.mark.parametrize("requires_grad", [True, False])
def test_the_operators_pass_opcheck(requires_grad):
    """Schemas, fake (meta) implementations, the autograd registration and AOT dispatch of every operator."""
    for scores, end, keep, weight, bias, alpha, blend, rows in operator_samples(requires_grad):
        arguments = (scores, end, keep, weight, bias, alpha, blend, rows)
        torch.library.opcheck(torch.ops.ea_hf.evolve_with_gate_bits.default, arguments)
        detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in arguments)
        torch.library.opcheck(torch.ops.ea_hf.evolve_.default, (detached[0].clone(), *detached[1:]))
        torch.library.opcheck(torch.ops.ea_hf.convolve.default, (detached[0], detached[3], detached[4], -rows))
        logits, gate = torch.ops.ea_hf.evolve_with_gate_bits(*detached)
        backward_arguments = (detached[0], detached[1], keep, torch.randn_like(logits), gate, detached[3])
        backward_operator = torch.ops.ea_hf.evolve_backward_one_map.default
        torch.library.opcheck(backward_operator, (*backward_arguments, alpha, blend, rows))


@needs_compiler
def test_outside_compilation_the_operator_bodies_run_directly():
    """Inference (``evolve`` in place) and decoding (``convolve``) call the kernel without dispatching the custom
    operators, whose Python dispatch cost a decoding step as much as the correlation itself: the same bits as the
    operators, also where S is not contiguous (written back over it)."""
    for scores, end, keep, weight, bias, alpha, blend, rows in operator_samples(False):
        step = EvolutionStep(alpha, 1.0 - blend, rows)
        for given in (scores, scores.transpose(-1, -2).contiguous().transpose(-1, -2)):
            expected = given.clone()
            torch.ops.ea_hf.evolve_(expected, end, keep, weight, bias, alpha, blend, rows)
            direct = given.clone()
            with torch.profiler.profile() as profile:
                logits, gate = kernels.evolve(step, StepMaps(direct, end, keep), weight, bias, in_place=True)
                convolved = kernels.convolve(scores, weight, bias, row_shift=-rows)
            assert logits is direct and gate is None and torch.equal(direct, expected)
            assert torch.equal(convolved, torch.ops.ea_hf.convolve(scores, weight, bias, -rows))
            assert not {event.name for event in profile.events()} & {"ea_hf::evolve_", "ea_hf::convolve"}


@needs_compiler
@pytest.mark.parametrize(("sample", "alpha"), [(0, None), (1, None), (2, None), (3, None), (0, 0.0), (2, 1.0)])
def test_the_evolve_operator_differentiates_like_the_torch_formulation(sample, alpha):
    """``ea_hf::evolve_with_gate_bits`` with its registered autograd against autograd through the same steps as torch
    operations (float32, so 1e-5); also at alpha = 0 and 1, where the one gradient map of backward is G_in."""
    scores, end, keep, weight, bias, sample_alpha, blend, rows = operator_samples(True)[sample]
    alpha = sample_alpha if alpha is None else alpha
    upstream = torch.randn(scores.shape)
    leaves = [t for t in (scores, end, weight, bias) if t is not None]
    options = dict(lerp_end=end, lerp_weight=alpha, in_keep=keep, relu=True, blend=scores, blend_coef=blend)
    ours = torch.ops.ea_hf.evolve_with_gate_bits(scores, end, keep, weight, bias, alpha, blend, rows)[0]
    reference = correlate_with_torch(scores, weight, bias, -rows, **options)[0]
    for got, expected in zip(
        [ours.detach(), *torch.autograd.grad(ours, leaves, upstream)],
        [reference.detach(), *torch.autograd.grad(reference, leaves, upstream)],
        strict=True,
    ):
        assert (got - expected).abs().max() <= 1e-5 * max(1.0, expected.abs().max().item())


def masked_tail_keep(kind: str, batch: int = 2, length: int = 200) -> torch.Tensor:
    """[B, 1, Q, K] masks whose rows end in masked tails: "causal" (row i keeps columns 0..i), "padded" (the
    second example's keys from 120 on masked, and its padding query rows from 120 on without a kept column) or
    "left-padded causal" (causal, the second example's first 60 tokens padding: their rows and columns masked)."""
    if kind == "causal":
        return torch.ones(length, length).tril().expand(batch, 1, length, length).contiguous()
    if kind == "left-padded causal":
        keep = masked_tail_keep("causal", batch, length)
        keep[1:, :, :, :60] = 0
        keep[1:, :, :60, :] = 0
        return keep
    keep = torch.ones(batch, 1, length, length)
    keep[1:, :, :, 120:] = 0
    keep[1:, :, 120:, :] = 0
    return keep


def tail_starts(keep: torch.Tensor) -> torch.Tensor:
    """[B, 1, Q, 1]: where the kernel's correlation of each row stops when masked tails are skipped: after the
    row's last kept column, rounded up to 64 columns (at most all of them); all columns for rows without one."""
    cols = keep.shape[-1]
    columns = torch.arange(1, cols + 1).expand_as(keep)
    last = (columns * (keep != 0)).amax(-1, keepdim=True)
    rounded = ((last + 63) // 64 * 64).clamp(max=cols)
    return torch.where(last == 0, cols, rounded)


def with_threads(threads: int, function, *args, **kwargs):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return function(*args, **kwargs)
    finally:
        torch.set_num_threads(before)


def record_skipped_tails(monkeypatch) -> list[int]:
    """Spies on ``binding.correlate``: for each call asked to skip masked tails (with a mask), the number of
    rows that have a tail to skip, appended to the returned list."""
    calls: list[int] = []
    correlate = binding.correlate

    def spying_correlate(*args, skip_masked_tails=False, **kwargs):
        keep = kwargs.get("in_keep")
        if skip_masked_tails and keep is not None:
            shape = (args[0].shape[0], 1, *keep.shape[-2:])
            calls.append(int((tail_starts(keep.float().expand(shape)) < keep.shape[-1]).sum()))
        return correlate(*args, skip_masked_tails=skip_masked_tails, **kwargs)

    monkeypatch.setattr(binding, "correlate", spying_correlate)
    return calls


@needs_compiler
@pytest.mark.parametrize("kind", ["causal", "padded"])
@pytest.mark.parametrize("heads", [4, 3])  # specialised (Winograd's form on AVX-512) and the generic code
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("in_place", [False, True])
def test_skipped_masked_tails_leave_every_other_output_bit_identical(kind, heads, threads, in_place):
    """With ``skip_masked_tails`` each row's correlation stops after its last kept column (rounded up to 64):
    before that every output and gate bit is the full correlation's, bit for bit (the threads split the rows by
    their work); from there on the gate is 0 and the output 0, or in place the input left as it was."""
    torch.manual_seed(0)
    keep = masked_tail_keep(kind)
    x, end = torch.randn(2, heads, *keep.shape[-2:]), torch.randn(2, heads, *keep.shape[-2:])
    weight, bias = torch.randn(heads, heads, 2 if kind == "causal" else 3, 3), torch.randn(heads)
    options = dict(row_shift=-1, lerp_end=end, lerp_weight=0.3, in_keep=keep, relu=True, blend_coef=0.6)
    full_gate, skipped_gate = packed_gate(x), packed_gate(x)
    full = with_threads(threads, binding.correlate, x, weight, bias, blend=x, saved=full_gate, **options)
    target = x.clone() if in_place else x
    skipped = with_threads(
        threads, binding.correlate, target, weight, bias, blend=target, saved=skipped_gate, in_place=in_place,
        skip_masked_tails=True, **options,
    )  # fmt: skip
    computed = (torch.arange(x.shape[-1]) < tail_starts(keep)).expand_as(x)
    tails = ~computed
    assert tails.float().mean() > 0.1  # the property is not vacuous: a tenth of the map or more is skipped
    assert torch.equal(skipped[computed], full[computed])
    assert torch.equal(skipped[tails], x[tails] if in_place else torch.zeros_like(x[tails]))
    full_bits, skipped_bits = unpacked_gate(full_gate, x.shape[-1]), unpacked_gate(skipped_gate, x.shape[-1])
    assert torch.equal(skipped_bits[computed], full_bits[computed]) and not skipped_bits[tails].any()
    assert full_bits[tails].any()  # the full correlation's gate is not 0 there


@needs_compiler
@pytest.mark.parametrize("kind", ["causal", "padded"])
@pytest.mark.parametrize("threads", [1, 2])
def test_backward_with_masked_tails_is_the_gradient_where_the_softmax_masks_them(kind, threads):
    """Where the incoming gradient is 0 past each row's last kept column (as the softmax of every layer makes it),
    the backward of the skipping forward (its gate) is autograd's through the torch formulation (float64); the
    tails it skips stay 0 even when the incoming gradient there is not."""
    torch.manual_seed(1)
    heads, alpha, beta, context = 4, 0.25, 0.4, 1  # row i reads rows i - 1.. (causal: i - 1, i; else i - 1..i + 1)
    keep = masked_tail_keep(kind)
    kernel_rows = 2 if kind == "causal" else 3
    shape = (2, heads, *keep.shape[-2:])
    scores, previous, upstream = (torch.randn(shape, dtype=torch.float64) for _ in range(3))
    columns = torch.arange(shape[-1])
    past_last_kept = columns > (columns * keep).amax(-1, keepdim=True)
    past_last_kept &= keep.amax(-1, keepdim=True) > 0  # (rows without a kept column are correlated whole)
    upstream = upstream.masked_fill(past_last_kept, 0.0)
    weight = torch.randn(heads, heads, kernel_rows, 3, dtype=torch.float64) * 0.3
    bias = torch.randn(heads, dtype=torch.float64) * 0.1
    s, p, w, b = (t.clone().requires_grad_() for t in (scores, previous, weight, bias))
    a_in = torch.lerp(s, p, alpha)
    convolved, _ = correlate_with_torch(a_in, w, b, -context, in_keep=keep, relu=True)
    ((convolved + (1 - beta) * a_in) * upstream).sum().backward()
    step = EvolutionStep(alpha, beta, context, skip_masked_tails=True)
    maps = StepMaps(scores.float().clone(), previous.float(), keep)
    _, gate = kernels.evolve(step, maps, weight.float(), bias.float(), in_place=True, gate=True)
    maps = StepMaps(scores.float(), previous.float(), keep)
    grads = with_threads(threads, kernels.backward, step, maps, GradientIn(upstream.float()), gate, weight.float())
    for got, want in zip(grads, [s.grad, p.grad, w.grad, b.grad], strict=True):
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    noisy = upstream.float().masked_fill(past_last_kept, 1.0)
    grad_scores = kernels.backward(step, maps, GradientIn(noisy), gate, weight.float())[0]
    assert not grad_scores.masked_select(columns >= tail_starts(keep)).any()


# Padded query rows of an encoder (3 and 5 kernel rows) and of a left-padded decoder (2 rows, causal).
BIAS_ONLY_CASES = [("padded", 3, 1), ("padded", 5, 2), ("left-padded causal", 2, 1)]


@needs_compiler
@pytest.mark.parametrize(("kind", "kernel_rows", "context_rows"), BIAS_ONLY_CASES)
@pytest.mark.parametrize("heads", [4, 3])  # specialised (Winograd's form on AVX-512) and the generic code
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("skip_masked_tails", [False, True])
def test_rows_that_read_only_padding_rows_give_the_bits_of_their_correlation(
    kind, kernel_rows, context_rows, heads, threads, skip_masked_tails, every_row_library
):
    """An output row whose input rows are all padding queries' rows (masked whole) takes the bias alone for its
    correlation, and an input-gradient row masked whole nothing: the forward's logits and gate bits and the
    backward's gradient maps are the bits of the build that computes every product; so are the weight and bias
    gradients with one thread (more threads split the rows by their work, differently: within 1e-5)."""
    torch.manual_seed(2)
    keep = masked_tail_keep(kind)
    shape = (2, heads, *keep.shape[-2:])
    scores, previous, upstream = (torch.randn(shape) for _ in range(3))
    weight, bias = torch.randn(heads, heads, kernel_rows, 3) * 0.3, torch.randn(heads) * 0.3

    evolution = EvolutionStep(0.3, 0.4, context_rows, skip_masked_tails=skip_masked_tails)

    def step(library):
        with kernels.using_library(library):
            logits, gate = with_threads(
                threads, kernels.evolve, evolution, StepMaps(scores.clone(), previous, keep), weight, bias,
                in_place=True, gate=True,
            )  # fmt: skip
            maps = StepMaps(scores, previous, keep)
            grads = with_threads(threads, kernels.backward, evolution, maps, GradientIn(upstream), gate, weight)
        return logits, gate, grads

    (logits, gate, grads), (every_logits, every_gate, every_grads) = step(kernels.cpu_kernel()), step(every_row_library)
    assert torch.equal(logits, every_logits) and torch.equal(gate, every_gate)
    assert torch.equal(grads[0], every_grads[0]) and torch.equal(grads[1], every_grads[1])
    for got, want in zip(grads[2:], every_grads[2:], strict=True):
        assert torch.equal(got, want) if threads == 1 else (got - want).abs().max() <= 1e-5 * want.abs().max()


@needs_compiler
@pytest.mark.parametrize(("kind", "kernel_rows", "context_rows"), BIAS_ONLY_CASES)
def test_exactly_the_rows_that_read_only_padding_rows_skip_their_products(
    kind, kernel_rows, context_rows, every_row_library
):
    """Which rows skip their products, seen where it shows: with a NaN weight every product of output head 0 is
    NaN, and the ReLU makes a NaN correlation 0 (NaN > 0 is false), so head 0's logits are the blend alone in a
    row that computes its products and the blend plus ReLU(bias) = 1 in one that skips them. Those are exactly
    the rows whose every input row (rows i - context_rows .. i - context_rows + kernel_rows - 1) is a padding
    query's or outside the map; the build that computes every product has none."""
    keep = masked_tail_keep(kind)
    heads, rows = 4, keep.shape[-2]
    scores, previous = torch.randn(2, heads, rows, rows), torch.randn(2, heads, rows, rows)
    weight, bias = torch.randn(heads, heads, kernel_rows, 3), torch.ones(heads)
    weight[0, 0, 0, 0] = float("nan")
    padding = keep.amax(-1).squeeze(1) == 0  # [B, Q]: rows without a kept column
    outside = torch.ones(2, kernel_rows, dtype=torch.bool)
    reads_only_padding = torch.cat([outside[:, :context_rows], padding, outside[:, context_rows + 1 :]], dim=1)
    expected = reads_only_padding.unfold(1, kernel_rows, 1).all(-1)  # [B, Q]
    assert 40 <= int(expected.sum()) <= int(padding.sum())
    blend = 0.6 * torch.lerp(scores[:, 0], previous[:, 0], 0.3)
    rows_with_bias = []
    for library in (kernels.cpu_kernel(), every_row_library):
        with kernels.using_library(library):
            maps = StepMaps(scores.clone(), previous, keep)
            logits, _ = kernels.evolve(EvolutionStep(0.3, 0.4, context_rows), maps, weight, bias, in_place=True)
        correlation = logits[:, 0] - blend
        with_bias = ((correlation - 1).abs() < 1e-5).all(-1)
        assert (with_bias | (correlation.abs() < 1e-5).all(-1)).all()  # every row one or the other
        rows_with_bias.append(with_bias)
    assert torch.equal(rows_with_bias[0], expected)
    assert not rows_with_bias[1].any()


@needs_compiler
@pytest.mark.parametrize(
    ("family", "skips"),
    # causal; causal with sliding-window layers (chains of their own); padded keys; local and global layers in
    # one chain (a global layer reads a local layer's logits right of its window: no skipping there)
    [("llama", True), ("qwen2", True), ("bert", True), ("modernbert", False)],
)
def test_skipping_masked_tails_changes_no_output_or_gradient_of_a_model(family, skips, monkeypatch):
    """A model's outputs (inference) and a training step's loss and gradients are those of the kernel without
    skipping (within float rounding: the tails feed no output), on 150 tokens, where causal rows and padded keys
    leave tails of 64 columns and more; the kernel was asked to skip such tails forward (and backward) wherever
    every layer of the chain has the same mask, and nowhere else."""
    model_type, overrides = CAUSAL_LM_FAMILIES.get(family, (family, {}))
    head = AutoModel if family in ("bert", "modernbert") else AutoModelForCausalLM
    model = ea_hf.patch(tiny_model(model_type, head, max_position_embeddings=256, **overrides), alpha=0.4, beta=0.5)
    evolutions = [m for m in model.modules() if isinstance(m, AttentionMapEvolution)]
    assert evolutions and all(e.skip_masked_tails == skips for e in evolutions)
    length = 150
    input_ids = torch.randint(5, VOCAB_SIZE, (2, length), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones(2, length, dtype=torch.long)
    attention_mask[1, 100:] = 0  # a padded second example (right padding)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    real = attention_mask.bool()

    def run(train: bool):
        model.train(train)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)  # the same dropout masks in every training step
        with torch.set_grad_enabled(train):
            output = model(**inputs)
            values = (output.last_hidden_state if head is AutoModel else output.logits)[real]
            if not train:
                return values, []
            values.pow(2).mean().backward()
        return values.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    backward_asked: list[bool] = []
    correlate, backward = binding.correlate, binding.backward_pass

    def spying_backward(step, *args, **kwargs):
        backward_asked.append(step.skip_masked_tails)
        return backward(step, *args, **kwargs)

    rows_with_tails = record_skipped_tails(monkeypatch)
    monkeypatch.setattr(binding, "backward_pass", spying_backward)
    skipped = [run(False), run(True)]
    # Every evolved layer, in inference and training, had tails to skip, forward and backward (or none was asked).
    asked = [rows > 0 for rows in rows_with_tails]
    assert (asked and all(asked) and backward_asked and all(backward_asked)) if skips else not any(backward_asked)
    assert skips or not asked
    monkeypatch.setattr(binding, "correlate", correlate)
    monkeypatch.setattr(binding, "backward_pass", backward)
    for evolution in evolutions:
        monkeypatch.setattr(evolution, "skip_masked_tails", False)
    whole = [run(False), run(True)]
    for (values, gradients), (expected, expected_gradients) in zip(skipped, whole, strict=True):
        assert (values - expected).abs().max() <= 1e-5 * max(1.0, expected.abs().max().item())
        for got, want in zip(gradients, expected_gradients, strict=True):
            assert (got - want).abs().max() <= 1e-5 * max(1.0, want.abs().max().item())


@needs_compiler
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_cached_generation_after_a_prompt_with_skipped_tails_is_exact(family, monkeypatch):
    """Generating from 100-token left-padded prompts, whose prefill skips the causal tails (checked), gives with
    the KV cache the tokens, logits and scores it gives without it (each step then a full forward)."""
    model_type, overrides = CAUSAL_LM_FAMILIES[family]
    model = ea_hf.patch(
        tiny_model(model_type, AutoModelForCausalLM, max_position_embeddings=256, **overrides), alpha=0.4, beta=0.5
    )
    skipped_rows = record_skipped_tails(monkeypatch)
    cached_and_uncached_generation(model, left_padded_inputs(batch=2, length=100))
    assert max(skipped_rows) > 0

"""The memory-lean attention core (one autograd node per layer) against the unfused layer and the paper's
equations: outputs, every gradient, dropout, gradcheck, what it keeps for backward, and whole models."""

import operator

import pytest
import torch
import transformers
from testing import ALL_ARCHITECTURES, defined, first_output, patched_model, table, tiny_config, tiny_inputs
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

import ea_hf
from ea_hf.modeling import attention_core, attention_tail, kernels
from ea_hf.modeling import compiled as compiled_module
from ea_hf.modeling.attention_core import CoreConstants, CoreMasks, EvolvingAttentionCore
from ea_hf.modeling.attention_tail import attend_values, masked_logits
from ea_hf.modeling.compiled import compiled_core
from ea_hf.modeling.evolution import AttentionMapEvolution
from ea_hf.modeling.masks import AttentionMask
from ea_hf.modeling.scores import (
    attention_scores,
    contiguous_query,
    exact_scaling,
    keeps_small_maps,
    scores_backward,
)
from ea_hf.ops.cpu import binding as cpu_binding

B, H, D = 2, 3, 5


def layer_inputs(role: str, dtype=torch.float32, queries: int = 9, seed: int = 0):
    """Queries, keys, values, A_prev and a positional bias (all requiring grad), and a padding mask as the
    attention function gets it: the allowed entries, and where the convolution may read."""
    generator = torch.Generator().manual_seed(seed)
    keys = queries if role != "cross" else queries + 3

    def leaf(*shape):
        return torch.randn(*shape, generator=generator, dtype=dtype).requires_grad_()

    q, k, v = leaf(B, H, queries, D), leaf(B, H, keys, D), leaf(B, H, keys, D)
    previous, position_bias = leaf(B, H, queries, keys), leaf(1, H, queries, keys)
    valid = torch.ones(B, keys, dtype=torch.bool)
    valid[1, keys - 3 :] = False
    allowed = valid[:, None, None, :].expand(B, 1, queries, keys)
    if role == "decoder":
        allowed = allowed & torch.ones(queries, keys, dtype=torch.bool).tril()
    conv_mask = allowed & valid[:, None, :queries, None] if role != "cross" else allowed
    return (q, k, v, previous, position_bias), allowed, conv_mask


def unfused_layer(evolution, q, k, v, previous, position_bias, allowed, additive, conv_mask, softcap, probs_mask):
    """The layer as the paper's equations, one tensor operation each (AttentionMapEvolution.reference)."""
    scores = attention_scores(q, k, D**-0.5, position_bias, softcap)
    logits = evolution.reference(scores, conv_mask, {(evolution.role, 0): previous})
    probabilities = torch.softmax(masked_logits(logits, AttentionMask(allowed, additive)), dim=-1)
    if probs_mask is not None:  # dropout, with the mask the core drew
        probabilities = probabilities * probs_mask / (1.0 - DROPOUT)
    return probabilities @ v, logits, probabilities


DROPOUT = 0.3


@pytest.fixture(params=["kept", "recomputed"])
def scores_path(request, monkeypatch):
    """Run a test with S and P kept for backward where the core keeps them (maps no larger than the keys and
    values, as in these tests) and with both recomputed in backward everywhere."""
    if request.param == "recomputed":
        monkeypatch.setattr(attention_core, "keeps_small_maps", lambda *arguments: False)
    return request.param


def run_core(evolution, q, k, v, previous, position_bias, allowed, additive, conv_mask, softcap, dropout=0.0):
    constants = CoreConstants(evolution.step, D**-0.5, softcap, dropout)
    masks = CoreMasks(conv_mask, AttentionMask(allowed, additive))
    return EvolvingAttentionCore.apply(
        constants, masks, q, k, v, previous, position_bias, evolution.weight, evolution.bias
    )


def outputs_and_gradients(function, leaves, evolution, generator_seed=5, used=(0, 1, 2)):
    """The three outputs and the gradients of every input and parameter (None: none flows to it), for a fixed
    random upstream on the ``used`` outputs."""
    outputs = function()
    generator = torch.Generator().manual_seed(generator_seed)
    upstream = [torch.randn(o.shape, generator=generator, dtype=o.dtype) for o in outputs]
    parameters = [evolution.weight, evolution.bias]
    used_outputs, used_upstream = [outputs[i] for i in used], [upstream[i] for i in used]
    grads = torch.autograd.grad(used_outputs, [*leaves, *parameters], used_upstream, allow_unused=True)
    return [o.detach() for o in outputs], list(grads)


def assert_close(got, expected, tolerance):
    for index, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert (a is None) == (b is None), index
        if b is None:
            continue
        scale = max(1.0, b.abs().max().item())
        assert (a - b).abs().max().item() <= tolerance * scale, index


@pytest.mark.parametrize("role", ["encoder", "decoder", "cross"])
@pytest.mark.parametrize("mask", ["none", "bool", "additive"])
@pytest.mark.parametrize("extras", ["plain", "position-bias-and-softcap"])
def test_core_matches_the_papers_equations_with_every_gradient(evolution_path, scores_path, role, mask, extras):
    torch.manual_seed(0)
    evolution = AttentionMapEvolution(H, alpha=0.3, beta=0.4, kernel_size=3, role=role, position=1, previous=0)
    leaves, allowed, conv_mask = layer_inputs(role)
    q, k, v, previous, position_bias = leaves
    softcap = 3.0 if extras != "plain" else None
    position_bias = position_bias if extras != "plain" else None
    additive = None
    if mask == "none":
        allowed = conv_mask = None
    elif mask == "additive":
        additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    arguments = (evolution, q, k, v, previous, position_bias, allowed, additive, conv_mask, softcap)
    used = [t for t in leaves if t is not None and (t is not leaves[4] or position_bias is not None)]
    core = outputs_and_gradients(lambda: run_core(*arguments), used, evolution)
    reference = outputs_and_gradients(lambda: unfused_layer(*arguments, None), used, evolution)
    assert_close(core[0], reference[0], 1e-5)
    assert_close(core[1], reference[1], 1e-5)


@pytest.mark.parametrize("mask", ["bool", "additive"])
def test_core_gradients_through_a_fully_masked_row(evolution_path, scores_path, mask):
    """A query row with every key masked (a left-padded decoder's padding rows) has uniform probabilities, and
    so a softmax gradient everywhere: a bool mask (masked_fill) passes none of it to the logits, an additive one
    passes all of it, as autograd through the unfused layer does."""
    torch.manual_seed(0)
    evolution = AttentionMapEvolution(H, alpha=0.3, beta=0.4, kernel_size=3, role="encoder", position=1, previous=0)
    leaves, allowed, conv_mask = layer_inputs("encoder")
    allowed, conv_mask = allowed.clone(), conv_mask.clone()
    allowed[1, :, 0, :] = conv_mask[1, :, 0, :] = False
    additive = None
    if mask == "additive":
        additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    q, k, v, previous, _ = leaves
    arguments = (evolution, q, k, v, previous, None, allowed, additive, conv_mask, None)
    used = [q, k, v, previous]
    core = outputs_and_gradients(lambda: run_core(*arguments), used, evolution)
    reference = outputs_and_gradients(lambda: unfused_layer(*arguments, None), used, evolution)
    assert torch.allclose(core[0][2][1, :, 0], torch.full((H, 9), 1 / 9))  # the row's uniform probabilities
    assert_close(core[0], reference[0], 1e-5)
    assert_close(core[1], reference[1], 1e-5)


@pytest.mark.parametrize(
    "used", [(0,), (0, 1), (1,), (2,), (1, 2)], ids=["output", "output+logits", "logits", "weights", "logits+weights"]
)
def test_core_gradients_when_only_some_outputs_carry_one(evolution_path, scores_path, used):
    """Outputs without a gradient reach backward as None (no map of zeros): the attention weights of a usual
    layer, the last layer's A_logit, or the output itself when only the maps are trained on."""
    torch.manual_seed(0)
    evolution = AttentionMapEvolution(H, alpha=0.3, beta=0.4, kernel_size=3, position=1, previous=0)
    leaves, allowed, conv_mask = layer_inputs("encoder")
    q, k, v, previous, _ = leaves
    arguments = (evolution, q, k, v, previous, None, allowed, None, conv_mask, None)
    core = outputs_and_gradients(lambda: run_core(*arguments), leaves[:4], evolution, used=used)
    reference = outputs_and_gradients(lambda: unfused_layer(*arguments, None), leaves[:4], evolution, used=used)
    assert_close(core[1], reference[1], 1e-5)
    assert (core[1][2] is None) == (0 not in used)  # the values get a gradient through the output alone


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_a_positional_bias_as_large_as_the_scores_leaves_the_other_gradients_alone(evolution_path, softcap):
    """A bias of S's own shape (batch 1) gets S's gradient as it is: autograd passes the map through, and on the
    CPU kernel that map is also A_prev's gradient (see ScaledMap), so scaling it for the bias must not change
    A_prev's. Every gradient within 1e-5 of the paper's equations."""
    torch.manual_seed(0)
    evolution = AttentionMapEvolution(H, alpha=0.3, beta=0.4, kernel_size=3, position=1, previous=0)
    generator = torch.Generator().manual_seed(1)
    shapes = [(1, H, 9, D)] * 3 + [(1, H, 9, 9)] * 2
    leaves = [torch.randn(*shape, generator=generator).requires_grad_() for shape in shapes]
    arguments = (evolution, *leaves, None, None, None, softcap)
    core = outputs_and_gradients(lambda: run_core(*arguments), leaves, evolution)
    reference = outputs_and_gradients(lambda: unfused_layer(*arguments, None), leaves, evolution)
    assert_close(core[1], reference[1], 1e-5)


def test_dropout_uses_one_mask_forward_and_backward(evolution_path, scores_path):
    """The dropped probabilities returned are P * mask / (1 - p), and the gradients use that same mask: with S
    and P kept, and recomputed in backward (where backward writes dO @ V^T over dropout(P)'s map, dropout's
    gradient in place and S over P's map). In fp64 on the torch path (exact to 1e-12), in fp32 on the kernel's."""
    torch.manual_seed(0)
    dtype, tolerance = (torch.float32, 1e-5) if evolution_path == "kernel" else (torch.float64, 1e-12)
    evolution = AttentionMapEvolution(H, alpha=0.3, beta=0.4, kernel_size=3, position=1, previous=0).to(dtype)
    leaves, allowed, conv_mask = layer_inputs("encoder", dtype=dtype)
    q, k, v, previous, _ = leaves
    arguments = (evolution, q, k, v, previous, None, allowed, None, conv_mask, None)
    core = outputs_and_gradients(lambda: run_core(*arguments, dropout=DROPOUT), leaves[:4], evolution)
    dropped = core[0][2]
    kept = dropped != 0
    assert 0.55 < kept[allowed.expand_as(kept)].double().mean() < 0.85  # about 1 - p of the allowed entries
    reference = outputs_and_gradients(lambda: unfused_layer(*arguments, kept), leaves[:4], evolution)
    assert_close(core[0], reference[0], tolerance)
    assert_close(core[1], reference[1], tolerance)


def test_attention_tail_drops_out_as_eager_attention_does_and_keeps_a_bool_mask():
    """attend_values draws the random numbers of ``torch.nn.functional.dropout`` (eager attention's), so a
    patched model with alpha = beta = 0 drops the same entries; its mask for backward is one byte a value."""
    length = 7
    logits, value = torch.randn(B, H, length, length), torch.randn(B, H, length, D)
    allowed = torch.rand(B, 1, length, length) > 0.3
    torch.manual_seed(3)
    attention_mask = AttentionMask(allowed)
    output, weights, probabilities, mask = attend_values(logits, attention_mask, value, DROPOUT)
    torch.manual_seed(3)
    eager = torch.nn.functional.dropout(masked_logits(logits, attention_mask).softmax(-1), DROPOUT, training=True)
    assert torch.equal(probabilities, masked_logits(logits, attention_mask).softmax(-1))
    assert torch.equal(weights, eager) and torch.equal(output, eager @ value)
    assert mask.dtype == torch.bool and torch.equal(mask & (probabilities != 0), eager != 0)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_dropout_outside_autograd_is_native_dropout_bit_for_bit(threads, kernel, monkeypatch):
    """The core's forward draws dropout's mask itself and applies it in one pass (dropout_with_mask): the mask and
    the bits of ``torch.native_dropout`` with the same seed, through the kernel's pass and through torch's."""
    if kernel:
        monkeypatch.setattr(cpu_binding, "SELECT_KEPT_MIN_ENTRIES", 0)
    else:
        monkeypatch.setattr(kernels, "FUSED_KERNELS", [])
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        weights = torch.rand(2, 3, 33, 70)
        torch.manual_seed(11)
        dropped, mask = attention_tail.dropout_with_mask(weights, DROPOUT)
        torch.manual_seed(11)
        expected, expected_mask = torch.native_dropout(weights, DROPOUT, True)
    finally:
        torch.set_num_threads(previous_threads)
    assert torch.equal(mask, expected_mask) and 0.6 < mask.float().mean() < 0.8
    assert torch.equal(dropped.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize(
    "mask_kind, into",
    [("allowed", False), ("allowed", True), ("additive", False), ("additive", True), ("beyond the logits", False)],
)
def test_masked_probabilities_written_in_place_are_the_masked_softmax_bit_for_bit(mask_kind, into, monkeypatch):
    """Outside autograd the mask is applied as it is written into P's map and the softmax runs in place there
    (no masked map of its own): the numbers of masking into a map of its own and taking the softmax of that, also
    into a given map. A mask that broadcasts beyond the logits' shape takes the plain path, with the same result."""
    length = 7
    logits = torch.randn(B, H, length, length)
    allowed = torch.rand(B, 1, length, length) > 0.3
    allowed[..., 0] = True  # no row fully masked
    additive = torch.where(allowed, 0.0, torch.finfo(logits.dtype).min) if mask_kind == "additive" else None
    if mask_kind == "beyond the logits":
        logits = logits[:1]  # [1, H, Q, K] logits and a [B, 1, Q, K] mask: P is [B, H, Q, K]
    before = logits.clone()
    mask = AttentionMask(allowed, additive)
    expected = torch.softmax(masked_logits(logits, mask), dim=-1)
    out = torch.full_like(expected, float("nan")) if into else None
    if mask_kind != "beyond the logits":  # the in-place path never builds the masked map: it masks into P's

        def into_probabilities_only(*arguments, out=None):
            if out is None:
                raise AssertionError("masked_logits without out: a map of masked logits was allocated")
            return masked_logits(*arguments, out=out)

        monkeypatch.setattr(attention_tail, "masked_logits", into_probabilities_only)
    with torch.no_grad():
        got = attention_tail.softmax_probabilities(logits, mask, out=out)
    assert got.shape == expected.shape and torch.equal(got, expected)
    assert got is out if into else got.data_ptr() != logits.data_ptr()
    assert torch.equal(logits, before)  # the logits are read, never written


def test_masked_probabilities_keep_their_autograd_graph():
    """With autograd recording, P is computed out of place: its gradient reaches the logits, none the masked
    entries."""
    logits = torch.randn(B, H, 5, 5, requires_grad=True)
    allowed = torch.rand(B, 1, 5, 5) > 0.3
    allowed[..., 0] = True
    probabilities = attention_tail.softmax_probabilities(logits, AttentionMask(allowed))
    (grad,) = torch.autograd.grad(probabilities, logits, torch.randn_like(probabilities))
    expected = torch.softmax(logits.detach().masked_fill(~allowed, torch.finfo(logits.dtype).min), -1)
    assert torch.equal(probabilities.detach(), expected)
    assert grad.abs().sum() > 0 and torch.all(grad.masked_select(~allowed.expand_as(grad)) == 0)


def compile_core(evolution, allowed, conv_mask, dropout=0.0):
    """:func:`compiled_core` for this layer through ``torch.compile(fullgraph=True)``, partitioned into forward
    and backward as inductor does (AOTAutograd's min-cut partitioner), and the maps its forward graph keeps for
    backward: among the graph's outputs after the layer's three, the [B, H, Q, ...] tensors it computes (not its
    inputs), as "operator dtype"."""
    kept: list[str] = []

    def record_kept(graph, example_inputs):
        returned = next(node for node in graph.graph.nodes if node.op == "output").args[0]
        layer_rows = (allowed.shape[0], H, allowed.shape[-2])  # [B, H, Q]
        for node in returned[3:]:
            value = node.meta["val"]
            if node.op != "placeholder" and value.dim() == 4 and tuple(value.shape[:3]) == layer_rows:
                producer = node.args[0] if node.target is operator.getitem else node  # an operator's output
                kept.append(f"{producer.target} {value.dtype}")
        return graph

    constants = CoreConstants(evolution.step, D**-0.5, None, dropout)
    masks = CoreMasks(conv_mask, AttentionMask(allowed))

    def layer(q, k, v, previous):
        return compiled_core(constants, masks, q, k, v, previous, None, evolution.weight, evolution.bias)

    torch._dynamo.reset()
    backend = aot_autograd(
        fw_compiler=record_kept, bw_compiler=lambda graph, _: graph, partition_fn=min_cut_rematerialization_partition
    )
    return torch.compile(layer, fullgraph=True, backend=backend), kept


@pytest.mark.skipif(
    cpu_binding.cpu_kernel() is None, reason="no C++ compiler: compiled_core checkpoints the CPU kernel only"
)
@pytest.mark.parametrize("role", ["encoder", "decoder", "cross"])
def test_compiled_core_keeps_one_map_and_matches_the_core(role):
    """Compiled, a layer whose maps are larger than its keys and values keeps A_logit (and the bit-packed gate)
    for backward and recomputes S and P, as the core does: its outputs and gradients are the core's within 1e-5.
    Small maps keep S as well, computed before the checkpoint, and recompute only P (A_logit, returned, stays
    alive as the next layer's A_prev either way)."""
    torch.manual_seed(0)
    evolution = AttentionMapEvolution(H, alpha=0.3, beta=0.4, kernel_size=3, role=role, position=1, previous=0)
    leaves, allowed, conv_mask = layer_inputs(role, queries=24)
    q, k, v, previous, _ = leaves
    assert not keeps_small_maps(q, k, None, None)
    compiled, kept = compile_core(evolution, allowed, conv_mask)
    got = outputs_and_gradients(lambda: compiled(q, k, v, previous), leaves[:4], evolution)
    arguments = (evolution, q, k, v, previous, None, allowed, None, conv_mask, None)
    expected = outputs_and_gradients(lambda: run_core(*arguments), leaves[:4], evolution)
    assert_close(got[0], expected[0], 1e-5)
    assert_close(got[1], expected[1], 1e-5)
    kernel = "ea_hf.evolve_with_gate_bits.default"
    assert kept == [f"{kernel} torch.float32", f"{kernel} torch.uint8"]  # A_logit and the bit-packed gate

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiled_module, "keeps_small_maps", lambda *arguments: True)
        compiled, kept = compile_core(evolution, allowed, conv_mask)
        small = outputs_and_gradients(lambda: compiled(q, k, v, previous), leaves[:4], evolution)
    assert sorted(kept) == [
        "aten.view.default torch.float32",  # S (the product's batched result, viewed)
        f"{kernel} torch.float32",
        f"{kernel} torch.uint8",
    ]
    assert_close(small[0], expected[0], 1e-5)
    assert_close(small[1], expected[1], 1e-5)


@pytest.mark.skipif(
    cpu_binding.cpu_kernel() is None, reason="no C++ compiler: compiled_core checkpoints the CPU kernel only"
)
@pytest.mark.parametrize("small_maps", [False, True], ids=["large-maps", "small-maps"])
def test_compiled_core_recomputes_around_one_dropout_mask(small_maps, monkeypatch):
    """Dropout inside the compiled checkpoint draws its mask once: backward uses the mask the returned weights
    show, as the paper's equations with that mask give (within 1e-5), and keeps it rather than drawing again."""
    monkeypatch.setattr(compiled_module, "keeps_small_maps", lambda *arguments: small_maps)
    torch.manual_seed(0)
    evolution = AttentionMapEvolution(H, alpha=0.3, beta=0.4, kernel_size=3, position=1, previous=0)
    leaves, allowed, conv_mask = layer_inputs("encoder", queries=24)
    q, k, v, previous, _ = leaves
    compiled, kept = compile_core(evolution, allowed, conv_mask, dropout=DROPOUT)
    got = outputs_and_gradients(lambda: compiled(q, k, v, previous), leaves[:4], evolution)
    dropped = got[0][2] != 0
    assert 0.55 < dropped[allowed.expand_as(dropped)].double().mean() < 0.85  # about 1 - p of the allowed entries
    arguments = (evolution, q, k, v, previous, None, allowed, None, conv_mask, None)
    reference = outputs_and_gradients(lambda: unfused_layer(*arguments, dropped), leaves[:4], evolution)
    assert_close(got[0], reference[0], 1e-5)
    assert_close(got[1], reference[1], 1e-5)
    assert "aten.native_dropout.default torch.bool" in kept


@pytest.mark.parametrize("scaling", [1.0, 0.125, 64**-0.5 * 0.9], ids=["one", "power-of-two", "other"])
@pytest.mark.parametrize("needs", [(True, True), (True, False), (False, True)], ids=["both", "query", "key"])
@pytest.mark.parametrize("prescaled", [False, True], ids=["query", "contiguous-query"])
def test_scores_backward_gives_autograd_gradients(scaling, needs, prescaled):
    """The gradients of Q and K from a kept S are autograd's through attention_scores, to the last bit, for each
    way it scales (the queries by a power of two, else the product), given the queries as they arrive (a view)
    or as the core keeps them (contiguous_query: contiguous, scaled where exact)."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 7, 3, 16, generator=generator).transpose(1, 2)  # a view, as projections give them
    key = torch.randn(2, 3, 9, 16, generator=generator)
    grad = torch.randn(2, 3, 7, 9, generator=generator)
    leaves = (query.clone().requires_grad_(needs[0]), key.clone().requires_grad_(needs[1]))
    wanted = [t for t in leaves if t.requires_grad]
    expected = iter(torch.autograd.grad(attention_scores(*leaves, scaling), wanted, grad))
    given, rest = contiguous_query(query, scaling) if prescaled else (query, scaling)
    assert torch.equal(attention_scores(given, key, rest), attention_scores(query, key, scaling))
    got = scores_backward(grad, given, key, scaling, needs, prescaled and exact_scaling(scaling))
    for need, gradient in zip(needs, got, strict=True):
        assert (gradient is None) != need
        if need:
            assert torch.equal(gradient, next(expected))


def test_kept_weights_returned_to_the_caller_survive_backward(evolution_path):
    """Where P is kept for backward it is also the attention weights returned: backward writes no gradient
    over it (the recomputed P of larger maps is backward's own to reuse)."""
    torch.manual_seed(0)
    evolution = AttentionMapEvolution(H, alpha=0.3, beta=0.4, kernel_size=3, position=1, previous=0)
    leaves, allowed, conv_mask = layer_inputs("encoder")
    q, k, v, previous, _ = leaves
    output, logits, weights = run_core(evolution, q, k, v, previous, None, allowed, None, conv_mask, None)
    assert keeps_small_maps(q, k, None, None)
    before = weights.detach().clone()
    (output.square().sum() + logits.square().sum()).backward()
    assert torch.equal(weights.detach(), before)


@pytest.mark.parametrize("role", ["encoder", "decoder"])
@pytest.mark.parametrize("softcap", [None, 2.0], ids=["scores-kept", "softcap-scores-recomputed"])
def test_core_passes_gradcheck(role, softcap):
    torch.manual_seed(0)
    evolution = AttentionMapEvolution(H, alpha=0.3, beta=0.4, kernel_size=3, role=role).double()
    leaves, allowed, conv_mask = layer_inputs(role, dtype=torch.float64, queries=5)
    q, k, v, previous, position_bias = leaves
    if softcap is None:  # S is kept (5 queries, 5-dimensional heads) only without a positional bias
        leaves = leaves[:4]
        position_bias = None
    assert keeps_small_maps(q, k, position_bias, softcap) == (softcap is None)

    def core(q, k, v, previous, *parameters):
        bias_or_none = parameters[0] if softcap is not None else None
        weight, bias = parameters[-2:]
        constants = CoreConstants(evolution.step, D**-0.5, softcap, 0.0)
        masks = CoreMasks(conv_mask, AttentionMask(allowed))
        return EvolvingAttentionCore.apply(constants, masks, q, k, v, previous, bias_or_none, weight, bias)

    assert torch.autograd.gradcheck(core, (*leaves, evolution.weight, evolution.bias))


def saved_bytes(model, inputs) -> int:
    """Bytes of the distinct storages that autograd keeps for backward after one forward pass."""
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        first_output(model(**inputs)).float().pow(2).mean()
    return sum(storages.values())


@pytest.mark.parametrize(
    "length, extra_maps",
    [(64, (0.03, 0.05)), (16, (1.55, 1.65))],
    ids=["recomputes-S-and-P-beyond-2-head-dims", "keeps-S-and-P-up-to-2-head-dims"],
)
def test_training_keeps_what_eager_keeps_plus_a_bit_a_value_or_S(monkeypatch, length, extra_maps):
    """Eager attention keeps P (one map per layer); the core keeps A_logit and a bit-packed gate instead (a
    32nd of a float map; a bool gate was a quarter). Where its
    maps are no larger than the keys and values (8-dimensional heads here: up to 16 tokens) it keeps S, P and
    the gate, and A_logit only as the next layer's A_prev (so half a map per layer here, of two layers). The
    unfused layer kept S, A_logit, the gate and P."""
    layers, heads, batch = 2, 4, 2
    config = tiny_config("bert", num_hidden_layers=layers, num_attention_heads=heads)
    assert config.hidden_size // heads == 8
    inputs = {"input_ids": torch.randint(5, 99, (batch, length))}
    # Eval mode (no dropout) with autograd on: what is kept for backward without dropout's masks.
    eager = transformers.AutoModel.from_config(config, attn_implementation="eager").eval()
    evolving = ea_hf.patch(transformers.AutoModel.from_config(config), alpha=0.3, beta=0.4).eval()
    map_bytes = batch * heads * length * length * 4
    extra = (saved_bytes(evolving, inputs) - saved_bytes(eager, inputs)) / (map_bytes * layers)
    assert extra_maps[0] <= extra <= extra_maps[1]  # the packed gate, the convolution's few weights (and S, P)
    monkeypatch.setattr(AttentionMapEvolution, "fuses_attention", lambda self, history: False)
    unfused_extra = (saved_bytes(evolving, inputs) - saved_bytes(eager, inputs)) / (map_bytes * layers)
    assert unfused_extra >= 1.2


@pytest.mark.parametrize("model_type", table(ALL_ARCHITECTURES))
def test_whole_models_train_the_same_through_the_core(model_type, scores_path, monkeypatch):
    """A training step of every architecture gives the same outputs and gradients through the core as through
    the unfused layers (padding, causal masks, cross attention, T5's position bias, Gemma's soft-capping), with S
    kept or recomputed."""
    model = patched_model(model_type, dict(alpha=0.3, beta=0.4))  # eval: no dropout, autograd on
    inputs = tiny_inputs(model_type)
    fused_calls = []
    fuses = AttentionMapEvolution.fuses_attention

    def step():
        model.zero_grad(set_to_none=True)
        output = first_output(model(**inputs))
        defined(model_type, inputs, output).float().pow(2).mean().backward()
        return output.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    def counting(*arguments):
        fused_calls.append(fuses(*arguments))
        return fused_calls[-1]

    monkeypatch.setattr(AttentionMapEvolution, "fuses_attention", counting)
    core_output, core_grads = step()
    assert fused_calls and all(fused_calls)
    monkeypatch.setattr(AttentionMapEvolution, "fuses_attention", lambda self, history: False)
    output, grads = step()
    assert (defined(model_type, inputs, core_output) - defined(model_type, inputs, output)).abs().max() <= 1e-5
    assert core_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert (core_grads[name] - grad).abs().max() <= 1e-5 * max(1.0, grad.abs().max().item()), name


def test_backward_hands_spent_maps_down_the_layers_and_keeps_none(monkeypatch):
    """Where S and P are recomputed, each layer's backward leaves its spent S map for the layer below to
    recompute P into (one fresh map a layer less): every layer but the top one takes a map the layer above left,
    the gradients are those of fresh maps bit for bit, and no map is left once the backward pass ends."""
    layers, length = 3, 32  # 8-dimensional heads: maps of 32 tokens are recomputed (keeps_small_maps)
    config = tiny_config("bert", num_hidden_layers=layers, num_attention_heads=4)
    model = ea_hf.patch(transformers.AutoModel.from_config(config), alpha=0.3, beta=0.4).eval()
    inputs = {"input_ids": torch.randint(5, 99, (2, length)), "attention_mask": torch.ones(2, length, dtype=torch.long)}
    inputs["attention_mask"][1, -5:] = 0
    left, taken, dicts = [], [], []
    leave, take = attention_core.leave_spare_map, attention_core.take_spare_map

    def leaving(spare_maps, spent):
        dicts.append(spare_maps)
        leave(spare_maps, spent)
        left.append(spent.data_ptr() if spare_maps else None)

    def taking(spare_maps, like):
        taken.append(take(spare_maps, like))
        return taken[-1]

    def gradients():
        model.zero_grad(set_to_none=True)
        model(**inputs).last_hidden_state.pow(2).mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    monkeypatch.setattr(attention_core, "leave_spare_map", leaving)
    monkeypatch.setattr(attention_core, "take_spare_map", taking)
    handed = gradients()
    assert len(left) == layers - 1 and None not in left  # every layer with a layer below left its S
    assert len(taken) == layers and taken[0] is None  # the top layer found none
    assert [m.data_ptr() for m in taken[1:]] == left
    assert all(d is dicts[0] and not d for d in dicts)  # one dict for the call, empty once the pass ended
    monkeypatch.setattr(attention_core, "leave_spare_map", lambda spare_maps, spent: None)
    fresh = gradients()
    assert handed.keys() == fresh.keys()
    assert all(torch.equal(handed[n], fresh[n]) for n in fresh)

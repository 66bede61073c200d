"""The attention function and the map evolution against an independent, loop-based reference."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertConfig, BertModel
from transformers.masking_utils import bidirectional_mask_function, causal_mask_function, padding_mask_function

import ea_hf
import ea_hf.modeling.attention as attention_module
import ea_hf.modeling.attention_core as attention_core
import ea_hf.modeling.map_reuse as map_reuse
from ea_hf.modeling.attention import CACHE_KWARG, evolving_attention_forward
from ea_hf.modeling.attention_tail import attend_values
from ea_hf.modeling.call_state import CHAIN_KWARG
from ea_hf.modeling.convolution import EvolveConvolution, weight_grad_by_convolution, weight_grad_by_taps
from ea_hf.modeling.evolution import AttentionMapEvolution
from ea_hf.modeling.history import CACHE_ATTRIBUTE, reorder_convolution_histories
from ea_hf.modeling.masks import AttentionMask, evolving_attention_mask, self_attention_conv_mask
from ea_hf.modeling.scores import attention_scores

B, H, N, D = 2, 3, 7, 5
TINY_BERT = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37)


def reference_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Cross-correlation written out as shifted sums: out[q, k] = b + sum w[r, c] x[q + r - p, k + c - p]."""
    k = weight.shape[-1]
    p = k // 2
    padded = torch.zeros(x.shape[0], x.shape[1], x.shape[2] + 2 * p, x.shape[3] + 2 * p, dtype=x.dtype)
    padded[:, :, p : p + x.shape[2], p : p + x.shape[3]] = x
    out = bias.view(1, -1, 1, 1).expand(x.shape[0], -1, x.shape[2], x.shape[3]).clone()
    for r in range(k):
        for c in range(k):
            window = padded[:, :, r : r + x.shape[2], c : c + x.shape[3]]
            out += torch.einsum("oi,biqk->boqk", weight[:, :, r, c], window)
    return out


def reference_chain(queries, keys, values, valid_tokens, weights, biases, alpha, beta, sinks=None):
    """Eqs. (1)-(2) of TPAMI section 3.1 for a whole chain, with padding zeroed before each convolution; with
    ``sinks`` (GPT-OSS), each head's sink logit is one more column of the softmax, after the evolution."""
    entry_valid = valid_tokens[:, None, :, None] & valid_tokens[:, None, None, :]
    previous, outputs, probabilities = None, [], []
    for q, k, v, w, b in zip(queries, keys, values, weights, biases, strict=True):
        scores = q @ k.transpose(-1, -2) / D**0.5
        a_in = scores if previous is None else alpha * previous + (1 - alpha) * scores
        a_logit = beta * torch.relu(reference_conv(a_in * entry_valid, w, b)) + (1 - beta) * a_in
        previous = a_logit
        masked = a_logit.masked_fill(~valid_tokens[:, None, None, :], torch.finfo(a_logit.dtype).min)
        if sinks is None:
            probs = masked.softmax(-1)
        else:
            column = sinks.view(1, -1, 1, 1).expand(*masked.shape[:-1], 1)
            probs = torch.cat([masked, column], -1).softmax(-1)[..., :-1]
        probabilities.append(probs)
        outputs.append((probs @ v).transpose(1, 2))
    return outputs, probabilities


class FakeAttention(nn.Module):
    def __init__(self, evolution):
        super().__init__()
        self.evolving_attention = evolution


def make_layers(num_layers, alpha, beta, kernel_size=3, dtype=torch.float64):
    layers = []
    for i in range(num_layers):
        evolution = AttentionMapEvolution(
            H, alpha=alpha, beta=beta, kernel_size=kernel_size, position=i, previous=i - 1 if i else None
        ).to(dtype)
        layers.append(FakeAttention(evolution).eval())
    return layers


@pytest.mark.parametrize("kernel_size", [1, 3, 5])
@pytest.mark.parametrize("mask_kind", ["bool", "float", "none"])
def test_chain_matches_reference(kernel_size, mask_kind):
    torch.manual_seed(0)
    alpha, beta = 0.3, 0.6
    layers = make_layers(3, alpha, beta, kernel_size)
    qs, ks, vs = ([torch.randn(B, H, N, D, dtype=torch.float64) for _ in layers] for _ in range(3))
    valid = torch.ones(B, N, dtype=torch.bool)
    if mask_kind != "none":
        valid[1, 4:] = False
    allowed = valid[:, None, None, :].expand(B, 1, N, N)
    mask = {
        "bool": allowed,
        "float": torch.zeros(B, 1, N, N, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min),
        "none": None,
    }[mask_kind]

    chain = {}
    ours = [
        evolving_attention_forward(layer, q, k, v, mask, **{CHAIN_KWARG: chain})
        for layer, q, k, v in zip(layers, qs, ks, vs, strict=True)
    ]
    weights = [layer.evolving_attention.weight for layer in layers]
    biases = [layer.evolving_attention.bias for layer in layers]
    outputs, probabilities = reference_chain(qs, ks, vs, valid, weights, biases, alpha, beta)
    for (out, probs), ref_out, ref_probs in zip(ours, outputs, probabilities, strict=True):
        # Padded query rows carry no meaning; compare the rows of real tokens.
        assert (probs - ref_probs).transpose(1, 2)[valid].abs().max() <= 1e-12
        assert (out - ref_out)[valid].abs().max() <= 1e-12


@pytest.mark.parametrize("grad", [False, True])
def test_attention_sinks_join_the_softmax_and_not_the_convolution(grad):
    """GPT-OSS's attention sinks (``s_aux``): a learned logit per head is one more column of each row's softmax,
    which has no value and which the evolution never reads. With autograd (the fused attention core) the gradients
    of the queries, keys, values, sinks and convolutions are the reference's too."""
    torch.manual_seed(0)
    alpha, beta = 0.3, 0.6
    layers = make_layers(2, alpha, beta)
    qs, ks, vs = ([torch.randn(B, H, N, D, dtype=torch.float64, requires_grad=grad) for _ in layers] for _ in range(3))
    sinks = torch.randn(H, dtype=torch.float64, requires_grad=grad)
    valid = torch.ones(B, N, dtype=torch.bool)
    valid[1, 4:] = False
    allowed = valid[:, None, None, :].expand(B, 1, N, N)
    weights = [layer.evolving_attention.weight for layer in layers]
    biases = [layer.evolving_attention.bias for layer in layers]
    upstream = [torch.randn(B, N, H, D, dtype=torch.float64) * valid[:, :, None, None] for _ in layers]

    with torch.set_grad_enabled(grad):
        chain = {}
        ours = [
            evolving_attention_forward(layer, q, k, v, allowed, s_aux=sinks, **{CHAIN_KWARG: chain})
            for layer, q, k, v in zip(layers, qs, ks, vs, strict=True)
        ]
        outputs, probabilities = reference_chain(qs, ks, vs, valid, weights, biases, alpha, beta, sinks=sinks)
    for (out, probs), ref_out, ref_probs in zip(ours, outputs, probabilities, strict=True):
        assert (probs - ref_probs).transpose(1, 2)[valid].abs().max() <= 1e-12
        assert (out - ref_out)[valid].abs().max() <= 1e-12
    assert (probabilities[0].sum(-1) < 1 - 1e-3).any()  # the sinks took their share
    if grad:
        leaves = [*qs, *ks, *vs, sinks, *weights, *biases]
        loss, reference_loss = (
            sum((out * up).sum() for out, up in zip(outs, upstream, strict=True))
            for outs in ([out for out, _ in ours], outputs)
        )
        gradients = torch.autograd.grad(loss, leaves)
        for gradient, expected in zip(gradients, torch.autograd.grad(reference_loss, leaves), strict=True):
            assert (gradient - expected).abs().max() <= 1e-10 * max(1.0, expected.abs().max())


def test_padding_entries_never_reach_the_convolution():
    torch.manual_seed(0)
    evolution = AttentionMapEvolution(H, alpha=0.0, beta=1.0, kernel_size=3).double()
    valid = torch.tensor([[True] * 4 + [False] * 3])
    allowed = valid[:, None, None, :].expand(1, 1, N, N)
    conv_mask = self_attention_conv_mask(allowed, N)
    assert torch.equal(conv_mask[0, 0], valid[0][:, None] & valid[0][None, :])
    scores = torch.randn(1, H, N, N, dtype=torch.float64)
    noisy = scores.clone()
    noisy[..., 4:, :] = 1e3 * torch.randn_like(noisy[..., 4:, :])  # padded query rows
    noisy[..., :, 4:] = 1e3 * torch.randn_like(noisy[..., :, 4:])  # padded key columns
    a = evolution(scores, conv_mask, {})
    b = evolution(noisy, conv_mask, {})
    assert torch.equal(a[..., :4, :4], b[..., :4, :4])
    alone = evolution(scores[..., :4, :4], None, {})
    assert (a[..., :4, :4] - alone).abs().max() <= 1e-12


def full_kernel(evolution: AttentionMapEvolution) -> torch.Tensor:
    """A causal evolution's weight as the k x k kernel it stands for: zero rows below the centre."""
    k = evolution.kernel_size
    weight = torch.zeros(evolution.num_heads, evolution.num_heads, k, k, dtype=evolution.weight.dtype)
    weight[:, :, : k // 2 + 1] = evolution.weight.detach()
    return weight


@pytest.mark.parametrize("kernel_size", [1, 3, 5])
@pytest.mark.parametrize("kind", ["decoder", "cross"])
def test_causal_convolution_is_the_masked_kernel(kernel_size, kind):
    torch.manual_seed(0)
    evolution = AttentionMapEvolution(H, alpha=0.0, beta=1.0, kernel_size=kernel_size, role=kind).double()
    assert evolution.causal and evolution.weight.shape == (H, H, kernel_size // 2 + 1, kernel_size)
    x = torch.randn(B, H, N, N + 2, dtype=torch.float64)
    expected = torch.relu(reference_conv(x, full_kernel(evolution), evolution.bias.detach()))
    assert (evolution.convolve(x) - expected).abs().max() <= 1e-12


@pytest.mark.parametrize("kernel_size", [3, 5])
def test_causal_evolution_never_reads_the_future(kernel_size):
    torch.manual_seed(0)
    evolution = AttentionMapEvolution(H, alpha=0.5, beta=1.0, kernel_size=kernel_size, role="decoder").double()
    allowed = torch.ones(N, N, dtype=torch.bool).tril()[None, None]
    conv_mask = self_attention_conv_mask(allowed, N)
    scores = torch.randn(1, H, N, N, dtype=torch.float64)
    for i in range(N - 1):
        # Token i+1.. changes: rows > i and columns > i of the logits move.
        perturbed = scores.clone()
        perturbed[..., i + 1 :, :] += torch.randn_like(perturbed[..., i + 1 :, :])
        perturbed[..., :, i + 1 :] += torch.randn_like(perturbed[..., :, i + 1 :])
        a = evolution(scores, conv_mask, {})
        b = evolution(perturbed, conv_mask, {})
        assert torch.equal((a * allowed)[..., : i + 1, :], (b * allowed)[..., : i + 1, :])
    # A non-causal kernel does read the next row: the property is not vacuous.
    open_kernel = AttentionMapEvolution(H, alpha=0.5, beta=1.0, kernel_size=kernel_size).double()
    perturbed = scores.clone()
    perturbed[..., 3:, :] += 1.0
    diff = open_kernel(perturbed, conv_mask, {}) - open_kernel(scores, conv_mask, {})
    assert (diff * allowed)[..., :3, :].abs().max() > 1e-3


class FakeCache:
    """What the attention function uses of a transformers Cache: the number of tokens it holds."""

    def __init__(self):
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length


def decoder_layers(kernel_size, alpha=0.3, beta=0.7):
    layers = []
    for i, kind in enumerate(["decoder", "cross", "decoder", "cross"]):
        evolution = AttentionMapEvolution(
            H,
            alpha=alpha,
            beta=beta,
            kernel_size=kernel_size,
            role=kind,
            position=i // 2,
            previous=None if i < 2 else 0,
        ).double()
        layers.append(FakeAttention(evolution).eval())
    return layers


@pytest.mark.parametrize("kernel_size", [1, 3, 5])
def test_step_by_step_decoding_with_kept_rows_equals_the_full_map(kernel_size):
    """Two decoder layers (self + cross each): feeding tokens one or two at a time, with the convolution rows
    kept on the cache, gives the full forward's rows; left padding in the decoder included."""
    torch.manual_seed(0)
    layers = decoder_layers(kernel_size)
    source = 6
    q, k, v = (torch.randn(B, H, N, D, dtype=torch.float64) for _ in range(3))
    ck, cv = (torch.randn(B, H, source, D, dtype=torch.float64) for _ in range(2))
    valid = torch.ones(B, N, dtype=torch.bool)
    valid[1, :2] = False  # left-padded target
    source_valid = torch.ones(B, source, dtype=torch.bool)
    source_valid[0, 4:] = False
    causal = torch.ones(N, N, dtype=torch.bool).tril() & valid[:, None, None, :]
    cross = source_valid[:, None, None, :]

    def run(rows, past, cache):
        chain, outputs = {}, []
        for layer in layers:
            is_cross = layer.evolving_attention.role == "cross"
            keys, values = (ck, cv) if is_cross else (k[:, :, : past + len(rows)], v[:, :, : past + len(rows)])
            mask = cross if is_cross else causal[:, :, rows, : past + len(rows)]
            kwargs = {CHAIN_KWARG: chain, CACHE_KWARG: cache}
            outputs.append(evolving_attention_forward(layer, q[:, :, rows], keys, values, mask, **kwargs)[0])
        return outputs

    full = run(list(range(N)), 0, None)
    cache = FakeCache()
    for start, stop in [(0, 1), (1, 3), (3, 4), (4, 5), (5, 7)]:
        cache.length = stop  # the KV cache is updated before attention runs
        steps = run(list(range(start, stop)), start, cache)
        for step, whole in zip(steps, full, strict=True):
            real = valid[:, start:stop]
            assert (step - whole[:, start:stop])[real].abs().max() <= 1e-12
    assert len(cache.__dict__[CACHE_ATTRIBUTE]) == 4


def test_kept_rows_follow_beam_reordering_and_detect_a_stale_cache():
    torch.manual_seed(0)
    layers = decoder_layers(3)[:1]
    q, k, v = (torch.randn(B, H, N, D, dtype=torch.float64) for _ in range(3))
    causal = torch.ones(N, N, dtype=torch.bool).tril()[None, None]

    def step(queries, rows, cache):
        kwargs = {CHAIN_KWARG: {}, CACHE_KWARG: cache}
        keys = k[:, :, : rows.stop]
        return evolving_attention_forward(
            layers[0], queries[:, :, rows], keys, v[:, :, : rows.stop], causal[..., rows, : rows.stop], **kwargs
        )[0]

    cache = FakeCache()
    cache.length = 3
    step(q, slice(0, 3), cache)
    beam_idx = torch.tensor([1, 0])
    reorder_convolution_histories(cache, beam_idx)
    # After reordering, batch row 0 continues what was row 1: same as a full run on the swapped queries.
    swapped = q.clone()
    swapped[:, :, :3] = q[beam_idx, :, :3]
    k_swapped = k.clone()
    k_swapped[:, :, :3] = k[beam_idx, :, :3]
    k, k_saved = k_swapped, k
    cache.length = 4
    stepped = step(swapped, slice(3, 4), cache)
    whole = evolving_attention_forward(
        layers[0], swapped[:, :, :4], k[:, :, :4], v[:, :, :4], causal[..., :4, :4], **{CHAIN_KWARG: {}}
    )[0]
    assert (stepped - whole[:, 3:4]).abs().max() <= 1e-12
    k = k_saved
    cache.length = 6  # two tokens the evolution never saw
    with pytest.raises(RuntimeError, match="holds 5 earlier tokens"):
        step(q, slice(5, 6), cache)


def test_mask_function_always_materialises_causal_masks():
    common = dict(batch_size=2, q_length=5, kv_length=5, device="cpu")
    causal = evolving_attention_mask(mask_function=causal_mask_function, **common)
    assert causal is not None and causal.dtype == torch.bool
    assert torch.equal(causal[0, 0], torch.ones(5, 5, dtype=torch.bool).tril())
    padding = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    padded = evolving_attention_mask(
        mask_function=bidirectional_mask_function, attention_mask=padding, allow_is_bidirectional_skip=True, **common
    )
    assert torch.equal(padded[:, 0, 2], padding)
    assert padding_mask_function  # the transformers helper this mask composes with exists


def test_missing_chain_or_previous_layer_is_an_error():
    layers = make_layers(2, 0.5, 0.5)
    q = torch.randn(1, H, N, D, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="outside a patched layer stack"):
        evolving_attention_forward(layers[0], q, q, q, None)
    with pytest.raises(RuntimeError, match="expected the logits of layer 0"):
        evolving_attention_forward(layers[1], q, q, q, None, **{CHAIN_KWARG: {}})


def test_query_rows_are_located_among_cached_keys():
    allowed = torch.ones(1, 1, 1, 6, dtype=torch.bool)
    allowed[..., 2] = False
    assert torch.equal(self_attention_conv_mask(allowed, 1, past=5), allowed)  # a real query keeps its row
    assert not self_attention_conv_mask(allowed, 1, past=2).any()  # a padding query reads nothing
    # A sliding-window cache that holds fewer keys than tokens seen: the query is the last key.
    assert torch.equal(self_attention_conv_mask(allowed, 1, past=6), allowed)
    assert not self_attention_conv_mask(allowed[..., :3], 1, past=9).any()
    with pytest.raises(NotImplementedError, match="got 2 queries after 6 cached tokens over 1 keys"):
        self_attention_conv_mask(allowed[..., :1], 2, past=6)


@pytest.mark.parametrize("kind", ["encoder", "decoder", "cross"])
@pytest.mark.parametrize("kernel_size", [1, 3, 5])
@pytest.mark.parametrize("masked", [False, True])
def test_fast_path_matches_the_reference_with_gradients(evolution_path, kind, kernel_size, masked):
    """forward() (fused) against reference() (the paper's equations, one op each): logits and the gradients
    of S, the previous layer's logits, the weights and the bias, in fp32."""
    torch.manual_seed(0)
    queries, keys = 9, 9 if kind != "cross" else 12
    evolution = AttentionMapEvolution(
        H, alpha=0.3, beta=0.4, kernel_size=kernel_size, role=kind, position=1, previous=0
    )
    scores = torch.randn(B, H, queries, keys, requires_grad=True)
    previous = torch.randn(B, H, queries, keys, requires_grad=True)
    upstream = torch.randn(B, H, queries, keys)
    conv_mask = None
    if masked:
        valid = torch.ones(B, keys, dtype=torch.bool)
        valid[1, 6:] = False
        conv_mask = valid[:, None, None, :] & valid[:, None, :queries, None]

    def run(method):
        evolution.zero_grad()
        scores.grad = previous.grad = None
        logits = method(scores * 1.0, conv_mask, {(kind, 0): previous * 1.0, "replays": True})
        (logits * upstream).sum().backward()
        return [logits.detach(), scores.grad, previous.grad, evolution.weight.grad, evolution.bias.grad]

    for fast, reference in zip(run(evolution.forward), run(evolution.reference), strict=True):
        assert (fast - reference).abs().max() <= 1e-5 * max(1.0, reference.abs().max())


@pytest.mark.parametrize(("kind", "kernel_size"), [("encoder", 3), ("decoder", 3), ("encoder", 5), ("cross", 5)])
def test_custom_backward_passes_gradcheck(kind, kernel_size):
    torch.manual_seed(0)
    evolution = AttentionMapEvolution(H, alpha=0.3, beta=0.4, kernel_size=kernel_size, role=kind).double()
    scores, previous = (torch.randn(1, H, 6, 7, dtype=torch.float64, requires_grad=True) for _ in range(2))
    keep = (torch.rand(1, 1, 6, 7) > 0.3).double()

    def evolve(scores, previous, weight, bias):
        return EvolveConvolution.apply(evolution.step, scores, previous, keep, weight, bias)

    assert torch.autograd.gradcheck(evolve, (scores, previous, evolution.weight, evolution.bias))
    assert torch.autograd.gradcheck(lambda s, w, b: evolve(s, None, w, b), (scores, evolution.weight, evolution.bias))


def test_inference_drops_consumed_logits_from_the_chain():
    """Without autograd each layer's logits are released once the next layer has read them."""
    layers = make_layers(4, alpha=0.3, beta=0.4, dtype=torch.float32)
    chain = {}
    with torch.no_grad():
        for layer in layers:
            q, k, v = (torch.randn(B, H, N, D) for _ in range(3))
            evolving_attention_forward(layer, q, k, v, None, **{CHAIN_KWARG: chain})
            assert len([key for key in chain if isinstance(key, tuple)]) == 1


def test_probabilities_go_into_a_spare_map_only_when_nothing_else_holds_it():
    scores = torch.randn(B, H, N, N)
    spare_map = map_reuse.spare_map

    def chain_and_pointer():
        chain = {"spare": torch.randn(B, H, N, N)}
        return chain, chain["spare"].data_ptr()

    with torch.no_grad():
        chain, pointer = chain_and_pointer()
        spare = spare_map(chain, scores)
        assert spare is not None and spare.data_ptr() == pointer and "spare" not in chain
        # Passed on through further calls, as the attention function does: counted once, where it was taken.
        _, _, probabilities, _ = attend_values(scores, AttentionMask(), torch.randn(B, H, N, D), 0.0, out=spare)
        assert probabilities.data_ptr() == pointer and torch.equal(probabilities, scores.softmax(-1))

        chain, _ = chain_and_pointer()
        held = chain["spare"]  # noqa: F841 - the caller still holds it
        assert spare_map(chain, scores) is None and "spare" not in chain

        chain, _ = chain_and_pointer()
        view = chain["spare"][0]  # noqa: F841 - a view shares its storage
        assert spare_map(chain, scores) is None

        assert spare_map({"spare": torch.randn(B, H, N, N + 1)}, scores) is None  # another shape
        assert spare_map({"spare": torch.randn(B, H, N, N).double()}, scores) is None  # another dtype
        assert spare_map({}, scores) is None and spare_map(None, scores) is None
    chain, _ = chain_and_pointer()
    assert spare_map(chain, scores) is None  # autograd may have saved it


def test_inference_reuses_consumed_logits_without_changing_a_number(monkeypatch):
    """Layers after the first write their probabilities into the previous layer's logits; the outputs and
    attentions are bit-identical to allocating new maps."""
    model = ea_hf.patch(BertModel(BertConfig(**TINY_BERT)), alpha=0.3, beta=0.4).eval()
    inputs = {"input_ids": torch.randint(0, 100, (2, 9)), "attention_mask": torch.ones(2, 9, dtype=torch.long)}
    inputs["attention_mask"][1, 6:] = 0
    reuses = []
    sole_storage_user = map_reuse.sole_storage_user

    def counting(tensor):
        reuses.append(sole_storage_user(tensor))
        return reuses[-1]

    monkeypatch.setattr(map_reuse, "sole_storage_user", counting)
    with torch.no_grad():
        reusing = model(**inputs, output_attentions=True)
    assert reuses == [True] * (TINY_BERT["num_hidden_layers"] - 1)
    monkeypatch.setattr(map_reuse, "sole_storage_user", lambda tensor: False)
    with torch.no_grad():
        allocating = model(**inputs, output_attentions=True)
    assert torch.equal(reusing.last_hidden_state, allocating.last_hidden_state)
    for kept, fresh in zip(reusing.attentions, allocating.attentions, strict=True):
        assert torch.equal(kept, fresh)
    assert len({a.data_ptr() for a in reusing.attentions}) == len(reusing.attentions)


def test_inference_writes_each_product_into_the_previous_weights(monkeypatch):
    """Without autograd, where no caller keeps the attention weights, each layer after the first writes QK^T into
    the previous layer's weights (and its probabilities into the previous layer's logits): the stack's products
    take two maps in all, and the outputs are bit-identical to allocating a new map for each. Maps under
    SPENT_WEIGHTS_MIN_BYTES (such as these, and a decoding step's) are left to the allocator."""
    layers = 4
    model = ea_hf.patch(BertModel(BertConfig(**{**TINY_BERT, "num_hidden_layers": layers})), alpha=0.3, beta=0.4)
    model.eval()
    inputs = {"input_ids": torch.randint(0, 100, (2, 9)), "attention_mask": torch.ones(2, 9, dtype=torch.long)}
    inputs["attention_mask"][1, 6:] = 0
    products = []  # (the product's storage, whether it went into a spent map) per layer

    def recording(*args, **kwargs):
        product = attention_scores(*args, **kwargs)
        products.append((product.data_ptr(), kwargs.get("out") is not None))
        return product

    monkeypatch.setattr(attention_module, "attention_scores", recording)
    with torch.no_grad():
        model(**inputs)
    assert [into_spent for _, into_spent in products] == [False] * layers

    products.clear()
    monkeypatch.setattr(map_reuse, "SPENT_WEIGHTS_MIN_BYTES", 0)
    with torch.no_grad():
        reusing = model(**inputs).last_hidden_state
    assert [into_spent for _, into_spent in products] == [False] + [True] * (layers - 1)
    assert len({pointer for pointer, _ in products}) == 2

    products.clear()
    with torch.no_grad():  # a caller that keeps the attentions keeps every weights map: nothing is written into them
        attentions = model(**inputs, output_attentions=True).attentions
    assert [into_spent for _, into_spent in products] == [False] * layers
    monkeypatch.setattr(map_reuse, "sole_storage_user", lambda tensor: False)
    with torch.no_grad():
        allocating = model(**inputs, output_attentions=True)
    assert torch.equal(reusing, allocating.last_hidden_state)
    for kept, fresh in zip(attentions, allocating.attentions, strict=True):
        assert torch.equal(kept, fresh)


def test_inference_holds_no_weights_where_no_layer_takes_them(monkeypatch):
    """Where S is not the plain product (here half precision; likewise a positional bias or soft-capping), no
    layer writes its product into the previous layer's weights, so the chain keeps none: each layer's weights
    are freed once the caller drops them, before the next layer attends."""
    import weakref

    model = ea_hf.patch(BertModel(BertConfig(**TINY_BERT)), alpha=0.3, beta=0.4).to(torch.bfloat16).eval()
    monkeypatch.setattr(map_reuse, "SPENT_WEIGHTS_MIN_BYTES", 0)
    weights, alive_at_next_layer = [], []

    def recording(*args, **kwargs):
        alive_at_next_layer.extend(ref() is not None for ref in weights)
        result = attend_values(*args, **kwargs)
        weights[:] = [weakref.ref(result[1])]
        return result

    monkeypatch.setattr(attention_module, "attend_values", recording)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 100, (2, 9)))
    assert alive_at_next_layer == [False] * (TINY_BERT["num_hidden_layers"] - 1)


@pytest.mark.parametrize("kernels", ["cpu-kernel", "torch-ops"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_with_padding_stays_finite(monkeypatch, dtype, kernels):
    """bf16/fp16 models with padded batches: no overflow, no NaN, forward and backward; close to fp32. On torch
    operations the maps evolve in the model's dtype; for the CPU kernel, in fp32."""
    monkeypatch.setenv("EA_HF_KERNELS", "1" if kernels == "cpu-kernel" else "0")
    evolved_dtypes = []
    evolve_step = attention_core.evolve_step

    def recording(step, maps, *args, **kwargs):
        evolved_dtypes.append(maps.scores.dtype)
        return evolve_step(step, maps, *args, **kwargs)

    monkeypatch.setattr(attention_core, "evolve_step", recording)
    torch.manual_seed(0)
    config = BertConfig(**TINY_BERT)
    model = ea_hf.patch(BertModel(config), alpha=0.4, beta=0.4)
    inputs = {"input_ids": torch.randint(0, 100, (3, 13)), "attention_mask": torch.ones(3, 13, dtype=torch.long)}
    inputs["attention_mask"][1, 9:] = 0
    inputs["attention_mask"][2, 4:] = 0
    reference = model.eval()(**inputs).last_hidden_state.detach()
    evolved_dtypes.clear()
    half = model.to(dtype)
    output = half(**inputs).last_hidden_state
    output.float().pow(2).mean().backward()
    assert evolved_dtypes == [torch.float32 if kernels == "cpu-kernel" else dtype] * TINY_BERT["num_hidden_layers"]
    assert torch.isfinite(output).all()
    assert all(torch.isfinite(p.grad).all() for p in half.parameters() if p.grad is not None)
    real = inputs["attention_mask"].bool()
    assert (output.float() - reference)[real].abs().max() <= 0.1
    # Autocast (fp32 weights, bf16 matmuls) goes the same way.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = model.float()(**inputs).last_hidden_state
    assert torch.isfinite(autocast).all()
    assert (autocast.float() - reference)[real].abs().max() <= 0.1


@pytest.mark.parametrize(
    ("evolved", "rows", "softcap"),
    [(False, N, None), (True, N, None), (True, 13, None), (True, 13, 20.0)],
    ids=["plain", "core-keeps-maps", "core-recomputes", "core-autograd-scores"],
)
def test_grouped_query_heads_share_keys_and_values_without_copies(evolved, rows, softcap):
    """Grouped-query attention (2 key/value heads for 6 query heads): each key/value head serves its group of query
    heads in one product, forward and backward, with no repeated copy of the keys and values; the outputs, the
    evolved probabilities and the gradients match attention over repeated keys and values (eager attention's way).
    Covers the attention core keeping S and P (short maps), recomputing them (longer ones), and recomputing S
    through autograd (soft-capping)."""
    torch.manual_seed(0)
    heads, kv_heads = 6, 2
    evolution = AttentionMapEvolution(heads, alpha=0.0, beta=0.4, kernel_size=3, role="decoder") if evolved else None
    layer = FakeAttention(evolution) if evolved else nn.Module()
    q = torch.randn(B, heads, rows, D)
    k, v = torch.randn(B, kv_heads, rows, D), torch.randn(B, kv_heads, rows, D)
    mask = torch.ones(rows, rows, dtype=torch.bool).tril()[None, None]

    def attend(query, key, value):
        return evolving_attention_forward(layer, query, key, value, mask, softcap=softcap, **{CHAIN_KWARG: {}})

    with torch.no_grad(), torch.profiler.profile() as profile:
        grouped = attend(q, k, v)
    with torch.no_grad():
        expected = attend(q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1))
    for got, want in zip(grouped, expected, strict=True):
        assert got.shape == want.shape and (got - want).abs().max() <= 1e-6
    # The grouped maps are their storage's only users, as plain products are: inference reuses them (spare_map).
    assert map_reuse.sole_storage_user(attention_scores(q, k, 0.5))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    upstream = torch.randn(B, rows, heads, D)
    with torch.profiler.profile() as training_profile:
        gradients = torch.autograd.grad(attend(*leaves)[0], leaves, upstream)
    for events in (profile.events(), training_profile.events()):
        assert "aten::repeat_interleave" not in {event.name for event in events}
    reference = [t.clone().requires_grad_() for t in (q, k, v)]
    repeated_output = attend(reference[0], *(t.repeat_interleave(3, dim=1) for t in reference[1:]))[0]
    for got, want in zip(gradients, torch.autograd.grad(repeated_output, reference, upstream), strict=True):
        assert got.shape == want.shape and (got - want).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="5 query heads cannot share 2 key/value heads"):
        attend(torch.randn(B, 5, rows, D), k, v)


@pytest.mark.parametrize(
    ("kernel_rows", "kernel_columns", "context_rows"), [(3, 3, 1), (2, 3, 1), (5, 5, 2), (3, 5, 2)]
)
def test_both_ways_to_the_kernel_gradient_agree(kernel_rows, kernel_columns, context_rows):
    """The weight and bias gradients of the evolution's convolution through ``aten.convolution_backward`` (GPUs)
    and as one product per tap (the CPU) are autograd's through F.conv2d, for centred and causal kernels (a causal
    one's convolution has ``context_rows`` extra rows, which the step crops)."""
    generator = torch.Generator().manual_seed(0)
    conv_input = torch.randn(2, 4, 13, 11, dtype=torch.float64, generator=generator)
    grad_output = torch.randn(2, 4, 13, 11, dtype=torch.float64, generator=generator)
    weight = torch.zeros(4, 4, kernel_rows, kernel_columns, dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    output = F.conv2d(conv_input, weight, bias, padding=(context_rows, kernel_columns // 2))[..., :13, :]
    (output * grad_output).sum().backward()
    for way in (weight_grad_by_convolution, weight_grad_by_taps):
        grad_weight, grad_bias = way(conv_input, grad_output, kernel_rows, kernel_columns, context_rows)
        assert (grad_weight - weight.grad).abs().max() <= 1e-12, way.__name__
        assert (grad_bias - bias.grad).abs().max() <= 1e-12, way.__name__

"""The attention function and the map evolution against an independent, loop-based reference."""

import pytest
import torch
from torch import nn
from transformers.masking_utils import bidirectional_mask_function, causal_mask_function, padding_mask_function

from ea_hf.attention import (
    CHAIN_KWARG,
    AttentionMapEvolution,
    evolving_attention_forward,
    evolving_attention_mask,
    self_attention_conv_mask,
)

B, H, N, D = 2, 3, 7, 5


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


def reference_chain(queries, keys, values, valid_tokens, weights, biases, alpha, beta):
    """Eqs. (1)-(2) of TPAMI section 3.1 for a whole chain, with padding zeroed before each convolution."""
    entry_valid = valid_tokens[:, None, :, None] & valid_tokens[:, None, None, :]
    previous, outputs, probabilities = None, [], []
    for q, k, v, w, b in zip(queries, keys, values, weights, biases, strict=True):
        scores = q @ k.transpose(-1, -2) / D**0.5
        a_in = scores if previous is None else alpha * previous + (1 - alpha) * scores
        a_logit = beta * torch.relu(reference_conv(a_in * entry_valid, w, b)) + (1 - beta) * a_in
        previous = a_logit
        masked = a_logit.masked_fill(~valid_tokens[:, None, None, :], torch.finfo(a_logit.dtype).min)
        probs = masked.softmax(-1)
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


@pytest.mark.parametrize("kernel_size", [3, 5])
def test_causal_evolution_never_reads_the_future(kernel_size):
    torch.manual_seed(0)
    evolution = AttentionMapEvolution(H, alpha=0.5, beta=1.0, kernel_size=kernel_size, causal=True).double()
    assert evolution.kernel_mask[kernel_size // 2 + 1 :].abs().sum() == 0
    assert evolution.kernel_mask[: kernel_size // 2 + 1].min() == 1
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


def test_kv_cache_shapes_are_refused_for_self_attention():
    allowed = torch.ones(1, 1, 1, 6, dtype=torch.bool)
    with pytest.raises(NotImplementedError, match="queries == keys"):
        self_attention_conv_mask(allowed, 1)

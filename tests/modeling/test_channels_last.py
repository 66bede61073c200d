"""The channels-last candidate of the evolution step's torch path (``EA_HF_CHANNELS_LAST=1``): the convolution, its
input gradient and its weight gradient on maps whose heads are padded to a multiple of 8 channels, stored NHWC.
Against the default torch path on the same inputs: the same outputs and gradients within rounding noise (float64 and
fp32), bit for bit at alpha = beta = 0, through the autograd node, without autograd and in whole models; the padded
channels change nothing, also where fresh memory holds NaN; and the candidate really ran, padded as it says."""

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification

import ea_hf
from ea_hf.modeling import convolution
from ea_hf.modeling.convolution import (
    CHANNELS_LAST_VARIABLE,
    EvolveConvolution,
    channels_last_enabled,
    evolve_convolution,
    padded_heads,
)
from ea_hf.modeling.evolution import AttentionMapEvolution
from ea_hf.modeling.step import StepMaps

BATCH, ROWS, COLUMNS = 2, 6, 7
#: Largest difference from the default path, relative to the largest value compared: rounding noise of the dtype
#: (the convolutions sum in another order).
NOISE = {torch.float64: 1e-12, torch.float32: 2e-6}
#: 3 and 12 heads are padded (to 8 and 16 channels), 8 is not.
HEADS = (3, 8, 12)
#: Which of A_prev and the convolution's input mask the step has.
INPUTS = ("scores", "scores+keep", "scores+previous", "scores+previous+keep")


@pytest.fixture
def layout(monkeypatch):
    """``layout(channels_last)`` sets the path for what follows; the CPU kernel is off (fp32 maps would take it)."""
    monkeypatch.setenv("EA_HF_KERNELS", "0")

    def choose(channels_last: bool) -> None:
        monkeypatch.setenv(CHANNELS_LAST_VARIABLE, "1" if channels_last else "0")

    return choose


@pytest.fixture
def padded_maps(monkeypatch):
    """The channel counts of the padded maps the candidate allocates, in order: proof that it ran, and padded."""
    channels = []
    allocate = convolution.channels_last_map

    def recording(like):
        padded = allocate(like)
        channels.append(padded.shape[1])
        return padded

    monkeypatch.setattr(convolution, "channels_last_map", recording)
    return channels


def step_inputs(heads, inputs, dtype, role="encoder", alpha=0.3, beta=0.4, seed=0):
    """A layer's evolution module and its maps: S, A_prev and the mask as ``inputs`` names them."""
    torch.manual_seed(seed)
    evolution = AttentionMapEvolution(heads, alpha=alpha, beta=beta, kernel_size=3, role=role).to(dtype)
    with torch.no_grad():
        evolution.bias.uniform_(-0.5, 0.5)  # a non-zero bias, whose padded channels must stay zero
    scores = torch.randn(BATCH, heads, ROWS, COLUMNS, dtype=dtype)
    previous = torch.randn(BATCH, heads, ROWS, COLUMNS, dtype=dtype) if "previous" in inputs else None
    keep = (torch.rand(BATCH, 1, ROWS, COLUMNS) > 0.3).to(dtype) if "keep" in inputs else None
    return evolution, scores, previous, keep


def evolved(evolution, scores, previous, keep, upstream):
    """(A_logit through the autograd node, A_logit without autograd, the gradients of S, A_prev, weight, bias)."""
    evolution.zero_grad(set_to_none=True)
    leaves = [scores.clone().requires_grad_(), None if previous is None else previous.clone().requires_grad_()]
    logits = EvolveConvolution.apply(evolution.step, leaves[0], leaves[1], keep, evolution.weight, evolution.bias)
    (logits * upstream).sum().backward()
    with torch.no_grad():  # in place: written over a copy of S
        copies = StepMaps(scores.clone(), None if previous is None else previous.clone(), keep)
        inference = evolve_convolution(evolution.step, copies, evolution.weight, evolution.bias)
    grads = [None if leaf is None else leaf.grad for leaf in leaves] + [evolution.weight.grad, evolution.bias.grad]
    return [logits.detach(), inference, *grads]


def assert_close(candidate, default, dtype):
    for found, want in zip(candidate, default, strict=True):
        assert (found is None) == (want is None)
        if want is not None:
            assert found.shape == want.shape and found.dtype == want.dtype
            scale = max(1.0, want.abs().max().item())
            assert (found - want).abs().max().item() <= NOISE[dtype] * scale


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "fp32"])
@pytest.mark.parametrize("inputs", INPUTS)
@pytest.mark.parametrize("role", ["encoder", "decoder"], ids=["centred", "causal"])
@pytest.mark.parametrize("heads", HEADS)
def test_the_step_and_its_gradients_match_the_default_path(layout, padded_maps, heads, role, inputs, dtype):
    evolution, scores, previous, keep = step_inputs(heads, inputs, dtype, role)
    upstream = torch.randn_like(scores)
    layout(False)
    default = evolved(evolution, scores, previous, keep, upstream)
    assert padded_maps == []
    layout(True)
    candidate = evolved(evolution, scores, previous, keep, upstream)
    assert_close(candidate, default, dtype)
    # Forward (autograd node), backward (the gated gradient, the weight gradient's input), forward without autograd.
    assert padded_maps == [padded_heads(heads)] * 4 == [{3: 8, 8: 8, 12: 16}[heads]] * 4


@pytest.mark.parametrize("inputs", INPUTS)
def test_alpha_and_beta_zero_give_the_scores_and_their_gradient_bit_for_bit(layout, padded_maps, inputs):
    evolution, scores, previous, keep = step_inputs(12, inputs, torch.float32, alpha=0.0, beta=0.0)
    upstream = torch.randn_like(scores)
    layout(True)
    logits, inference, grad_scores, grad_previous, grad_weight, grad_bias = evolved(
        evolution, scores, previous, keep, upstream
    )
    assert torch.equal(logits, scores) and torch.equal(inference, scores)
    assert torch.equal(grad_scores, upstream)
    assert grad_previous is None or torch.equal(grad_previous, torch.zeros_like(scores))
    assert torch.equal(grad_weight, torch.zeros_like(grad_weight)) and torch.equal(
        grad_bias, torch.zeros_like(grad_bias)
    )
    assert padded_maps == [16] * 4


def test_nan_in_fresh_memory_stays_out_of_the_padded_channels(layout, padded_maps, monkeypatch):
    """The padded channels are written zero: fresh memory full of NaN (as uninitialised memory may be) changes
    nothing, although the kernel's padded weights multiply them."""
    evolution, scores, previous, keep = step_inputs(3, "scores+previous+keep", torch.float32)
    upstream = torch.randn_like(scores)
    layout(False)
    default = evolved(evolution, scores, previous, keep, upstream)
    new_empty = torch.Tensor.new_empty

    def nan_filled(self, *size, **kwargs):
        return new_empty(self, *size, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(torch.Tensor, "new_empty", nan_filled)
    layout(True)
    candidate = evolved(evolution, scores, previous, keep, upstream)
    assert_close(candidate, default, torch.float32)
    assert padded_maps == [8] * 4


def test_the_candidate_passes_gradcheck(layout, padded_maps):
    evolution, scores, previous, keep = step_inputs(3, "scores+previous+keep", torch.float64, role="decoder")
    layout(True)

    def evolve(scores, previous, weight, bias):
        return EvolveConvolution.apply(evolution.step, scores, previous, keep, weight, bias)

    leaves = (scores.requires_grad_(), previous.requires_grad_(), evolution.weight, evolution.bias)
    assert torch.autograd.gradcheck(evolve, leaves)
    assert padded_maps and set(padded_maps) == {8}


def bert_step(dtype, seed=0):
    """A tiny EA BERT (4 heads: padded to 8 channels) on a padded batch: the loss, the logits without autograd and
    every parameter's gradient of one training step."""
    torch.manual_seed(seed)
    config = BertConfig(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37, vocab_size=100,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = ea_hf.patch(BertForSequenceClassification(config), alpha=0.3, beta=0.4).to(dtype)
    inputs = {"input_ids": torch.randint(0, 100, (3, 21)), "attention_mask": torch.ones(3, 21, dtype=torch.long)}
    inputs["attention_mask"][1, 15:] = 0
    inputs["attention_mask"][2, 6:] = 0
    with torch.no_grad():
        inference = model.eval()(**inputs).logits
    output = model.train()(**inputs, labels=torch.tensor([0, 1, 1]))
    output.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return output.loss.detach(), inference, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_model_trains_as_on_the_default_path(layout, padded_maps, dtype):
    """Through the attention core (S spent and recomputed, the next layer's gradient added, a padded batch), the
    loss, the logits and every gradient are the default path's: within fp32 noise, or within bf16's rounding of
    the maps (both paths round the same maps, in other orders)."""
    layout(False)
    default_loss, default_logits, default_grads = bert_step(dtype)
    assert padded_maps == []
    layout(True)
    loss, logits, grads = bert_step(dtype)
    layers = 3
    assert padded_maps == [8] * (4 * layers)  # forward, backward's two maps; forward without autograd
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert abs(loss.item() - default_loss.item()) <= tolerance
    assert (logits - default_logits).abs().max().item() <= tolerance
    assert grads.keys() == default_grads.keys()
    for name, want in default_grads.items():
        scale = max(1e-3, want.abs().max().item())
        assert (grads[name] - want).abs().max().item() <= tolerance * scale, name


def test_the_setting_is_read_at_call_time_and_not_while_compiling(monkeypatch):
    monkeypatch.setenv(CHANNELS_LAST_VARIABLE, "1")
    assert channels_last_enabled()

    def layout_flag(x):
        return x + 1 if channels_last_enabled() else x - 1

    compiled = torch.compile(layout_flag, backend="eager", fullgraph=True)
    assert compiled(torch.zeros(1)).item() == -1.0
    monkeypatch.setenv(CHANNELS_LAST_VARIABLE, "0")
    assert not channels_last_enabled()
    monkeypatch.delenv(CHANNELS_LAST_VARIABLE)
    assert not channels_last_enabled()

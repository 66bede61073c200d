"""Half-precision maps on torch operations (the CUDA path): the mask, the softmax and its gradient in the maps'
dtype, no fp32 copy. Results stay within the dtype's tolerance of a float64 reference, and fully masked rows give
no NaN, fp16 included."""

import pytest
import torch
from transformers import BertConfig, BertModel, LlamaConfig, LlamaModel

import ea_hf
from ea_hf.modeling.attention_tail import Dropout, attend_values_backward, softmax_probabilities
from ea_hf.modeling.masks import AttentionMask

TINY_BERT = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37)
TINY_LLAMA = dict(
    hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, intermediate_size=37,
    vocab_size=100, max_position_embeddings=64,
)  # fmt: skip
#: The relative error allowed a half-precision model's output against float64: a few of the dtype's epsilons
#: (2^-8 for bf16, 2^-11 for fp16) over the three layers; the gradients get four times as much. The models measure
#: about a third of it (bf16 0.006 and 0.005, fp16 0.0007 and 0.0006 for BERT and the Llama).
RELATIVE = {torch.bfloat16: 0.02, torch.float16: 0.003}


def models(family: str):
    torch.manual_seed(0)
    if family == "bert":
        model = BertModel(BertConfig(**TINY_BERT, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
        model.set_attn_implementation("eager")
        inputs = {"input_ids": torch.randint(0, 100, (3, 13)), "attention_mask": torch.ones(3, 13, dtype=torch.long)}
        inputs["attention_mask"][1, 9:] = 0
        inputs["attention_mask"][2, 4:] = 0
    else:
        model = LlamaModel(LlamaConfig(**TINY_LLAMA, attention_dropout=0.0))
        model.set_attn_implementation("eager")
        inputs = {"input_ids": torch.randint(0, 100, (2, 17))}
    return ea_hf.patch(model, alpha=0.3, beta=0.3), inputs


def relative_error(got: torch.Tensor, reference: torch.Tensor, rows: torch.Tensor | None = None) -> float:
    got, reference = got.double(), reference.double()
    if rows is not None:  # padded positions carry no meaning
        got, reference = got[rows], reference[rows]
    return float((got - reference).norm() / reference.norm())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_half_precision_maps_stay_within_the_dtypes_tolerance_of_float64(monkeypatch, family, dtype):
    """Outputs and gradients of a bf16/fp16 model on torch operations (maps in its dtype) against the same model in
    float64; no NaN anywhere, padded rows included."""
    monkeypatch.setenv("EA_HF_KERNELS", "0")
    model, inputs = models(family)
    rows = inputs["attention_mask"].bool() if "attention_mask" in inputs else None
    results = {}
    for precision in (torch.float64, dtype):
        copy = model.to(precision)
        copy.zero_grad()
        output = copy(**inputs).last_hidden_state
        output.double().pow(2).mean().backward()
        grads = torch.cat([p.grad.double().flatten() for p in copy.parameters() if p.grad is not None])
        results[precision] = output.detach(), grads
    (output, grads), (reference, reference_grads) = results[dtype], results[torch.float64]
    assert torch.isfinite(output).all() and torch.isfinite(grads).all()
    assert relative_error(output, reference, rows) < RELATIVE[dtype]
    assert relative_error(grads, reference_grads) < 4 * RELATIVE[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["additive", "allowed"])
def test_fully_masked_rows_give_uniform_weights_not_nan(dtype, kind):
    """A row whose every key is masked: uniform weights, as in fp32, forward and backward (fp16's additive mask plus
    a negative logit would be -inf without the guard)."""
    logits = torch.full((1, 2, 3, 5), -300.0, dtype=dtype).requires_grad_()
    masked_row = torch.zeros(1, 1, 3, 5, dtype=torch.bool)
    masked_row[..., 1, :] = True
    if kind == "additive":
        mask = AttentionMask(
            additive=torch.zeros(1, 1, 3, 5, dtype=dtype).masked_fill(masked_row, torch.finfo(dtype).min)
        )
    else:
        mask = AttentionMask(allowed=~masked_row)
    probabilities = softmax_probabilities(logits, mask)
    assert probabilities.dtype == dtype and torch.isfinite(probabilities).all()
    assert torch.allclose(probabilities[..., 1, :].float(), torch.full((1, 2, 5), 0.2), atol=1e-3)
    with torch.no_grad():
        value, grad = torch.randn(1, 2, 5, 4, dtype=dtype), torch.randn(1, 2, 3, 4, dtype=dtype)
        _, grad_logits = attend_values_backward(probabilities.detach(), mask, value, Dropout(), grad, None)
    assert torch.isfinite(grad_logits).all()


def test_half_precision_probabilities_are_the_float32_ones_rounded():
    """bf16 logits normalised in bf16 (fp32 inside the kernel) give fp32's probabilities within bf16's rounding."""
    logits = torch.randn(2, 3, 7, 11) * 4
    allowed = torch.rand(2, 1, 7, 11) > 0.3
    expected = softmax_probabilities(logits.bfloat16().float(), AttentionMask(allowed))
    got = softmax_probabilities(logits.bfloat16(), AttentionMask(allowed))
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), expected, rtol=2**-7, atol=2**-9)

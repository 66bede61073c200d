"""Evolution methods (conv, residual, echo) and kernel sizes: exactness where a method reduces to the plain
model, causality, cached generation, save/load, permutation invariance of 1x1 kernels, and clear errors for
invalid settings. (Padding invariance of every method: test_patching.py.)"""

import pytest
import torch
import transformers
from testing import (
    ALL_ARCHITECTURES,
    IMAGE_ARCHITECTURES,
    METHODS,
    SEQ2SEQ_ARCHITECTURES,
    VOCAB_SIZE,
    defined,
    first_output,
    max_abs_diff,
    patched_model,
    table,
    tiny_inputs,
    tiny_model,
)

import ea_hf


@pytest.mark.parametrize("model_type", table(ALL_ARCHITECTURES))
@pytest.mark.parametrize("method", ["residual", "echo"])
def test_methods_reduce_exactly_to_the_plain_model_and_change_it_otherwise(model_type, method):
    """residual with alpha = 0, and echo as patched (its state scales start at 0), compute the original model."""
    inputs = tiny_inputs(model_type)
    with torch.no_grad():
        reference = first_output(tiny_model(model_type)(**inputs))
        reduced = {"method": "residual", "alpha": 0.0} if method == "residual" else {"method": "echo"}
        plain = ea_hf.patch(tiny_model(model_type), **reduced)
        outputs = (first_output(plain(**inputs)), reference)
        assert max_abs_diff(*(defined(model_type, inputs, out) for out in outputs)) <= 1e-5
        changed = patched_model(model_type, METHODS[method])
        outputs = (first_output(changed(**inputs)), reference)
        assert max_abs_diff(*(defined(model_type, inputs, out) for out in outputs)) > 1e-4


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("model_type", ["bert", "distilbert", "vit", "t5", "bart"])
def test_every_method_round_trips_through_save_and_load(method, model_type, tmp_path):
    head = transformers.AutoModelForSeq2SeqLM if model_type in SEQ2SEQ_ARCHITECTURES else transformers.AutoModel
    model = patched_model(model_type, METHODS[method], head)
    model.save_pretrained(tmp_path)
    loaded, info = head.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert loaded.config.evolving_attention["encoder"]["method"] == METHODS[method]["method"]
    assert [m.method for m in ea_hf.summary(loaded).modules] == [m.method for m in ea_hf.summary(model).modules]
    reference = model.state_dict()
    assert all(torch.equal(tensor, reference[name]) for name, tensor in loaded.state_dict().items())
    # Outputs to fp32 noise, not bit for bit: the loaded weights live in memory mapped from the file, and
    # how some CPU kernels round depends on the alignment of their operands.
    inputs = tiny_inputs(model_type)
    with torch.no_grad():
        assert max_abs_diff(first_output(loaded.eval()(**inputs)), first_output(model(**inputs))) <= 1e-5


def test_parameter_counts_per_method():
    counts = {method: ea_hf.summary(patched_model("bert", METHODS[method])).added_parameters for method in METHODS}
    heads, head_dim, layers = 4, 8, 3
    assert counts == {
        "conv": layers * (heads * heads * 9 + heads),
        "residual": 0,  # no convolution, no new weights
        "echo": layers * 2 * heads * (head_dim + 1 + 1),  # steps x heads x (gate weights, gate bias, scale)
        "echo-row": layers * 3 * heads * (head_dim + 1 + 32),
        "echo-column": layers * 1 * heads * (head_dim + 1 + 32),
        "conv-1x1": layers * (heads * heads + heads),
        "conv-5x5": layers * (heads * heads * 25 + heads),
    }


def seq2seq_lm(model_type, settings):
    overrides = {"dropout_rate": 0.0} if model_type == "t5" else {"dropout": 0.0, "attention_dropout": 0.0}
    return patched_model(model_type, settings, transformers.AutoModelForSeq2SeqLM, **overrides)


@pytest.mark.parametrize("method", ["residual", "echo", "echo-row", "echo-column"])
@pytest.mark.parametrize("model_type", ["t5", "bart"])
def test_decoders_stay_causal_with_every_method(method, model_type):
    model = seq2seq_lm(model_type, METHODS[method])
    inputs = tiny_inputs(model_type)
    length = inputs["decoder_input_ids"].shape[1]
    with torch.no_grad():
        full = model(**inputs).logits
        for i in range(length - 1):
            changed = dict(inputs, decoder_input_ids=inputs["decoder_input_ids"].clone())
            changed["decoder_input_ids"][:, i + 1 :] = torch.randint(5, VOCAB_SIZE, (3, length - i - 1))
            logits = model(**changed).logits
            assert torch.equal(logits[:, : i + 1], full[:, : i + 1])


@pytest.mark.parametrize("method", ["residual", "echo-row", "echo-column"])
def test_cached_generation_equals_uncached_with_every_method(method):
    model = seq2seq_lm("t5", METHODS[method])
    inputs = tiny_inputs("t5")
    inputs.pop("decoder_input_ids")
    common = dict(max_new_tokens=8, do_sample=False, num_beams=2, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        cached = model.generate(**inputs, use_cache=True, **common)
        uncached = model.generate(**inputs, use_cache=False, **common)
    assert torch.equal(cached.sequences, uncached.sequences)
    assert max(max_abs_diff(a, b) for a, b in zip(cached.scores, uncached.scores, strict=True)) <= 1e-5


def test_a_1x1_kernel_keeps_the_model_permutation_equivariant():
    """TPAMI section 3.4: without position information, a 1x1 convolution (like attention itself) commutes with
    any reordering of the tokens; a 3x3 kernel mixes neighbouring entries of the map and does not."""
    results = {}
    for kernel_size in (1, 3):
        # Larger random weights than BERT's 0.02, so the attention maps are far from uniform.
        model = patched_model("bert", {"alpha": 0.5, "beta": 0.5, "kernel_size": kernel_size}, initializer_range=0.3)
        with torch.no_grad():
            model.embeddings.position_embeddings.weight.zero_()  # no position information
        ids = torch.randint(5, VOCAB_SIZE, (2, 10), generator=torch.Generator().manual_seed(0))
        order = torch.randperm(10, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            out = model(input_ids=ids).last_hidden_state
            permuted = model(input_ids=ids[:, order]).last_hidden_state
        results[kernel_size] = max_abs_diff(permuted, out[:, order])
    assert results[1] <= 1e-5
    assert results[3] > 1e-3


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"method": "conf"}, "method must be one of conv, residual, echo, linear, got 'conf'"),
        ({"method": "residual", "beta": 0.2}, "method 'residual' has no convolution: beta must be 0, got 0.2"),
        (
            {"method": "echo", "alpha": 0.1},
            "method 'echo' refines each layer's own logits, so alpha and beta must be 0",
        ),
        ({"method": "echo", "echoes": 0}, "echoes must be a positive integer, got 0"),
        ({"method": "echo", "echo_state": "diagonal"}, "echo_state must be one of scalar, row, column"),
        ({"method": "echo", "echo_state": "row"}, "echo_state 'row' needs max_positions, got None"),
        ({"kernel_size": 2}, "kernel_size must be a positive odd integer, got 2"),
    ],
)
def test_invalid_settings_fail_before_the_model_changes(settings, message):
    model = tiny_model("bert")
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ea_hf.patch(model, **settings)
    assert not ea_hf.is_patched(model) and type(model).__name__ == "BertModel"


def test_a_vector_echo_state_refuses_sequences_longer_than_it_has_positions():
    model = patched_model("bert", {"method": "echo", "echo_state": "column", "max_positions": 8})
    with pytest.raises(ValueError, match="takes at most 8 positions, got 9"):
        model(input_ids=torch.randint(5, VOCAB_SIZE, (1, 9)))


@pytest.mark.parametrize("method", ["residual", "echo"])
def test_methods_work_on_images_too(method):
    model_type = IMAGE_ARCHITECTURES[0]
    inputs = tiny_inputs(model_type)
    with torch.no_grad():
        out = first_output(patched_model(model_type, METHODS[method])(**inputs))
    assert torch.isfinite(out).all()

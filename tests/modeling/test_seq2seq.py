"""Encoder-decoder models (T5, the BART family, Whisper): three chains, causality, cache-exact generation."""

import copy

import pytest
import torch
import transformers
from testing import (
    GENERATION_MODES,
    NUM_HEADS,
    NUM_LAYERS,
    SEQ2SEQ_ARCHITECTURES,
    SPEECH_ARCHITECTURES,
    VOCAB_SIZE,
    cached_and_uncached_generation,
    checkpointing_changes_no_gradient,
    generate,
    generation_gap,
    max_abs_diff,
    seq2seq_head,
    table,
    tiny_inputs,
    tiny_model,
)

import ea_hf
from ea_hf.modeling import attention as attention_module
from ea_hf.modeling.history import CACHE_ATTRIBUTE, ConvolutionHistory

EVOLVED = {"alpha": 0.4, "beta": 0.5, "decoder": {"alpha": 0.3}, "cross": {"alpha": 0.2, "beta": 0.6}}
NO_DROPOUT = {model_type: {"dropout_rate": 0.0} for model_type in ("t5", "mt5", "umt5")}


def seq2seq_lm(model_type: str, **overrides):
    """A tiny random seq2seq LM without dropout."""
    overrides = {**NO_DROPOUT.get(model_type, {"dropout": 0.0, "attention_dropout": 0.0}), **overrides}
    return tiny_model(model_type, seq2seq_head(model_type), **overrides)


# --------------------------------------------------------------------------------------------------
# Sites and settings
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", table(SEQ2SEQ_ARCHITECTURES))
def test_three_chains_with_their_own_settings(model_type):
    model = ea_hf.patch(seq2seq_lm(model_type), **EVOLVED)
    rows = ea_hf.summary(model).modules
    by_kind = {kind: [row for row in rows if row.role == kind] for kind in ("encoder", "decoder", "cross")}
    assert {kind: len(found) for kind, found in by_kind.items()} == dict.fromkeys(by_kind, NUM_LAYERS)
    for kind, alpha, beta in [("encoder", 0.4, 0.5), ("decoder", 0.3, 0.5), ("cross", 0.2, 0.6)]:
        assert [(row.layer, row.previous_layer) for row in by_kind[kind]] == [(0, None), (1, 0), (2, 1)]
        assert {(row.alpha, row.beta) for row in by_kind[kind]} == {(alpha, beta)}
    # Causal kernels (decoder, cross) keep 2 of 3 rows: H*H*2*3 + H parameters.
    assert {row.parameters for row in by_kind["encoder"]} == {NUM_HEADS**2 * 9 + NUM_HEADS}
    assert {row.parameters for row in by_kind["cross"]} == {NUM_HEADS**2 * 6 + NUM_HEADS}


def test_decoder_chains_default_to_no_skip_connection_and_can_be_switched_off():
    model = ea_hf.patch(seq2seq_lm("t5"), alpha=0.4, beta=0.3, kernel_size=5, init="xavier_uniform")
    stored = model.config.evolving_attention
    assert stored["encoder"] == {
        "alpha": 0.4,
        "beta": 0.3,
        "kernel_size": 5,
        "layers": None,
        "init": "xavier_uniform",
        "method": "conv",
    }
    assert stored["decoder"] == stored["cross"] == {**stored["encoder"], "alpha": 0.0}

    model = ea_hf.patch(seq2seq_lm("bart"), layers=[0], decoder={"layers": [1, 2], "kernel_size": 1}, cross=False)
    assert set(model.config.evolving_attention) == {"encoder", "decoder"}
    assert [(row.role, row.layer, row.kernel_size) for row in ea_hf.summary(model).modules] == [
        ("encoder", 0, 3),
        ("decoder", 1, 1),
        ("decoder", 2, 1),
    ]
    settings = ea_hf.EvolvingAttentionSettings(alpha=0.1, beta=0.9)
    model = ea_hf.patch(seq2seq_lm("marian"), decoder=settings)
    assert model.config.evolving_attention["decoder"] == settings.to_dict()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"decoder": {"alpha": 2.0}}, r"decoder: Invalid evolving-attention settings: alpha must be in \[0, 1\]"),
        ({"cross": {"kernel": 3}}, r"cross: Unknown evolving-attention setting\(s\) \['kernel'\]"),
        ({"decoder": {"layers": [3]}}, r"layer indices \[3\] out of range for decoder \(decoder\)"),
        ({"cross": "yes"}, "cross: must be a mapping of settings"),
        ({"decoder": False, "cross": False, "layers": None, "alpha": 0.1}, None),
    ],
)
def test_bad_per_role_settings_fail_before_touching_the_model(kwargs, message):
    model = seq2seq_lm("t5")
    if message is None:  # every kind but the encoder switched off is fine
        assert set(ea_hf.patch(model, **kwargs).config.evolving_attention) == {"encoder"}
        return
    with pytest.raises(ValueError, match=message):
        ea_hf.patch(model, **kwargs)
    assert not ea_hf.is_patched(model) and type(model) is transformers.T5ForConditionalGeneration


def test_decoder_settings_on_an_encoder_model_are_an_error():
    with pytest.raises(ValueError, match="BertModel has no decoder attention to configure"):
        ea_hf.patch(tiny_model("bert"), decoder={"alpha": 0.1})
    encoder_only = transformers.T5EncoderModel(tiny_model("t5").config)
    assert set(ea_hf.patch(encoder_only).config.evolving_attention) == {"encoder"}


# --------------------------------------------------------------------------------------------------
# What enters the evolution: T5's relative position bias is part of S
# --------------------------------------------------------------------------------------------------


def test_t5_position_bias_is_part_of_the_evolving_logits():
    """With beta = 1 and an identity (dirac) kernel, layer 0 computes softmax(ReLU(QK^T + bias)): the bias is
    inside the ReLU. Had it been added after the evolution, the probabilities would differ."""
    model = ea_hf.patch(tiny_model("t5", transformers.AutoModelForTextEncoding), alpha=0.0, beta=1.0, init="dirac")
    attention = model.encoder.block[0].layer[0].SelfAttention
    captured = {}
    attention.register_forward_hook(lambda m, args, kwargs, out: captured.update(x=args[0]), with_kwargs=True)
    inputs = tiny_inputs("t5")
    inputs.pop("decoder_input_ids")
    with torch.no_grad():
        probs = model(**inputs, output_attentions=True).attentions[0]
        x = captured["x"]
        q = attention.q(x).view(*x.shape[:2], NUM_HEADS, -1).transpose(1, 2)
        k = attention.k(x).view(*x.shape[:2], NUM_HEADS, -1).transpose(1, 2)
        bias = attention.compute_bias(x.shape[1], x.shape[1])
    assert bias.abs().max() > 0.1
    allowed = inputs["attention_mask"].bool()[:, None, None, :]
    real_rows = inputs["attention_mask"].bool()[:, None, :, None]
    scores = q @ k.transpose(-1, -2) + bias
    expected = torch.relu(scores.masked_fill(~(allowed & real_rows), 0.0)).masked_fill(~allowed, -1e30).softmax(-1)
    assert max_abs_diff(probs[real_rows.expand_as(probs)], expected[real_rows.expand_as(probs)]) <= 1e-6
    bias_after = (torch.relu((scores - bias).masked_fill(~allowed, 0.0)) + bias).masked_fill(~allowed, -1e30)
    assert max_abs_diff(probs, bias_after.softmax(-1)) > 1e-2


# --------------------------------------------------------------------------------------------------
# Causality and padding
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", table(SEQ2SEQ_ARCHITECTURES))
def test_later_decoder_tokens_change_nothing_before_them(model_type):
    model = ea_hf.patch(seq2seq_lm(model_type), **EVOLVED)
    inputs = tiny_inputs(model_type)
    length = inputs["decoder_input_ids"].shape[1]
    with torch.no_grad():
        reference = model(**inputs, output_hidden_states=True)
        for i in range(length - 1):
            changed = dict(inputs, decoder_input_ids=inputs["decoder_input_ids"].clone())
            changed["decoder_input_ids"][:, i + 1 :] = torch.randint(5, VOCAB_SIZE, (3, length - i - 1))
            out = model(**changed, output_hidden_states=True)
            assert torch.equal(out.logits[:, : i + 1], reference.logits[:, : i + 1]), i
            for hidden, ref in zip(out.decoder_hidden_states, reference.decoder_hidden_states, strict=True):
                assert torch.equal(hidden[:, : i + 1], ref[:, : i + 1]), i
            # ... while the changed positions do move: the check is not vacuous.
            assert max_abs_diff(out.logits[:, i + 1 :], reference.logits[:, i + 1 :]) > 1e-3


def test_a_non_causal_decoder_kernel_would_leak():
    """The converse: give the decoder's evolution a full (non-causal) kernel and the future leaks in."""
    model = ea_hf.patch(seq2seq_lm("bart"), **EVOLVED)
    evolution = model.model.decoder.layers[0].self_attn.evolving_attention
    full = torch.zeros(NUM_HEADS, NUM_HEADS, 3, 3)
    full[:, :, :2] = evolution.weight.detach()
    full[:, :, 2] = 1.0
    # The same layer with a centred kernel: its lower row reads the next target position.
    evolution.causal, evolution.weight = False, torch.nn.Parameter(full)
    inputs = tiny_inputs("bart")
    changed = dict(inputs, decoder_input_ids=inputs["decoder_input_ids"].clone())
    changed["decoder_input_ids"][:, 4:] = 7
    with torch.no_grad():
        # Position 3 reads row 4 of the first layer's map, which token 4 changed.
        leaked = max_abs_diff(model(**changed).logits[:, 3], model(**inputs).logits[:, 3])
    assert leaked > 1e-3


# Whisper's encoder takes no padding mask (its audio is padded with silence, which the model reads), so it has no
# source padding to test.
TEXT_SEQ2SEQ_ARCHITECTURES = [m for m in SEQ2SEQ_ARCHITECTURES if m not in SPEECH_ARCHITECTURES]


def source_padding_difference(model, model_type: str) -> float:
    """The largest difference between each example's logits in a batch with right-padded sources and alone."""
    inputs = tiny_inputs(model_type)
    worst = 0.0
    with torch.no_grad():
        batched = model(**inputs).logits
        for row, length in enumerate(inputs["attention_mask"].sum(-1).tolist()):
            alone = model(
                input_ids=inputs["input_ids"][row : row + 1, :length],
                decoder_input_ids=inputs["decoder_input_ids"][row : row + 1],
            ).logits
            worst = max(worst, max_abs_diff(batched[row], alone[0]))
    return worst


@pytest.mark.parametrize("model_type", table(TEXT_SEQ2SEQ_ARCHITECTURES))
def test_source_padding_changes_nothing(model_type):
    model = ea_hf.patch(seq2seq_lm(model_type), **EVOLVED)
    assert source_padding_difference(model, model_type) <= 1e-5
    # What sits under the padding never matters.
    inputs = tiny_inputs(model_type)
    noisy = dict(inputs, input_ids=inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, 42))
    with torch.no_grad():
        assert max_abs_diff(model(**noisy).logits, model(**inputs).logits) <= 1e-6


@pytest.mark.parametrize("model_type", table(TEXT_SEQ2SEQ_ARCHITECTURES))
def test_source_padding_moves_the_logits_without_the_convolution_mask(model_type, monkeypatch):
    """The converse: convolutions that read the padded source positions' logits (encoder and cross attention)
    move the real ones (0.07 to 1.5 apart on the tiny models, against at most 7.2e-6 with the mask)."""
    monkeypatch.setattr(attention_module, "convolution_mask", lambda *arguments: None)
    model = ea_hf.patch(seq2seq_lm(model_type), **EVOLVED)
    assert source_padding_difference(model, model_type) > 1e-2


# --------------------------------------------------------------------------------------------------
# Generation with the KV cache
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", GENERATION_MODES)
@pytest.mark.parametrize("model_type", table(SEQ2SEQ_ARCHITECTURES))
def test_generation_with_the_cache_equals_generation_without(model_type, mode):
    model = ea_hf.patch(seq2seq_lm(model_type), **EVOLVED)
    inputs = tiny_inputs(model_type)
    settings = GENERATION_MODES[mode]
    with torch.no_grad():
        cached = cached_and_uncached_generation(model, inputs, **settings)
    # (Whisper's generate returns a cache rebuilt from keys and values, splitting the batch and stacking it
    # again: the kept rows are split and stacked with them.)
    histories = cached.past_key_values.__dict__[CACHE_ATTRIBUTE]
    assert sorted(histories) == sorted((kind, i) for kind in ("decoder", "cross") for i in range(NUM_LAYERS))
    assert {h.seen for h in histories.values()} == {cached.sequences.shape[1] - 1}


def test_decoding_continues_from_the_cache_whisper_returns():
    """Whisper's generate rebuilds the cache it returns from the keys and values of each example; the
    convolution's kept rows are split and stacked with them, so a step from that cache computes what the full
    forward does. Without them (the cache as transformers alone rebuilds it) the step is refused."""
    model = ea_hf.patch(seq2seq_lm("whisper"), **EVOLVED)
    inputs = tiny_inputs("whisper")
    with torch.no_grad():
        generated = generate(model, inputs)
        cache = generated.past_key_values
        step = dict(input_features=inputs["input_features"], decoder_input_ids=generated.sequences[:, -1:])
        full = model(input_features=inputs["input_features"], decoder_input_ids=generated.sequences).logits[:, -1]
        assert max_abs_diff(model(**step, past_key_values=copy.deepcopy(cache)).logits[:, -1], full) <= 1e-5
        delattr(cache, CACHE_ATTRIBUTE)
        with pytest.raises(RuntimeError, match="kept convolution rows for 0"):
            model(**step, past_key_values=cache)


@pytest.mark.parametrize("num_beams", [1, 3], ids=["greedy", "beam"])
def test_generation_needs_the_kept_rows(num_beams, monkeypatch):
    """The converse of the test above: forgetting the earlier rows (or not reordering them with the beams)
    changes what is generated, so the cache-exactness test would catch a broken history."""
    model = ea_hf.patch(seq2seq_lm("t5"), **EVOLVED)
    inputs = tiny_inputs("t5")
    with torch.no_grad():
        reference = generate(model, inputs, num_beams=num_beams, use_cache=False)
        with monkeypatch.context() as patched:
            forget = ConvolutionHistory.extend

            def extend_without_history(self, new_rows, keep):
                self.rows = None
                return forget(self, new_rows, keep)

            patched.setattr(ConvolutionHistory, "extend", extend_without_history)
            assert generation_gap(generate(model, inputs, num_beams=num_beams), reference) > 1e-3
        if num_beams > 1:
            with monkeypatch.context() as patched:
                target = "ea_hf.modeling.model_classes.reorder_convolution_histories"
                patched.setattr(target, lambda cache, beam_idx: None)
                assert generation_gap(generate(model, inputs, num_beams=num_beams), reference) > 1e-3


@pytest.mark.parametrize("model_type", table(SEQ2SEQ_ARCHITECTURES))
def test_zero_weights_generate_what_the_original_generates(model_type):
    model = seq2seq_lm(model_type)
    inputs = tiny_inputs(model_type)
    with torch.no_grad():
        reference = generate(model, inputs, num_beams=2)
        ea_hf.patch(model, alpha=0.0, beta=0.0, decoder={"beta": 0.0}, cross={"beta": 0.0})
        assert generation_gap(generate(model, inputs, num_beams=2), reference) <= 1e-4


def test_step_by_step_forward_with_a_cache_equals_the_full_forward():
    """Manual incremental decoding through the model's forward (no generate): one token, then two at once."""
    model = ea_hf.patch(seq2seq_lm("t5"), **EVOLVED)
    inputs = tiny_inputs("t5")
    decoder_ids = inputs.pop("decoder_input_ids")
    with torch.no_grad():
        full = model(**inputs, decoder_input_ids=decoder_ids).logits
        encoder_outputs = model.get_encoder()(**inputs)
        step = model(**inputs, encoder_outputs=encoder_outputs, decoder_input_ids=decoder_ids[:, :1], use_cache=True)
        logits = [step.logits]
        for start, stop in [(1, 3), (3, 4), (4, 7)]:
            step = model(
                **inputs,
                encoder_outputs=encoder_outputs,
                decoder_input_ids=decoder_ids[:, start:stop],
                past_key_values=step.past_key_values,
                use_cache=True,
            )
            logits.append(step.logits)
    assert max_abs_diff(torch.cat(logits, dim=1), full) <= 1e-5


def test_a_cache_the_evolution_did_not_fill_is_refused():
    model = ea_hf.patch(seq2seq_lm("bart"), **EVOLVED)
    inputs = tiny_inputs("bart")
    with torch.no_grad():
        out = model(**inputs, use_cache=True)
        inputs.pop("decoder_input_ids")
        out.past_key_values.__dict__.pop(CACHE_ATTRIBUTE)
        with pytest.raises(RuntimeError, match="The KV cache holds 7 earlier tokens"):
            model(**inputs, decoder_input_ids=torch.full((3, 1), 9), past_key_values=out.past_key_values)


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["t5", "bart"])
def test_gradient_checkpointing_gives_the_same_gradients(model_type):
    inputs = tiny_inputs(model_type)
    labels = inputs["decoder_input_ids"].roll(-1, dims=1)
    make_model = lambda: ea_hf.patch(seq2seq_lm(model_type), **EVOLVED)  # noqa: E731
    plain = checkpointing_changes_no_gradient(make_model, **inputs, labels=labels)
    evolution = [n for n in plain if "evolving_attention" in n]
    assert len(evolution) == 2 * 3 * NUM_LAYERS  # weight and bias of every encoder, decoder and cross layer
    assert all(plain[n].abs().sum() > 0 for n in evolution)

"""ea_hf.patch / unpatch / summary on a real checkpoint and on every supported architecture."""

import dataclasses
import re
import threading

import pytest
import torch
import transformers
from testing import (
    ALL_ARCHITECTURES,
    AUDIO_ARCHITECTURES,
    METHODS,
    NUM_HEADS,
    NUM_LAYERS,
    SENTENCES,
    TEXT_ARCHITECTURES,
    defined,
    enable_checkpointing,
    example_alone,
    first_output,
    max_abs_diff,
    patched_model,
    table,
    tiny_config,
    tiny_inputs,
    tiny_model,
)

import ea_hf
from ea_hf.modeling import attention as attention_module
from ea_hf.modeling.architectures import (
    ARCHITECTURES,
    ArchitectureSpec,
    attention_roles_of_config,
    supported_model_types,
)
from ea_hf.modeling.attach import attention_roles
from ea_hf.modeling.call_state import REPLAYS_KEY
from ea_hf.modeling.evolution import AttentionMapEvolution
from ea_hf.modeling.masks import convolution_mask
from ea_hf.modeling.settings import EvolvingAttentionSettings

EXACT = 1e-5
PADDING = 1e-4


def state_snapshot(model):
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


# --------------------------------------------------------------------------------------------------
# Exactness: alpha = beta = 0 reproduces the original model
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reference_attention", ["sdpa", "eager"])
def test_exactness_on_pretrained_minilm(minilm_path, minilm_tokenizer, reference_attention):
    model = transformers.AutoModel.from_pretrained(minilm_path, attn_implementation=reference_attention).eval()
    batch = minilm_tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        reference = model(**batch).last_hidden_state
        ea_hf.patch(model, alpha=0.0, beta=0.0)
        patched = model(**batch).last_hidden_state
    mask = batch["attention_mask"].bool()
    assert max_abs_diff(patched[mask], reference[mask]) <= EXACT
    if reference_attention == "eager":
        # Same arithmetic as transformers' eager path, padded positions included.
        assert max_abs_diff(patched, reference) <= EXACT


@pytest.mark.parametrize("model_type", table(ALL_ARCHITECTURES))
def test_exactness_and_its_converse_on_every_architecture(model_type):
    model = tiny_model(model_type)
    inputs = tiny_inputs(model_type)
    with torch.no_grad():
        reference = first_output(model(**inputs))
        exact = first_output(ea_hf.patch(model, alpha=0.0, beta=0.0)(**inputs))
        evolved = first_output(ea_hf.patch(ea_hf.unpatch(model), alpha=0.4, beta=0.4)(**inputs))
    assert max_abs_diff(*(defined(model_type, inputs, out) for out in (exact, reference))) <= EXACT
    # With alpha, beta > 0 the model really computes something else (100x the fp32 noise above).
    assert max_abs_diff(evolved, reference) > 1e-5


@pytest.mark.parametrize("kernels", ["cpu-kernel", "torch-ops"])
@pytest.mark.parametrize("model_type", ["bert", "llama", "t5"])
def test_exactness_in_bfloat16(monkeypatch, model_type, kernels):
    """A bf16 model patched with alpha = beta = 0 computes eager attention's numbers, bit for bit: on torch
    operations its maps stay bf16 (the logits are masked and normalised in fp32, as eager attention's softmax
    runs); for the CPU kernel they are upcast to fp32 first, which is exact too."""
    monkeypatch.setenv("EA_HF_KERNELS", "1" if kernels == "cpu-kernel" else "0")
    model = tiny_model(model_type, attn_implementation="eager").to(torch.bfloat16)
    inputs = tiny_inputs(model_type)
    with torch.no_grad():
        reference = first_output(model(**inputs))
        exact = first_output(ea_hf.patch(model, alpha=0.0, beta=0.0)(**inputs))
    assert exact.dtype == torch.bfloat16
    assert torch.equal(*(defined(model_type, inputs, out) for out in (exact, reference)))


def test_only_chosen_layers_evolve():
    model = tiny_model("bert")
    inputs = tiny_inputs("bert")
    ea_hf.patch(model, alpha=0.3, beta=0.3, layers=[1, 2])
    rows = ea_hf.summary(model).modules
    assert [(m.layer, m.previous_layer) for m in rows] == [(1, None), (2, 1)]
    assert not hasattr(model.encoder.layer[0].attention.self, "evolving_attention")
    # Layer 0 stays plain: its attention probabilities equal those of the unpatched model.
    reference = tiny_model("bert", attn_implementation="eager")
    with torch.no_grad():
        ours = model(**inputs, output_attentions=True).attentions
        plain = reference(**inputs, output_attentions=True).attentions
    assert max_abs_diff(ours[0], plain[0]) <= EXACT
    assert max_abs_diff(ours[1], plain[1]) > 1e-4


# --------------------------------------------------------------------------------------------------
# Padding invariance: alone == in a padded batch
# --------------------------------------------------------------------------------------------------


def test_padding_invariance_on_pretrained_minilm(minilm, minilm_tokenizer):
    ea_hf.patch(minilm, alpha=0.4, beta=0.4)
    batch = minilm_tokenizer(SENTENCES, padding=True, return_tensors="pt")
    lengths = batch["attention_mask"].sum(dim=1)
    assert lengths.min() < lengths.max() - 5, "the test needs real padding"
    with torch.no_grad():
        batched = minilm(**batch).last_hidden_state
        for row, sentence in enumerate(SENTENCES):
            alone = minilm(**minilm_tokenizer(sentence, return_tensors="pt")).last_hidden_state[0]
            n = int(lengths[row])
            assert alone.shape[0] == n
            assert max_abs_diff(batched[row, :n], alone) <= PADDING


def padding_difference(model_type: str, method: str) -> float:
    """The largest difference, at an example's own positions, between its outputs in a padded batch of three
    and alone (text: tokens; speech: frames). Weights drawn with std 0.2: with the default 0.02 most tiny
    models' maps are so near uniform that a convolution reading the padding moved their outputs by less than
    1e-4 (6e-6 to 4e-5 on ten of them), which this test would not have seen."""
    model = patched_model(model_type, METHODS[method], initializer_range=0.2)
    inputs = tiny_inputs(model_type, batch=3, length=11)
    worst = 0.0
    with torch.no_grad():
        batched = first_output(model(**inputs))
        for row in range(3):
            alone, n = example_alone(model_type, inputs, row)
            output = first_output(model(**alone))[0]
            assert output.shape[0] == n and (row == 0 or n < batched.shape[1])
            worst = max(worst, max_abs_diff(batched[row, :n], output))
    return worst


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("model_type", table(TEXT_ARCHITECTURES + AUDIO_ARCHITECTURES))
def test_padding_invariance_on_every_padded_architecture(model_type, method):
    assert padding_difference(model_type, method) <= PADDING


@pytest.mark.parametrize("model_type", table(TEXT_ARCHITECTURES + AUDIO_ARCHITECTURES))
def test_padding_invariance_fails_without_the_convolution_mask(model_type, monkeypatch):
    """The converse: a convolution that reads the padded positions' logits moves the real ones."""
    monkeypatch.setattr(attention_module, "convolution_mask", lambda *arguments: None)
    assert padding_difference(model_type, "conv") > 100 * PADDING


def test_padding_content_cannot_leak():
    """Whatever token ids sit under the padding, valid positions see the same outputs."""
    model = ea_hf.patch(tiny_model("bert"), alpha=0.5, beta=0.9)
    inputs = tiny_inputs("bert", batch=2, length=12)
    other = dict(inputs)
    pad = inputs["attention_mask"] == 0
    other["input_ids"] = torch.where(pad, torch.randint(5, 99, pad.shape), inputs["input_ids"])
    assert (other["input_ids"] != inputs["input_ids"]).any()
    with torch.no_grad():
        a = model(**inputs).last_hidden_state
        b = model(**other).last_hidden_state
    valid = inputs["attention_mask"].bool()
    assert max_abs_diff(a[valid], b[valid]) <= 1e-6


# --------------------------------------------------------------------------------------------------
# Per-call state
# --------------------------------------------------------------------------------------------------


def test_nothing_survives_between_calls():
    model = ea_hf.patch(tiny_model("bert"), alpha=0.5, beta=0.5)
    a, b = tiny_inputs("bert", seed=1), tiny_inputs("bert", seed=2)
    with torch.no_grad():
        first = model(**a).last_hidden_state
        model(**b)
        again = model(**a).last_hidden_state
    assert torch.equal(first, again)
    for module in model.modules():
        assert not any(
            isinstance(v, torch.Tensor) and v.dim() == 4 for k, v in vars(module).items() if k != "_parameters"
        )


def test_two_threads_match_serial_runs():
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = ea_hf.patch(tiny_model("bert"), alpha=0.5, beta=0.5)
        inputs = [tiny_inputs("bert", batch=2, length=17, seed=s) for s in (1, 2)]
        with torch.no_grad():
            serial = [model(**x).last_hidden_state for x in inputs]
        results = {}
        barrier = threading.Barrier(2)

        def run(index):
            barrier.wait()
            with torch.no_grad():
                for _ in range(20):
                    results[index] = model(**inputs[index]).last_hidden_state

        threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i in (0, 1):
            assert torch.equal(results[i], serial[i])
    finally:
        torch.set_num_threads(threads_before)


def test_train_eval_and_no_grad_modes_agree():
    model = ea_hf.patch(tiny_model("bert", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), alpha=0.3)
    inputs = tiny_inputs("bert")
    with torch.no_grad():
        eval_out = model.eval()(**inputs).last_hidden_state
    train_out = model.train()(**inputs).last_hidden_state
    assert train_out.requires_grad
    assert max_abs_diff(train_out, eval_out) <= 1e-6
    train_out.sum().backward()
    evolution = model.encoder.layer[0].attention.self.evolving_attention
    assert evolution.weight.grad is not None and evolution.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("gates", ["fixed", "learned"])
@pytest.mark.parametrize("model_type", ["bert", "vit"])
def test_gradient_checkpointing_gives_the_same_gradients(model_type, gates):
    def gradients(checkpointing: bool):
        model = tiny_model(model_type, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = ea_hf.patch(model, alpha=0.4, beta=0.4, gates=gates)
        if checkpointing:
            enable_checkpointing(model)
            assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
        model.train()
        first_output(model(**tiny_inputs(model_type))).pow(2).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, checkpointed = gradients(False), gradients(True)
    assert plain.keys() == checkpointed.keys()
    assert any("evolving_attention" in name for name in plain)
    assert (gates == "learned") == any(name.endswith("beta_gate") for name in plain)
    # The first layer's convolution only gets gradient through the chain to later layers.
    first_conv = [n for n in plain if "evolving_attention.weight" in n][0]
    assert plain[first_conv].abs().sum() > 0
    for name in plain:
        assert max_abs_diff(plain[name], checkpointed[name]) <= 1e-5, name


def test_reentrant_checkpointing_is_refused():
    model = ea_hf.patch(tiny_model("bert"))
    with pytest.raises(ValueError, match="use_reentrant"):
        enable_checkpointing(model, use_reentrant=True)


def test_output_attentions_are_the_evolved_probabilities():
    model = ea_hf.patch(tiny_model("bert"), alpha=0.5, beta=0.5)
    inputs = tiny_inputs("bert")
    chain_logits = []
    # Record each layer's evolved logits as the evolution module returns them.
    for layer in model.encoder.layer:
        layer.attention.self.evolving_attention.register_forward_hook(lambda m, a, out: chain_logits.append(out))
    with torch.no_grad():
        attentions = model(**inputs, output_attentions=True).attentions
    assert len(attentions) == NUM_LAYERS
    allowed = inputs["attention_mask"].bool()[:, None, None, :]
    for probs, logits in zip(attentions, chain_logits, strict=True):
        expected = logits.masked_fill(~allowed, torch.finfo(logits.dtype).min).softmax(-1)
        assert probs.shape == (3, NUM_HEADS, 9, 9)
        assert max_abs_diff(probs, expected) <= 1e-6
        assert max_abs_diff(probs.sum(-1), torch.ones(())) <= 1e-5
        assert probs.masked_select(~allowed.expand_as(probs)).abs().max() == 0


def test_esm_contact_prediction_reads_the_evolved_maps():
    """ESM-2's contact head regresses contacts from every layer's attention maps: in an EA model, the evolved
    probabilities (the unpatched reference: eager attention, as sdpa returns no maps)."""
    inputs = tiny_inputs("esm", batch=2, length=11)
    reference = tiny_model("esm", transformers.AutoModelForMaskedLM, attn_implementation="eager", initializer_range=0.2)

    def contacts(settings):
        model = ea_hf.patch(tiny_model("esm", transformers.AutoModelForMaskedLM, initializer_range=0.2), **settings)
        with torch.no_grad():
            return model.predict_contacts(inputs["input_ids"], inputs["attention_mask"])

    with torch.no_grad():
        expected = reference.predict_contacts(inputs["input_ids"], inputs["attention_mask"])
    assert expected.shape == (2, 9, 9)  # (less the first and last token)
    assert max_abs_diff(contacts({"alpha": 0.0, "beta": 0.0}), expected) <= EXACT
    assert max_abs_diff(contacts({"alpha": 0.5, "beta": 0.5}), expected) > 1e-3


# --------------------------------------------------------------------------------------------------
# Bad input: clear errors, model untouched
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"alpha": 1.5}, r"alpha must be in \[0, 1\]"),
        ({"alpha": -0.1}, r"alpha must be in \[0, 1\]"),
        ({"beta": float("nan")}, r"beta must be in \[0, 1\]"),
        ({"beta": "0.2"}, "beta must be a number"),
        ({"kernel_size": 4}, "kernel_size must be a positive odd integer"),
        ({"kernel_size": 0}, "kernel_size must be a positive odd integer"),
        ({"kernel_size": -3}, "kernel_size must be a positive odd integer"),
        ({"layers": [0, 3]}, r"layer indices \[3\] out of range .* has 3 layers \(0..2\)"),
        ({"layers": [-1]}, "non-negative integers"),
        ({"layers": []}, "at least one layer"),
        ({"layers": [1, 1]}, "must not repeat"),
        ({"init": "orthogonal"}, "init must be one of kaiming_uniform, xavier_uniform, normal, dirac"),
    ],
)
def test_bad_settings_fail_before_touching_the_model(kwargs, message):
    model = tiny_model("bert")
    before, config_before = state_snapshot(model), model.config.to_dict()
    with pytest.raises(ValueError, match=message):
        ea_hf.patch(model, **kwargs)
    assert type(model) is transformers.BertModel and type(model.config) is transformers.BertConfig
    assert model.config.to_dict() == config_before
    assert {m.config._attn_implementation for m in model.modules() if hasattr(m, "config")} == {"sdpa"}
    after = state_snapshot(model)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert not ea_hf.is_patched(model)


def test_unsupported_architecture_names_the_supported_ones():
    torch.manual_seed(0)
    config = transformers.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=99)
    model = transformers.BloomModel(config)
    supported = ", ".join(supported_model_types())
    assert supported.split(", ") == sorted(ea_hf.ARCHITECTURES)  # every architecture of the table, sorted
    with pytest.raises(ValueError, match=rf"does not support model_type 'bloom'.*Supported: {re.escape(supported)}\.$"):
        ea_hf.patch(model)
    assert not ea_hf.is_patched(model)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        ea_hf.patch(torch.nn.Linear(2, 2))


def test_patching_twice_is_refused():
    model = ea_hf.patch(tiny_model("bert"))
    before = state_snapshot(model)
    with pytest.raises(ValueError, match="already patched"):
        ea_hf.patch(model, alpha=0.1)
    assert state_snapshot(model).keys() == before.keys()
    assert model.config.evolving_attention["encoder"]["alpha"] == 0.2


# --------------------------------------------------------------------------------------------------
# unpatch and summary
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", table(ALL_ARCHITECTURES))
def test_unpatch_restores_the_original_model(model_type):
    model = tiny_model(model_type)
    inputs = tiny_inputs(model_type)
    original_type, keys, config_before = type(model), set(model.state_dict()), model.config.to_dict()
    implementation = model.config._attn_implementation  # sdpa, or eager where the model has no sdpa (Gemma 2)
    callers_config, config_class = model.config, type(model.config)
    with torch.no_grad():
        reference = first_output(model(**inputs))
    ea_hf.patch(model, alpha=0.5, beta=0.5)
    # The model got a config of its own, shared by all its modules; the one the caller built it from is untouched.
    assert model.config is not callers_config and callers_config.to_dict() == config_before
    assert type(callers_config) is config_class and not hasattr(callers_config, "evolving_attention")
    assert not [m for m in model.modules() if getattr(m, "config", model.config) is callers_config]
    ea_hf.unpatch(model)
    assert type(model) is original_type and type(model.config) is type(tiny_model(model_type).config)
    assert set(model.state_dict()) == keys
    assert model.config.to_dict() == config_before
    assert {m.config._attn_implementation for m in model.modules() if hasattr(m, "config")} == {implementation}
    assert all(len(m._forward_pre_hooks) == 0 for m in model.modules())
    with torch.no_grad():
        assert torch.equal(first_output(model(**inputs)), reference)
    with pytest.raises(ValueError, match="not patched"):
        ea_hf.unpatch(model)


def test_two_models_of_one_config_patch_and_unpatch_independently():
    config = tiny_config("bert")
    before = config.to_dict()
    patched = ea_hf.patch(transformers.BertModel(config), alpha=0.2, beta=0.2)
    plain = transformers.BertModel(config)  # built from the same config after the first was patched
    assert type(config) is transformers.BertConfig and config.to_dict() == before
    assert not ea_hf.is_patched(plain) and not hasattr(plain.config, "evolving_attention")
    ea_hf.patch(plain, alpha=0.4, beta=0.1)  # not "already patched"
    assert patched.config.evolving_attention["encoder"]["alpha"] == 0.2
    assert plain.config.evolving_attention["encoder"]["alpha"] == 0.4
    ea_hf.unpatch(patched)
    assert ea_hf.is_patched(plain) and plain.config.evolving_attention["encoder"]["alpha"] == 0.4
    assert patched.config.to_dict() == before and type(patched.config) is transformers.BertConfig
    ea_hf.unpatch(plain)
    assert plain.config.to_dict() == before == config.to_dict()


def test_summary_counts_added_parameters(minilm):
    total_before = sum(p.numel() for p in minilm.parameters())
    ea_hf.patch(minilm, kernel_size=5, layers=[0, 2, 5])
    report = ea_hf.summary(minilm)
    per_layer = 12 * 12 * 5 * 5 + 12
    assert report.added_parameters == 3 * per_layer == 10_836
    assert report.total_parameters == total_before + report.added_parameters
    assert [m.layer for m in report.modules] == [0, 2, 5]
    assert [m.previous_layer for m in report.modules] == [None, 0, 2]
    text = str(report)
    assert "encoder.layer.2.attention.self.evolving_attention" in text
    assert "10,836 added parameters" in text


def test_init_schemes_are_deterministic_and_distinct():
    def first_weight(init, seed):
        torch.manual_seed(seed)
        model = ea_hf.patch(tiny_model("bert"), init=init)
        return model.encoder.layer[0].attention.self.evolving_attention

    for init in ("kaiming_uniform", "xavier_uniform", "normal", "dirac"):
        a, b = first_weight(init, 7), first_weight(init, 7)
        assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    dirac = first_weight("dirac", 0)
    expected = torch.zeros(NUM_HEADS, NUM_HEADS, 3, 3)
    expected[range(NUM_HEADS), range(NUM_HEADS), 1, 1] = 1.0
    assert torch.equal(dirac.weight, expected) and torch.equal(dirac.bias, torch.zeros(NUM_HEADS))
    normal = first_weight("normal", 0)
    assert abs(normal.weight.std().item() - 0.02) < 0.005 and normal.bias.abs().max() == 0
    kaiming = first_weight("kaiming_uniform", 0)
    bound = 1 / (NUM_HEADS * 9) ** 0.5  # torch's Conv2d default: kaiming_uniform(a=sqrt(5)) -> U(-b, b)
    assert kaiming.weight.abs().max() <= bound and kaiming.weight.abs().max() > 0.8 * bound


def test_modernberts_local_layers_never_convolve_entries_outside_their_window():
    """The mask transformers hands a local (sliding-window) layer removes the entries outside the window, so the
    evolution zeroes them before the convolution: changing them leaves every entry inside the window, and the
    previous layer's logits the chain passes on there, bit-identical. Local and global layers form one chain."""
    model = patched_model("modernbert", METHODS["conv"])
    local = model.layers[1].attn  # layer_types: full, sliding (2 tokens each side), full
    captured = {}
    local.register_forward_pre_hook(lambda module, args, kwargs: captured.update(kwargs), with_kwargs=True)
    inputs = tiny_inputs("modernbert", batch=2, length=11)
    with torch.no_grad():
        model(**inputs)
    allowed = captured["attention_mask"]
    assert allowed.dtype == torch.bool
    rows, columns = torch.meshgrid(torch.arange(11), torch.arange(11), indexing="ij")
    assert not allowed[..., (rows - columns).abs() > 2].any()  # the window is in the mask
    assert allowed[0, 0][(rows - columns).abs() <= 2].all()  # the first example has no padding
    evolution = local.evolving_attention
    assert evolution.previous == 0 and model.layers[2].attn.evolving_attention.previous == 1
    conv_mask = convolution_mask("encoder", allowed, 11, 0, {})
    scores = torch.randn(2, NUM_HEADS, 11, 11, generator=torch.Generator().manual_seed(3))
    previous = torch.randn(2, NUM_HEADS, 11, 11, generator=torch.Generator().manual_seed(4))
    outside = torch.randn(scores.shape, generator=torch.Generator().manual_seed(5)) * ~conv_mask
    with torch.no_grad():
        one = evolution(scores.clone(), conv_mask, {("encoder", 0): previous})
        other = evolution((scores + outside).clone(), conv_mask, {("encoder", 0): previous + outside})
    assert outside.abs().sum() > 0
    assert torch.equal(one[conv_mask.expand_as(one)], other[conv_mask.expand_as(other)])


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
def test_albert_chains_every_call_of_its_one_shared_layer(grad, monkeypatch):
    """ALBERT calls one layer's weights at every depth. Its one evolution module is a layer of the chain at each
    call: the first call evolves S alone, and call k mixes in exactly the logits call k - 1 produced."""
    model = patched_model("albert", METHODS["conv"])
    evolutions = [m for m in model.modules() if isinstance(m, AttentionMapEvolution)]
    assert len(evolutions) == 1 and ea_hf.summary(model).added_parameters == NUM_HEADS**2 * 9 + NUM_HEADS
    assert "call" in str(ea_hf.summary(model)).splitlines()[1].split()
    evolution = evolutions[0]
    calls = []  # per call: the logits waiting in the chain, and the logits it produced

    def record(method):
        def recorded(*args, **kwargs):
            chain = next(value for value in (*args, *kwargs.values()) if isinstance(value, dict))
            waiting = chain.get(evolution.key)
            waiting = None if waiting is None else waiting.detach().clone()
            scores = None if grad else args[0].clone()  # forward(scores, conv_mask, chain): S may be overwritten
            logits = method(*args, **kwargs)
            produced = chain[evolution.key].detach().clone()
            if not grad:  # ... and what it produced is the paper's equations on S and the waiting logits
                alpha, beta, conv_mask = evolution.alpha, evolution.beta, args[1]
                mixed = scores if waiting is None else alpha * waiting + (1 - alpha) * scores
                convolved = evolution.convolve(mixed if conv_mask is None else mixed.masked_fill(~conv_mask, 0.0))
                assert max_abs_diff(produced, beta * convolved + (1 - beta) * mixed) <= 1e-5
            calls.append((waiting, produced))
            return logits

        return recorded

    # With autograd the whole attention core runs (attend); without, the evolution alone (forward).
    monkeypatch.setattr(
        evolution, "attend" if grad else "forward", record(evolution.attend if grad else evolution.forward)
    )
    with torch.set_grad_enabled(grad):
        model(**tiny_inputs("albert"))
    assert len(calls) == NUM_LAYERS
    assert calls[0][0] is None
    for k in range(1, NUM_LAYERS):
        assert torch.equal(calls[k][0], calls[k - 1][1]), k


def test_albert_evolves_all_its_layers_or_none():
    model = tiny_model("albert")
    with pytest.raises(ValueError, match="calls one layer's weights at every depth.*leave layers unset"):
        ea_hf.patch(model, layers=[0])
    assert not ea_hf.is_patched(model)


def test_a_shared_layer_cannot_be_replayed():
    """Gradient checkpointing replays layers after the forward call: a shared module would then find the stack's
    last logits instead of those of the call before it. ALBERT has no checkpointing; any other stack is refused."""
    evolution = AttentionMapEvolution(NUM_HEADS, alpha=0.5, beta=0.5, kernel_size=3)
    evolution.shared_across_layers = True
    scores = torch.randn(1, NUM_HEADS, 5, 5, requires_grad=True)
    with pytest.raises(RuntimeError, match="shared across layers cannot be replayed"):
        evolution(scores, None, {REPLAYS_KEY: True})
    assert evolution(scores, None, {REPLAYS_KEY: False}).shape == scores.shape


def test_causal_attention_through_a_module_patched_as_encoder_attention_is_refused(monkeypatch):
    """CLIP's text tower attends causally through CLIPAttention, whose is_causal is false; were it in the table,
    its layers would get bidirectional kernels that read later tokens. The call is refused instead."""
    spec = ArchitectureSpec(("CLIPAttention",), num_heads_attribute="num_heads")
    monkeypatch.setitem(ARCHITECTURES, "clip_text_model", spec)
    model = ea_hf.patch(transformers.CLIPTextModel(tiny_config("clip_text_model")).eval())
    assert {row.role for row in ea_hf.summary(model).modules} == {"encoder"}
    with pytest.raises(RuntimeError, match="attends causally .* would read later tokens"):
        model(input_ids=tiny_inputs("bert")["input_ids"])


def test_a_family_newer_than_the_installed_transformers_is_refused_naming_the_release(monkeypatch):
    monkeypatch.setitem(ARCHITECTURES, "bert", dataclasses.replace(ARCHITECTURES["bert"], since="5.99.0"))
    model = tiny_model("bert")
    with pytest.raises(NotImplementedError, match=r"supports bert from transformers 5\.99\.0 on .* is installed"):
        ea_hf.patch(model)
    assert not ea_hf.is_patched(model) and type(model).__name__ == "BertModel"
    monkeypatch.setitem(ARCHITECTURES, "bert", dataclasses.replace(ARCHITECTURES["bert"], since="5.0.0"))
    assert ea_hf.is_patched(ea_hf.patch(model))


@pytest.mark.parametrize("model_type", table(ALL_ARCHITECTURES))
def test_the_config_alone_tells_the_attention_roles(model_type):
    """What model cards and recipes read without building a model: the roles patch finds in its modules."""
    model = tiny_model(model_type)
    assert list(attention_roles_of_config(model.config)) == attention_roles(model)


def test_patch_takes_settings_as_one_object_or_as_fields():
    settings = EvolvingAttentionSettings(alpha=0.3, beta=0.1, kernel_size=5, layers=(1,), init="dirac")
    by_object = ea_hf.patch(tiny_model("t5"), settings, cross=False)
    by_fields = ea_hf.patch(tiny_model("t5"), alpha=0.3, beta=0.1, kernel_size=5, layers=[1], init="dirac", cross=False)
    assert by_object.config.evolving_attention == by_fields.config.evolving_attention
    assert by_object.config.evolving_attention["encoder"] == settings.to_dict()
    with pytest.raises(TypeError, match="as an EvolvingAttentionSettings or as fields, not both"):
        ea_hf.patch(tiny_model("bert"), settings, alpha=0.1)
    with pytest.raises(ValueError, match="BertModel has no cross attention to configure"):
        ea_hf.patch(tiny_model("bert"), settings, cross={"beta": 0.1})

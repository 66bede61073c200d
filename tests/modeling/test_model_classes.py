"""EA config/model classes: Auto registration, save/load, and loading without ea_hf (trust_remote_code)."""

import json
import logging
import os
import textwrap

import pytest
import torch
import transformers
from safetensors.torch import load_file
from testing import (
    ALL_ARCHITECTURES,
    DECODER_ONLY_ARCHITECTURES,
    PAD,
    SAVED_MODELING_FILES,
    SEQ2SEQ_ARCHITECTURES,
    SHARED_LAYER_ARCHITECTURES,
    SPEECH_ARCHITECTURES,
    first_output,
    left_padded_inputs,
    max_abs_diff,
    run_without_ea_hf,
    table,
    tiny_config,
    tiny_inputs,
    tiny_model,
)

import ea_hf
from ea_hf.modeling.architectures import ARCHITECTURES, ArchitectureSpec, installed_release_supports
from ea_hf.modeling.model_classes import auto_class_names, register_auto_classes

SETTINGS = {"alpha": 0.4, "beta": 0.3, "kernel_size": 3, "layers": [0, 2], "init": "xavier_uniform"}


def settings_of(model_type: str) -> dict:
    """SETTINGS, less the choice of layers where one module serves every layer (ALBERT evolves all or none)."""
    if model_type in SHARED_LAYER_ARCHITECTURES:
        return {name: value for name, value in SETTINGS.items() if name != "layers"}
    return SETTINGS


# Every head, the causal-LM ones included: for encoder architectures with is_decoder=False (the tiny configs'
# default) their attention is bidirectional; for the BART family (BartForCausalLM & co.) it is the decoder alone.
HEAD_CASES = [(model_type, head) for model_type in ALL_ARCHITECTURES for head in auto_class_names(model_type)]
# Seq2seq heads that read the source only (or derive the decoder inputs from it).
SOURCE_ONLY_HEADS = {
    "AutoModelForAudioClassification",
    "AutoModelForSequenceClassification",
    "AutoModelForQuestionAnswering",
    "AutoModelForTokenClassification",
    "AutoModelForTextEncoding",
}


def load_quietly(auto_class, path, **kwargs):
    return auto_class.from_pretrained(path, output_loading_info=True, **kwargs)


@pytest.mark.parametrize("model_type, head", table(HEAD_CASES, 0), ids=[f"{m}-{h}" for m, h in HEAD_CASES])
def test_every_head_saves_and_loads_through_its_auto_class(model_type, head, tmp_path, caplog):
    auto_class = getattr(transformers, head)
    torch.manual_seed(0)
    # The class itself, not `from_config`: transformers' Auto lookup fails for multi-class entries (DeiT) on
    # configs without `architectures`.
    base_class = getattr(transformers, auto_class_names(model_type)[head])
    model = ea_hf.patch(base_class(tiny_config(model_type)).eval(), **settings_of(model_type))
    inputs = tiny_inputs(model_type, batch=2)
    if head == "AutoModelForCausalLM" and model_type in SPEECH_ARCHITECTURES:  # the decoder alone
        inputs = {"input_ids": inputs["decoder_input_ids"]}
    if head in SOURCE_ONLY_HEADS or head == "AutoModelForCausalLM":
        inputs.pop("decoder_input_ids", None)
    if head == "AutoModelForMultipleChoice":  # [batch, choices, length]
        inputs = {name: value[:, None].repeat(1, 2, 1) for name, value in inputs.items()}
    with torch.no_grad():
        expected = first_output(model(**inputs))
    model.save_pretrained(tmp_path)

    with caplog.at_level(logging.WARNING, logger="transformers"):
        loaded, info = load_quietly(auto_class, tmp_path)
    assert type(loaded) is type(model) and type(loaded).__name__.startswith("EA")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert "newly initialized" not in caplog.text and "MISSING" not in caplog.text
    # fp32 noise, not bit for bit: how some CPU kernels round depends on the alignment of the memory-mapped weights.
    with torch.no_grad():
        assert max_abs_diff(first_output(loaded.eval()(**inputs)), expected) <= 1e-5


@pytest.mark.parametrize("model_type", table(ALL_ARCHITECTURES))
def test_config_json_carries_every_setting_and_safetensors_weights(model_type, tmp_path):
    settings = settings_of(model_type)
    model = ea_hf.patch(tiny_model(model_type), **settings)
    model.save_pretrained(tmp_path)
    files = set(os.listdir(tmp_path))
    assert {"config.json", "model.safetensors", *SAVED_MODELING_FILES} <= files
    assert not files & {"patching.py", "__init__.py"}  # what a saved model does not need stays behind
    assert not any(name.endswith((".bin", ".pt", ".pth")) for name in files)

    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == f"ea-{model_type}"
    first_role = "decoder" if model_type in DECODER_ONLY_ARCHITECTURES else "encoder"
    expected = {first_role: {"layers": None, **settings, "method": "conv"}}
    if model_type in SEQ2SEQ_ARCHITECTURES:  # the papers' defaults: no skip connection, every layer
        expected |= {kind: {**expected["encoder"], "alpha": 0.0, "layers": None} for kind in ("decoder", "cross")}
    assert config["evolving_attention"] == expected
    assert config["auto_map"]["AutoConfig"] == f"config_classes.EA{type(tiny_config(model_type)).__name__}"
    assert config["auto_map"]["AutoModel"] == f"model_classes.EA{type(tiny_model(model_type)).__name__}"
    assert config["architectures"] == [type(model).__name__]

    weights = load_file(tmp_path / "model.safetensors")
    evolution_keys = sorted(k for k in weights if "evolving_attention" in k)
    # Encoder layers 0 and 2 (+ all 3 decoder and 3 cross layers), weight and bias each.
    decoder_layers = 2 * 3 if model_type in SEQ2SEQ_ARCHITECTURES else 0
    encoder_modules = 1 if model_type in SHARED_LAYER_ARCHITECTURES else 2  # ALBERT: one module, every layer
    assert len(evolution_keys) == 2 * (encoder_modules + decoder_layers)
    # Causal kernels keep the rows at and above the centre.
    shapes = {(4,)} | ({(4, 4, 2, 3)} if decoder_layers or first_role == "decoder" else set())
    shapes |= set() if first_role == "decoder" else {(4, 4, 3, 3)}
    assert {tuple(weights[k].shape) for k in evolution_keys} == shapes


def test_pretrained_minilm_round_trip(minilm, minilm_tokenizer, tmp_path):
    ea_hf.patch(minilm, alpha=0.2, beta=0.2)
    batch = minilm_tokenizer(["Round trips keep every number."], return_tensors="pt")
    with torch.no_grad():
        expected = minilm(**batch).last_hidden_state
    minilm.save_pretrained(tmp_path)
    loaded, info = load_quietly(transformers.AutoModel, tmp_path)
    assert not info["missing_keys"]
    assert loaded.config.evolving_attention["encoder"]["alpha"] == 0.2
    assert ea_hf.summary(loaded).added_parameters == 6 * (12 * 12 * 9 + 12)
    with torch.no_grad():
        assert torch.equal(loaded.eval()(**batch).last_hidden_state, expected)


def test_plain_checkpoint_loads_into_an_ea_class_with_fresh_evolution(tmp_path):
    tiny_model("bert").save_pretrained(tmp_path)
    ea_class = ea_hf.evolving_attention_model_class(transformers.BertModel)
    config = ea_class.config_class.from_dict(
        {**json.loads((tmp_path / "config.json").read_text()), "evolving_attention": {"encoder": {"init": "dirac"}}}
    )
    torch.manual_seed(0)
    model, info = ea_class.from_pretrained(tmp_path, config=config, output_loading_info=True)
    assert sorted(info["missing_keys"]) == sorted(
        f"encoder.layer.{i}.attention.self.evolving_attention.{p}" for i in range(3) for p in ("weight", "bias")
    )
    evolution = model.encoder.layer[1].attention.self.evolving_attention
    identity = torch.zeros(4, 4, 3, 3)
    identity[range(4), range(4), 1, 1] = 1
    assert torch.equal(evolution.weight, identity) and torch.equal(evolution.bias, torch.zeros(4))
    assert model.config.evolving_attention["encoder"] == {
        "alpha": 0.2,
        "beta": 0.2,
        "kernel_size": 3,
        "layers": None,
        "init": "dirac",
        "method": "conv",
    }


def test_registration_passes_over_architectures_newer_than_the_installed_transformers(monkeypatch):
    """The table may name architectures that an older supported transformers lacks (their ``since``): importing
    ea_hf registers the Auto classes of the others instead of failing."""
    newer = ArchitectureSpec(("NotYetReleasedAttention",), since="99.0.0")
    monkeypatch.setitem(ARCHITECTURES, "not_yet_released", newer)
    assert "not_yet_released" not in transformers.CONFIG_MAPPING
    register_auto_classes()
    assert transformers.AutoConfig.for_model("ea-bert").model_type == "ea-bert"


def test_ea_config_builds_an_ea_model_from_scratch():
    config_class = ea_hf.evolving_attention_config_class(transformers.BertConfig)
    config = config_class(**tiny_config("bert").to_diff_dict(), evolving_attention={"encoder": {"beta": 0.1}})
    assert isinstance(transformers.AutoConfig.for_model("ea-bert"), config_class)
    model = transformers.AutoModelForMaskedLM.from_config(config)
    assert type(model).__name__ == "EABertForMaskedLM"
    assert [m.beta for m in ea_hf.summary(model).modules] == [0.1, 0.1, 0.1]
    assert model.config.evolving_attention["encoder"]["alpha"] == 0.2


def test_bad_config_settings_are_reported():
    config_class = ea_hf.evolving_attention_config_class(transformers.BertConfig)
    tiny = tiny_config("bert").to_diff_dict()
    with pytest.raises(ValueError, match="unknown attention role"):
        transformers.AutoModel.from_config(config_class(**tiny, evolving_attention={"decodr": {}}))
    with pytest.raises(ValueError, match=r"attention role\(s\) \['decoder'\] that EABertModel does not have"):
        transformers.AutoModel.from_config(config_class(**tiny, evolving_attention={"decoder": {}}))
    with pytest.raises(ValueError, match=r"Unknown evolving-attention setting\(s\) \['alpah'\]"):
        transformers.AutoModel.from_config(config_class(**tiny, evolving_attention={"encoder": {"alpah": 0.1}}))
    with pytest.raises(ValueError, match="kernel_size must be a positive odd integer"):
        transformers.AutoModel.from_config(config_class(**tiny, evolving_attention={"encoder": {"kernel_size": 2}}))


def test_other_attention_implementations_are_refused(tmp_path):
    ea_hf.patch(tiny_model("bert")).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="would drop the evolution"):
        transformers.AutoModel.from_pretrained(tmp_path, attn_implementation="sdpa")
    model = transformers.AutoModel.from_pretrained(tmp_path)
    assert model.config._attn_implementation == "evolving_attention"
    with pytest.raises(ValueError, match="would drop the evolution"):
        model.set_attn_implementation("eager")


REMOTE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.modules["ea_hf"] = None  # ea_hf is not importable in this interpreter
    import torch, transformers
    results = {}
    for path, head, input_path in json.loads(sys.argv[1]):
        inputs = torch.load(input_path)
        model = getattr(transformers, head).from_pretrained(path, trust_remote_code=True).eval()
        with torch.no_grad():
            output = model(**inputs)[0]
            generated = model.generate(**inputs, max_new_tokens=5, do_sample=False) if "CausalLM" in head else None
        results[path] = {"class": type(model).__module__ + "." + type(model).__name__, "output": output.tolist()}
        results[path]["generated"] = None if generated is None else generated.tolist()
    print(json.dumps(results))
    """
)


def test_checkpoints_load_without_ea_hf_through_trust_remote_code(tmp_path):
    cases, expected, generated = [], {}, {}
    for model_type, head in [
        ("bert", "AutoModelForSequenceClassification"),
        ("vit", "AutoModelForImageClassification"),
        ("distilbert", "AutoModel"),
        ("modernbert", "AutoModelForMaskedLM"),
        ("esm", "AutoModelForMaskedLM"),
        ("wav2vec2", "AutoModelForAudioClassification"),  # a padded batch of waveforms
        ("audio-spectrogram-transformer", "AutoModelForAudioClassification"),
        ("t5", "AutoModelForSeq2SeqLM"),
        ("marian", "AutoModelForSeq2SeqLM"),
        ("llama", "AutoModelForCausalLM"),
        ("gemma2", "AutoModelForCausalLM"),
        ("gpt2", "AutoModelForCausalLM"),
        ("gpt_neox", "AutoModelForCausalLM"),  # its cache as layer_past, its head size under its own name
    ]:
        if not installed_release_supports(ARCHITECTURES[model_type]):  # (wav2vec2 before transformers 5.16)
            continue
        path = tmp_path / model_type
        model = ea_hf.patch(tiny_model(model_type, getattr(transformers, head)), alpha=0.4, beta=0.4)
        if head == "AutoModelForCausalLM":
            model.generation_config.pad_token_id = PAD
        model.save_pretrained(path)
        decoder_only = model_type in DECODER_ONLY_ARCHITECTURES
        inputs = left_padded_inputs(batch=2) if decoder_only else tiny_inputs(model_type, batch=2)
        torch.save(inputs, path / "inputs.pt")
        with torch.no_grad():
            expected[str(path)] = first_output(model(**inputs))
            if head == "AutoModelForCausalLM":  # cached generation too, kept rows included
                generated[str(path)] = model.generate(**inputs, max_new_tokens=5, do_sample=False).tolist()
        cases.append((str(path), head, str(path / "inputs.pt")))
    results = run_without_ea_hf(REMOTE_SCRIPT, json.dumps(cases), folder=tmp_path)
    for path, result in results.items():
        assert result["class"].startswith("transformers_modules.") and ".model_classes.EA" in result["class"]
        # Float rounding only: the copy without ea_hf evolves with torch operations, not the CPU kernel.
        assert (torch.tensor(result["output"]) - expected[path]).abs().max() <= 1e-5
        assert result["generated"] == generated.get(path)
    assert len(generated) == 4


def test_a_model_subclassed_by_a_wrapper_saves_as_its_ea_class(tmp_path):
    """FSDP2 turns the model's class into a subclass made at run time (``FSDPEALlamaForCausalLM``, defined in
    torch): the checkpoint's auto_map and code stay the EA class's, as if it had been saved unwrapped."""
    model = ea_hf.patch(tiny_model("llama", transformers.AutoModelForCausalLM))
    ea_class = type(model)
    model.__class__ = type(f"Wrapped{ea_class.__name__}", (ea_class,), {})  # defined in this test module
    model.save_pretrained(tmp_path)
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForCausalLM"] == f"model_classes.{ea_class.__name__}"
    assert sorted(path.name for path in tmp_path.glob("*.py")) == sorted(SAVED_MODELING_FILES)
    assert type(transformers.AutoModelForCausalLM.from_pretrained(tmp_path)) is ea_class

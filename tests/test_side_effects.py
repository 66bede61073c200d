"""Nothing the caller passes in changes, except the model a function patches in place: the public functions
leave their other inputs (configs, settings dicts, input batches, override lists, recipe files) as they were."""

import copy

import pytest
import torch
import transformers
from testing import tiny_config, tiny_inputs, tiny_model

import ea_hf
from ea_hf.integrations.peft import lora_config
from ea_hf.training.recipe import load_recipe


def state(model):
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def same_state(model, before):
    after = model.state_dict()
    return after.keys() == before.keys() and all(torch.equal(after[name], before[name]) for name in before)


def test_patch_leaves_its_settings_dicts_and_the_config_alone():
    config = tiny_config("t5")
    decoder, cross = {"alpha": 0.1, "layers": [0, 1]}, {"beta": 0.3}
    given = copy.deepcopy((decoder, cross, config.to_dict()))
    ea_hf.patch(transformers.T5ForConditionalGeneration(config), alpha=0.2, beta=0.2, decoder=decoder, cross=cross)
    assert (decoder, cross, config.to_dict()) == given and type(config) is transformers.T5Config


def test_summary_changes_nothing():
    model = ea_hf.patch(tiny_model("bert"), alpha=0.2, beta=0.2)
    before, config, mode = state(model), model.config.to_dict(), model.training
    ea_hf.summary(model)
    assert same_state(model, before) and model.config.to_dict() == config and model.training == mode


def test_plot_attention_leaves_the_models_and_the_batch_alone():
    pytest.importorskip("matplotlib", reason="plots are the optional viz extra")
    patched, plain = ea_hf.patch(tiny_model("bert"), alpha=0.2, beta=0.2).train(), tiny_model("bert").eval()
    inputs = tiny_inputs("bert")
    given = {key: value.clone() for key, value in inputs.items()}
    before = {
        name: (state(model), model.config.to_dict(), model.training)
        for name, model in [("EA", patched), ("base", plain)]
    }
    ea_hf.plot_attention({"EA": patched, "base": plain}, inputs, layers=[0])
    assert inputs.keys() == given.keys() and all(torch.equal(inputs[key], given[key]) for key in given)
    for name, model in [("EA", patched), ("base", plain)]:
        weights, config, mode = before[name]
        assert same_state(model, weights) and model.config.to_dict() == config and model.training == mode


def test_lora_config_reads_the_model_without_changing_it():
    model = ea_hf.patch(tiny_model("bert", transformers.AutoModelForSequenceClassification), alpha=0.2, beta=0.2)
    before, config = state(model), model.config.to_dict()
    lora_config(model, r=4)
    assert same_state(model, before) and model.config.to_dict() == config


def test_load_recipe_leaves_its_overrides_and_the_file_alone(tmp_path):
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(load_recipe("quickstart").to_yaml())
    text, overrides = recipe_file.read_text(), ["ea.alpha=0.4", "train.learning_rate=2e-5"]
    given = list(overrides)
    load_recipe(str(recipe_file), overrides)
    assert overrides == given and recipe_file.read_text() == text

"""Settings are defined once: patch(), recipes (the ``ea`` section), the ``ea-hf patch`` options and model cards
all derive from EvolvingAttentionSettings, so a field added there appears everywhere."""

import argparse
import dataclasses
import inspect

import pytest
import torch
from testing import tiny_model

import ea_hf
from ea_hf.cli import add_settings_arguments, build_parser, settings_from_arguments
from ea_hf.hub.cards import settings_table
from ea_hf.modeling.evolution import AttentionMapEvolution
from ea_hf.modeling.settings import METHOD_DEPENDENT, EvolvingAttentionSettings
from ea_hf.training.recipe import EASection, ea_section_class, recipe_from_dict

FIELDS = [field.name for field in dataclasses.fields(EvolvingAttentionSettings)]


@dataclasses.dataclass(frozen=True)
class WithSpread(EvolvingAttentionSettings):
    """The settings with one more field, as a future setting would be added."""

    spread: float = dataclasses.field(default=0.5, metadata={"help": "a new setting"})


def test_every_setting_is_a_recipe_key_a_cli_option_and_a_patch_parameter():
    section = {field.name: field for field in dataclasses.fields(EASection)}
    options = {action.dest: action for action in build_parser()._subparsers._group_actions[0].choices["patch"]._actions}
    parameters = inspect.signature(ea_hf.patch).parameters
    for field in dataclasses.fields(EvolvingAttentionSettings):
        default = None if field.name in METHOD_DEPENDENT else field.default
        assert section[field.name].default == default
        assert options[field.name].default == default
        assert options[field.name].choices == field.metadata.get("choices")
        assert parameters[field.name].default == default
    assert list(parameters)[1 : len(FIELDS) + 1] == FIELDS  # positional order is the dataclass's


def test_a_field_added_to_the_settings_reaches_the_recipe_schema_and_the_cli():
    section = ea_section_class(WithSpread)
    assert [field.name for field in dataclasses.fields(section)] == ["enabled", *FIELDS, "spread", "decoder", "cross",
                                                                     "learning_rate", "gates_learning_rate",
                                                                     "ramp_ratio"]  # fmt: skip
    assert section().spread == 0.5
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, WithSpread)
    args = parser.parse_args(["--spread", "0.25", "--kernel-size", "5", "--layers", "0,2"])
    settings = settings_from_arguments(args, WithSpread)
    assert (settings.spread, settings.kernel_size, settings.layers, settings.alpha) == (0.25, 5, (0, 2), 0.2)
    assert "--spread" in parser.format_help() and "a new setting (default: 0.5)" in parser.format_help()


def test_recipe_values_are_checked_by_the_settings_themselves():
    base = {"name": "d", "model": {"name_or_path": "m"}, "data": {"task": "sst2"}}
    recipe = recipe_from_dict(base, ["ea.method=residual", "ea.kernel_size=5", "ea.layers=[0, 1]"])
    assert recipe.evolution() == EvolvingAttentionSettings(alpha=0.2, beta=0.0, kernel_size=5, layers=(0, 1),
                                                           method="residual")  # fmt: skip
    with pytest.raises(ValueError, match=r"ea.method: must be one of conv, residual, echo, linear; got 'cnov'"):
        recipe_from_dict(base, ["ea.method=cnov"])
    with pytest.raises(ValueError, match=r"kernel_size must be a positive odd integer, got 4"):
        recipe_from_dict(base, ["ea.kernel_size=4"])


def test_patch_takes_settings_by_position_in_field_order_and_by_name():
    by_position = ea_hf.patch(tiny_model("bert"), 0.3, 0.1, 5, [0, 2], "dirac")
    by_name = ea_hf.patch(tiny_model("bert"), alpha=0.3, beta=0.1, kernel_size=5, layers=[0, 2], init="dirac")
    assert by_position.config.evolving_attention == by_name.config.evolving_attention
    assert by_position.config.evolving_attention["encoder"] == {
        "alpha": 0.3, "beta": 0.1, "kernel_size": 5, "layers": [0, 2], "init": "dirac", "method": "conv"
    }  # fmt: skip
    with pytest.raises(TypeError, match=r"unknown evolving-attention setting\(s\) \['alpah'\]"):
        ea_hf.patch(tiny_model("bert"), alpah=0.3)
    with pytest.raises(TypeError, match=r"given twice: \['alpha'\]"):
        ea_hf.patch(tiny_model("bert"), 0.3, alpha=0.3)


def test_the_card_table_shows_every_stored_setting_as_stored():
    stored = {
        "encoder": EvolvingAttentionSettings(alpha=0.3, layers=(0, 2)).to_dict(),
        "cross": EvolvingAttentionSettings.for_method("echo", echoes=3).to_dict(),
    }
    columns, rows = settings_table(stored)
    # The echo fields are stored for the echo role only, ``gates`` only where learned.
    assert columns == [name for name in FIELDS if name != "gates"]
    assert rows == [
        ["encoder", "0.3", "0.2", "3", "0, 2", "kaiming_uniform", "conv", "-", "-", "-"],
        ["cross", "0.0", "0.0", "-", "all", "-", "echo", "3", "scalar", "-"],  # echo has no convolution
    ]


def test_recipes_merge_the_decoder_and_cross_settings_as_patch_does():
    base = {"name": "d", "model": {"name_or_path": "m"}, "data": {"task": "sst2"}}
    # The decoder's default follows the encoder's method (echo), so an alpha for it is refused, as patch refuses it.
    with pytest.raises(ValueError, match=r"ea.decoder: Invalid evolving-attention settings: method 'echo' refines"):
        recipe_from_dict(base, ["ea.method=echo", 'ea.decoder={"alpha": 0.1}'])
    with pytest.raises(ValueError, match=r"method 'echo' refines each layer's own logits"):
        ea_hf.patch(tiny_model("t5"), method="echo", decoder={"alpha": 0.1})
    recipe = recipe_from_dict(base, ['ea.cross={"beta": 0.5}', "ea.decoder=false"])
    patched = ea_hf.patch(tiny_model("t5"), recipe.evolution(), **recipe.role_overrides())
    assert set(patched.config.evolving_attention) == {"encoder", "cross"}
    assert patched.config.evolving_attention["cross"]["beta"] == 0.5


def test_settings_from_the_authors_code_swap_alpha_and_beta_into_the_papers_naming():
    """The authors' code mixes the previous map with *beta* and weighs the convolution with *alpha*; written
    here from their formula (with ReLU, as in the paper, where their PyTorch code has LeakyReLU)."""
    their_alpha, their_beta = 0.7, 0.25
    settings = EvolvingAttentionSettings.from_authors_code(alpha=their_alpha, beta=their_beta, kernel_size=3)
    assert (settings.alpha, settings.beta, settings.kernel_size) == (their_beta, their_alpha, 3)
    torch.manual_seed(0)
    layer = AttentionMapEvolution(2, alpha=settings.alpha, beta=settings.beta, kernel_size=3, position=1, previous=0)
    logits, previous = torch.randn(1, 2, 5, 5, dtype=torch.float64), torch.randn(1, 2, 5, 5, dtype=torch.float64)
    layer = layer.double()
    mixed = (1 - their_beta) * logits + their_beta * previous  # their att_matrix
    convolved = torch.relu(torch.nn.functional.conv2d(mixed, layer.weight, layer.bias, padding=1))
    theirs = their_alpha * convolved + (1 - their_alpha) * mixed
    ours = layer.reference(logits, None, {("encoder", 0): previous})
    assert (ours - theirs).abs().max().item() <= 1e-12

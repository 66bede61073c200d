"""Attention plots: the panels hold the models' (evolved) attention probabilities; EA vs base comparisons; the
`ea-hf viz` command writes a PNG."""

import numpy as np
import pytest
import torch
import transformers
from testing import tiny_inputs, tiny_model

import ea_hf
from ea_hf.cli import main
from ea_hf.visualization import attention_maps

pytest.importorskip("matplotlib", reason="plots are the optional viz extra")


def panels(figure):
    """{title: plotted values} of every attention panel (colour bars left out)."""
    return {ax.get_title(): np.asarray(ax.images[0].get_array()) for ax in figure.axes if ax.images}


def sharp_bert():
    """A tiny BERT with attention maps far from uniform, patched."""
    return ea_hf.patch(tiny_model("bert", initializer_range=0.3), alpha=0.5, beta=0.5).eval()


def test_the_panels_are_the_evolved_attention_probabilities_of_the_real_tokens():
    model = sharp_bert()
    inputs = tiny_inputs("bert", batch=3, length=9)  # example 1 has 7 real tokens and 2 of padding
    figure = ea_hf.plot_attention(model, inputs, layers=[0, 2], heads=[1, 3], example=1)
    with torch.no_grad():
        attentions = model(**inputs, output_attentions=True).attentions
    shown = panels(figure)
    assert list(shown) == [f"layer {layer}, head {head}" for head in (1, 3) for layer in (0, 2)]
    for head in (1, 3):
        for layer in (0, 2):
            expected = attentions[layer][1, head, :7, :7].numpy()
            assert np.array_equal(shown[f"layer {layer}, head {head}"], expected)
            assert np.allclose(expected.sum(-1), 1.0, atol=1e-6)  # probabilities over the real tokens only
    mean = panels(ea_hf.plot_attention(model, inputs, layers=[2], example=1))["layer 2, mean of heads"]
    assert np.allclose(mean, attentions[2][1, :, :7, :7].mean(0).numpy(), atol=1e-7)


def test_comparing_an_ea_model_with_its_base_on_the_same_input():
    base = tiny_model("bert", initializer_range=0.3).eval()
    model = sharp_bert()
    inputs = tiny_inputs("bert", batch=1, length=8)
    tokens = [f"t{i}" for i in range(8)]
    figure = ea_hf.plot_attention({"EA": model, "base": base}, inputs, layers=[1, 2], tokens=tokens)
    shown = panels(figure)
    assert list(shown) == ["EA\nlayer 1, mean of heads", "EA\nlayer 2, mean of heads"] + [
        "base\nlayer 1, mean of heads",
        "base\nlayer 2, mean of heads",
    ]
    assert base.config._attn_implementation == "sdpa"  # plotted through eager attention, then restored
    base.set_attn_implementation("eager")
    with torch.no_grad():
        plain = base(**inputs, output_attentions=True).attentions
    assert np.allclose(shown["base\nlayer 2, mean of heads"], plain[2][0].mean(0).numpy(), atol=1e-7)
    # The EA row shows the evolved maps, which differ from the base model's.
    assert np.abs(shown["EA\nlayer 2, mean of heads"] - shown["base\nlayer 2, mean of heads"]).max() > 1e-3
    labels = [label.get_text() for label in figure.axes[0].get_xticklabels()]
    assert labels == tokens


@pytest.mark.parametrize("model_type", ["vit", "t5"])
def test_images_and_encoder_decoder_models_plot_their_encoder_maps(model_type):
    head = transformers.AutoModelForSeq2SeqLM if model_type == "t5" else transformers.AutoModel
    model = ea_hf.patch(tiny_model(model_type, head), alpha=0.5, beta=0.5).eval()
    inputs = tiny_inputs(model_type, batch=1)
    inputs.pop("decoder_input_ids", None)
    maps = attention_maps(model, inputs)
    assert len(maps) == 3 and maps[0].shape[0] == 4
    shown = panels(ea_hf.plot_attention(model, inputs))
    assert len(shown) == 3 and all(
        np.array_equal(shown[f"layer {i}, mean of heads"], maps[i].mean(0)) for i in range(3)
    )


def test_bad_layers_or_heads_are_clear_errors():
    model = sharp_bert()
    inputs = tiny_inputs("bert", batch=1)
    with pytest.raises(ValueError, match=r"layers \[3\] out of range: the model has 3 layers \(0..2\)"):
        ea_hf.plot_attention(model, inputs, layers=[0, 3])
    with pytest.raises(ValueError, match=r"heads \[4\] out of range: the model has 4 heads"):
        ea_hf.plot_attention(model, inputs, heads=[4])


def test_viz_command_writes_a_png_comparing_with_the_base(minilm_path, tmp_path, capsys):
    ea_dir = tmp_path / "ea"
    assert main(["patch", minilm_path, str(ea_dir), "--alpha", "0.4", "--beta", "0.4"]) == 0
    output = tmp_path / "maps.png"
    text = "evolving attention links the maps of all layers"
    args = ["viz", str(ea_dir), "--text", text, "--layers", "0,3,5", "--compare", minilm_path, "-o", str(output)]
    assert main(args) == 0
    assert "wrote the attention maps of EA (ea), base (" in capsys.readouterr().out
    from PIL import Image

    with Image.open(output) as image:
        width, height = image.size
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and width > height > 300  # 2 rows of 3 panels
    # --compare without a model needs a run directory (which records its base checkpoint).
    assert main(["viz", str(ea_dir), "--text", text, "--compare", "-o", str(tmp_path / "x.png")]) == 2
    assert "is not a run directory: name the model to compare with" in capsys.readouterr().err

"""A run read once, then rendered: ``ea-hf card`` and ``ea-hf push`` read each file of a run once, the card is
rendered from the record without reading a file, and the card of a LoRA run renders where peft is not installed.
The runs here are made without training: a run directory as a LoRA run of the quickstart leaves it."""

import importlib.util
import json
import sys

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors.torch import save_file
from testing import SST2_SAMPLE

from ea_hf.cli import main
from ea_hf.hub import runs
from ea_hf.hub.cards import render_card
from ea_hf.hub.run_record import ParameterCounts, read_run
from ea_hf.training.recipe import RecipeError, load_recipe
from ea_hf.training.run_dir import read_run_recipe
from ea_hf.training.selection import Candidate, Selection, write_selection

#: all-MiniLM-L6-v2 (the quickstart's checkpoint): 6 layers of 12 heads, hidden size 384.
LAYERS, HEADS, HIDDEN = 6, 12, 384
#: A 3x3 convolution over the heads and its bias in every layer.
EVOLUTION_PARAMETERS = LAYERS * (HEADS * HEADS * 9 + HEADS)
#: The weights of the adapter that are no evolution module's: one LoRA matrix (rank 8) and the task head.
OTHER_PARAMETERS = 8 * HIDDEN + 2 * HIDDEN + 2
METRICS = {"accuracy": 0.75, "loss": 0.5}


def lora_run(root):
    """A finished LoRA run of the quickstart (``root/sweep/ea``), chosen in a selection on validation against a
    baseline (``root/sweep/selection.json``); its adapter holds the evolution modules, a LoRA matrix and a head."""
    sweep = root / "sweep"
    run_dir = sweep / "ea"
    recipe = load_recipe("quickstart", [*SST2_SAMPLE, "peft.method=lora", f"output_dir={run_dir}"])
    (run_dir / "eval" / "validation").mkdir(parents=True)
    (run_dir / "recipe.yaml").write_text(recipe.to_yaml())
    (run_dir / "eval" / "validation" / "metrics.json").write_text(json.dumps(METRICS))
    (run_dir / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    prefix = "base_model.model.bert.encoder.layer"
    weights = {}
    for layer in range(LAYERS):
        weights[f"{prefix}.{layer}.attention.self.evolving_attention.conv.weight"] = torch.zeros(HEADS, HEADS, 3, 3)
        weights[f"{prefix}.{layer}.attention.self.evolving_attention.conv.bias"] = torch.zeros(HEADS)
    weights[f"{prefix}.0.attention.self.query.lora_A.weight"] = torch.zeros(8, HIDDEN)
    weights["base_model.model.classifier.weight"] = torch.zeros(2, HIDDEN)
    weights["base_model.model.classifier.bias"] = torch.zeros(2)
    save_file(weights, run_dir / "adapter_model.safetensors")
    chosen, baseline = Candidate(str(run_dir), {42: 0.75}, True), Candidate(str(sweep / "baseline"), {42: 0.7}, False)
    write_selection(sweep, Selection("accuracy", "validation", "test", False, (chosen, baseline), chosen, baseline))
    return run_dir


def test_the_record_holds_what_the_run_wrote(tmp_path):
    run_dir = lora_run(tmp_path)
    record = read_run(run_dir)
    assert record.adapter and record.config is None and record.metrics == {"validation": METRICS}
    assert record.parameters == ParameterCounts(EVOLUTION_PARAMETERS + OTHER_PARAMETERS, EVOLUTION_PARAMETERS)
    assert record.recipe == read_run_recipe(run_dir) and record.recipe.peft.method == "lora"
    # The settings the base model gets from ea_hf.patch: the quickstart's, on the encoder.
    assert {key: record.settings["encoder"][key] for key in ("alpha", "beta", "kernel_size")} == {
        "alpha": 0.0,
        "beta": 0.0,
        "kernel_size": 3,
    }
    assert record.selection_name == "ea" and record.selection.chosen.name == "ea"
    assert record.selection.baseline.scores == {42: 0.7}
    assert record.origin.hub_id == "sentence-transformers/all-MiniLM-L6-v2"
    with pytest.raises(AttributeError):  # frozen
        record.adapter = False


def test_a_lora_run_s_card_renders_where_peft_is_not_installed(tmp_path, monkeypatch, capsys):
    run_dir = lora_run(tmp_path)
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` raises ImportError
    # What the recipe's check of this machine asks is now missing: the check refuses the recipe...
    assert importlib.util.find_spec("peft") is None
    with pytest.raises(RecipeError, match="'lora' needs the peft package"):
        read_run_recipe(run_dir)
    with pytest.raises(ImportError):
        import peft  # noqa: F401
    # ... and the card, which reads the recipe as the run wrote it, renders all the same.
    card = ModelCard(str(runs.run_card(run_dir, "test-user/ea-minilm-lora")))  # as the Hub's parser reads it
    assert card.data.library_name == "peft" and card.data.tags == ["evolving-attention", "ea_hf", "peft", "lora"]
    assert card.data.base_model == "sentence-transformers/all-MiniLM-L6-v2"
    assert card.data.base_model_relation == "adapter" and card.data.license == "apache-2.0"
    assert "| encoder | 0.0 | 0.0 | 3 | all | kaiming_uniform | conv | learned |" in card.text
    assert f"The convolutions add {EVOLUTION_PARAMETERS:,} parameters" in card.text
    assert "| SST-2-format local files | validation | accuracy | 0.7500 |" in card.text
    assert "Selected on validation, as `ea-hf run` does with `select`: the configuration with the highest mean" in (
        card.text
    )
    assert "This run is of the configuration chosen." in card.text
    assert "peft:\n  method: lora" in card.text
    assert main(["card", str(run_dir), "--repo-id", "test-user/ea-minilm-lora"]) == 0
    assert capsys.readouterr().out == str(card) + "\n"


def test_the_card_is_rendered_from_the_record_without_reading_a_file(tmp_path, monkeypatch):
    record = read_run(lora_run(tmp_path))
    expected = str(render_card(record, "u/x"))

    def no_file(*args, **kwargs):
        raise AssertionError(f"a file was read while rendering: {args}")

    monkeypatch.setattr("io.open", no_file)
    monkeypatch.setattr("builtins.open", no_file)
    assert str(render_card(record, "u/x")) == expected
    assert "license: mit" in str(render_card(record, "u/x", license={"license": "mit"}))


def test_card_and_push_read_each_file_of_a_run_once(tmp_path, hub, monkeypatch, opened):
    run_dir = lora_run(tmp_path)
    sweep, output = run_dir.parent, tmp_path / "README.md"
    opened.counts.clear()  # (making the run wrote its files)
    # The card: the recipe, the metrics, the adapter's header, and the selection above the run; nothing twice.
    assert main(["card", str(run_dir), "--repo-id", "test-user/lora", "-o", str(output)]) == 0
    read = {"ea/recipe.yaml": 1, "ea/eval/validation/metrics.json": 1, "ea/adapter_model.safetensors": 1}
    assert opened.under(sweep) == {**read, "selection.json": 1}
    # The push reads them once more before it hands the files to the upload, which reads what it sends.
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    before_upload = opened.at_upload(monkeypatch, sweep)
    assert main(["push", str(run_dir), "--repo-id", "test-user/lora", "--endpoint", hub.endpoint]) == 0
    assert before_upload == {**read, "selection.json": 1}
    stored = hub.files("test-user/lora")
    assert stored["README.md"] == output.read_bytes()
    assert stored["adapter_model.safetensors"] == (run_dir / "adapter_model.safetensors").read_bytes()

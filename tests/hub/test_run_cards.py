"""Cards and pushes of a run of every task kind (GLUE, image, time-series classification and regression): what
the card says comes from the run's task kind; runs written by ea_hf 0.1 still work with eval, compare, card and
push; an adapter run's card shows the settings its model has."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
import yaml
from huggingface_hub import ModelCard
from testing import SST2_SAMPLE, sample_rows, tiny_checkpoint, tiny_vit_checkpoint, write, write_ts

import ea_hf
from ea_hf.cli import main
from ea_hf.hub.cards import settings_table
from ea_hf.hub.runs import run_card
from ea_hf.modeling import dc_transformer
from ea_hf.training.recipe import RECIPES_DIR, load_recipe, recipe_from_dict
from ea_hf.training.run_dir import RECIPE_FILE, read_metrics, read_run_recipe
from ea_hf.training.trainer import evaluate_run, prepare, run_recipe

pytest.importorskip("aeon", reason="the time-series runs read .ts files with the timeseries extra (aeon)")

FIXTURES = Path(__file__).parents[1] / "fixtures" / "runs_v0_1"
#: The quickstart as ea_hf 0.1 shipped it: two epochs on the SST-2-format sample (then in recipes/data).
#: The quickstart's EA settings in ea_hf 0.1 (the papers'; 0.1 had no ramp nor learned gates), which its runs were
#: written with.
V0_1_EA = ["ea.gates=fixed", "ea.alpha=0.2", "ea.beta=0.2", "ea.ramp_ratio=0"]
V0_1_QUICKSTART = [
    "data.source=local",
    f"data.files={{train: {RECIPES_DIR / 'data/sst2-sample/train.tsv'}, "
    f"validation: {RECIPES_DIR / 'data/sst2-sample/validation.tsv'}}}",
    "data.max_train_samples=null",
    "train.epochs=2",
    "train.eval_batch_size=null",
    "train.eval_strategy=epoch",
    "train.save_strategy=epoch",
    "train.logging_steps=10",
    *V0_1_EA,
]
QUICK = ["train.max_steps=2", "train.eval_strategy=no", "train.save_strategy=no", "train.batch_size=8"]
TINY_SERIES_MODEL = ["model.config.hidden_size=16", "model.config.num_layers=1", "model.config.num_attention_heads=2"]
#: Per kind of run: pipeline tag, model-index task type, dataset name, the metrics and the Hub datasets.
EXPECTED = {
    "glue": ("text-classification", "text-classification", "SST-2-format local files", ("accuracy",), None),
    "image": (
        "image-classification",
        "image-classification",
        "local image folders",
        ("accuracy", "top5_accuracy"),
        None,
    ),  # fmt: skip
    "timeseries-classification": (
        None,
        "time-series-classification",
        "UEA/UCR JapaneseVowels",
        ("accuracy",),
        None,
    ),  # fmt: skip
    "timeseries-regression": (None, "time-series-regression", "local .ts files", ("rmse",), None),
    "causal_lm": (
        "text-generation",
        "text-generation",
        "Python documentation topics (pydoc_data)",
        ("perplexity", "token_loss"),
        None,
    ),  # fmt: skip
}
#: Per kind of run: the card's base model (a Hub id read from the checkpoint; none for a local checkpoint of
#: unknown origin or a model built from its config) and how the text names the training data.
BASE_AND_DATA = {
    "glue": ("sentence-transformers/all-MiniLM-L6-v2", "SST-2-format sentences in local files: train.tsv, "),
    "image": (None, "images in local folders, one sub-folder per class: train, validation."),
    "timeseries-classification": (None, "on the UEA/UCR archive's JapaneseVowels."),
    "timeseries-regression": (None, "on series in local .ts files: train.ts, test.ts."),
    "causal_lm": (None, "on the topic texts of the Python documentation (pydoc_data)."),
}


def series_files(folder: Path) -> dict[str, str]:
    generator = np.random.default_rng(0)
    files = {}
    for split, count in (("train", 24), ("test", 8)):
        series = [generator.normal(size=(int(generator.integers(4, 9)), 2)) for _ in range(count)]
        files[split] = write_ts(folder / f"{split}.ts", series, [float(s[:, 0].mean()) for s in series], True)
    return files


@pytest.fixture(scope="module")
def runs(tmp_path_factory, digits_folders) -> dict[str, Path]:
    """A short, finished run of every kind of task."""
    root = tmp_path_factory.mktemp("kind-runs")
    recipes = {
        "glue": load_recipe(
            "quickstart",
            [*SST2_SAMPLE, "data.max_train_samples=32", "data.max_eval_samples=16", *V0_1_EA, *QUICK],
        ),
        "image": load_recipe(
            "vision/ea-vit-base-imagenet",
            [
                f"model.name_or_path={tiny_vit_checkpoint(root / 'vit')}",
                "data.source=local",
                f"data.files={digits_folders}",
                "data.image_size=16",
                "data.max_train_samples=32",
                "data.max_eval_samples=32",
                "train.gradient_accumulation_steps=1",
                *QUICK,
            ],
        ),  # fmt: skip
        "timeseries-classification": load_recipe(
            "timeseries/japanese-vowels",
            ["sweep=null", "variants=null", "pretrain.epochs=0", *TINY_SERIES_MODEL, *QUICK],
        ),
        "timeseries-regression": recipe_from_dict(
            {
                "name": "series-regression",
                "kind": "timeseries",
                "model": {"config": {"hidden_size": 16}},
                "data": {"task": "regression", "source": "local", "files": series_files(root)},
            },
            [*TINY_SERIES_MODEL, *QUICK],
        ),  # fmt: skip
        "causal_lm": load_recipe(
            "causal_lm/quickstart",
            ["model.config.hidden_size=32", "model.config.intermediate_size=48", "data.block_size=32"]
            + ["data.max_train_samples=4", "data.max_eval_samples=2", *QUICK],
        ),
    }
    paths = {}
    for name, recipe in recipes.items():
        recipe.output_dir = str(root / name)
        run_recipe(recipe)
        paths[name] = root / name
    return paths


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_every_kind_of_run_gets_its_card_and_is_pushed_with_it(kind, runs, hub, monkeypatch, tmp_path, opened):
    pipeline_tag, task_type, dataset, metric_names, hub_datasets = EXPECTED[kind]
    run_dir = runs[kind]
    metrics = read_metrics(run_dir)
    card = ModelCard(str(run_card(run_dir, f"test-user/{kind}")))  # as the Hub's parser reads it
    assert card.data.pipeline_tag == pipeline_tag and card.data.datasets == hub_datasets
    base_model, data_text = BASE_AND_DATA[kind]
    assert card.data.base_model == base_model and data_text in card.text
    assert getattr(card.data, "base_model_relation", None) == ("finetune" if base_model else None)
    assert "package:" not in str(card) and str(run_dir.parent / "vit") not in card.text.split("```yaml")[0]
    results = {(r.dataset_split, r.metric_type): r for r in card.data.eval_results}
    assert set(results) == {(split, name) for split in metrics for name in metric_names}
    for (split, name), result in results.items():
        assert (result.task_type, result.dataset_name) == (task_type, dataset)
        assert result.metric_value == round(metrics[split][name], 4)
        assert f"| {dataset} | {split} | {name} | {metrics[split][name]:.4f} |" in card.text
    config = transformers.AutoConfig.from_pretrained(run_dir)
    settings = read_run_recipe(run_dir).evolution()
    # The first chain: the encoder's, a decoder-only model's decoder; EA-DC-Transformer's too.
    assert next(iter(config.evolving_attention.values()))["alpha"] == settings.alpha
    columns, rows = settings_table(config.evolving_attention)
    assert "| " + " | ".join(rows[0]) + " |" in card.text
    if kind.startswith("timeseries"):  # a model built from its config: the card gives its sizes d, n, p
        model = getattr(dc_transformer, config.architectures[0]).from_pretrained(run_dir)
        parameters = sum(parameter.numel() for parameter in model.parameters())
        for line in (
            "| model | EA-DC-Transformer (TPAMI 2023, section 3.3), trained from scratch |",
            f"| hidden size d | {config.hidden_size} |",
            f"| blocks n | {config.num_layers} |",
            f"| attention ratio p | {config.attention_ratio:g} ({config.attention_width} of d to attention, 2 heads) |",
            f"| input variables | {config.input_size} |",
            f"| parameters | {parameters:,} |",
        ):
            assert line in card.text
    else:
        assert "## Model" not in card.text

    # `ea-hf card` prints the same card, reading each file it needs once; `ea-hf push` uploads it with the run.
    opened.counts.clear()
    assert main(["card", str(run_dir), "--repo-id", f"test-user/{kind}", "-o", str(tmp_path / "card.md")]) == 0
    weights = [path.name for path in run_dir.glob("*.safetensors")]
    read = ["recipe.yaml", "config.json", *weights, *(f"eval/{split}/metrics.json" for split in metrics)]
    assert opened.under(run_dir) == dict.fromkeys(read, 1)
    assert (tmp_path / "card.md").read_text() == str(run_card(run_dir, f"test-user/{kind}"))
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    assert main(["push", str(run_dir), "--repo-id", f"test-user/{kind}", "--endpoint", hub.endpoint]) == 0
    stored = hub.files(f"test-user/{kind}")
    assert stored["README.md"] == (tmp_path / "card.md").read_bytes()
    assert stored["config.json"] == (run_dir / "config.json").read_bytes()


def v0_1_run(run_dir: Path, fixture: str, destination: Path) -> Path:
    """A copy of ``run_dir`` whose recipe.yaml is the one ea_hf 0.1 wrote (every kind's fields)."""
    shutil.copytree(run_dir, destination)
    text = (FIXTURES / f"{fixture}.yaml").read_text().replace("RECIPES", str(RECIPES_DIR))
    old = yaml.safe_load(text)
    new = yaml.safe_load((run_dir / RECIPE_FILE).read_text())
    for section in ("train", "data"):  # the run's own overrides (short training, samples)
        old[section] |= {key: value for key, value in new[section].items() if key in old[section]}
    old["output_dir"] = str(destination)
    # Free text, which the shipped recipe has changed since (0.1's recipes had no evidence).
    old["description"], old["evidence"] = new["description"], new["evidence"]
    (destination / RECIPE_FILE).write_text(yaml.safe_dump(old, sort_keys=False))
    return destination


@pytest.mark.slow
def test_runs_written_by_ea_hf_0_1_still_evaluate_compare_publish(runs, hub, monkeypatch, tmp_path, capsys):
    old = v0_1_run(runs["glue"], "glue", tmp_path / "old")
    assert "image_column" in (old / RECIPE_FILE).read_text() and "pretrain:" in (old / RECIPE_FILE).read_text()
    assert read_run_recipe(old).to_dict() == {**read_run_recipe(runs["glue"]).to_dict(), "output_dir": str(old)}
    again, before = evaluate_run(old)["validation"], read_metrics(runs["glue"])["validation"]
    assert again["accuracy"] == before["accuracy"] and abs(again["loss"] - before["loss"]) <= 1e-5
    assert main(["compare", str(runs["glue"]), str(old)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[1].split()[1:] == table[2].split()[1:]  # same task, settings, split and metrics
    renamed = str(run_card(runs["glue"], "u/x")).replace(f"output_dir: {runs['glue'].name}", f"output_dir: {old.name}")
    assert str(run_card(old, "u/x")) == renamed  # (the card names the run directory, not its path)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    assert main(["push", str(old), "--repo-id", "test-user/old", "--endpoint", hub.endpoint]) == 0
    assert "README.md" in hub.files("test-user/old")


@pytest.mark.parametrize(
    ("fixture", "name", "overrides"),
    [
        ("glue", "quickstart", V0_1_QUICKSTART),
        ("glue-lora", "quickstart", [*V0_1_QUICKSTART, "peft.method=lora", "output_dir=runs/quickstart-lora"]),
        ("image", "vision/ea-vit-base-imagenet", []),
        ("timeseries", "timeseries/japanese-vowels", ["sweep=null", "variants=null"]),
    ],
)
def test_v0_1_recipe_files_of_every_kind_read_as_their_recipe(fixture, name, overrides, tmp_path):
    text = (FIXTURES / f"{fixture}.yaml").read_text().replace("RECIPES", str(RECIPES_DIR))
    (tmp_path / RECIPE_FILE).write_text(text)
    old = read_run_recipe(tmp_path)
    # The description and the evidence are free text that a shipped recipe may have changed (or, the evidence,
    # gained) since the run was written.
    assert old == dataclasses.replace(load_recipe(name, overrides), description=old.description, evidence="")


@pytest.mark.slow
def test_an_adapter_run_of_a_seq2seq_model_shows_the_settings_its_model_has(tmp_path, minilm_tokenizer):
    checkpoint = tiny_checkpoint("t5", minilm_tokenizer, tmp_path / "t5", num_labels=2)
    files = {"train": write(sample_rows("rte", 8), tmp_path / "train.tsv")}
    files["validation"] = write(sample_rows("rte", 6), tmp_path / "validation.tsv")
    overrides = ["sweep=null", f"model.name_or_path={checkpoint}", "data.source=local", f"data.files={files}"]
    overrides += ["ea.alpha=0.3", "ea.beta=0.4", 'ea.cross={"beta": 0.1}', "peft.method=lora", *QUICK]
    recipe = load_recipe("glue/ea-t5-base/rte", [*overrides, f"output_dir={tmp_path / 'run'}"])
    run_recipe(recipe)
    trainer, _ = prepare(recipe, tmp_path / "run", train=False, adapter_dir=tmp_path / "run")
    stored = trainer.model.get_base_model().config.evolving_attention
    assert stored["decoder"]["alpha"] == 0.0 and stored["cross"]["beta"] == 0.1  # the per-role defaults applied
    card = run_card(tmp_path / "run")
    columns, rows = settings_table(stored)
    assert "| attention | " + " | ".join(columns) + " |" in card.text
    for row in rows:  # exactly the model's settings, every role
        assert "| " + " | ".join(row) + " |" in card.text
    assert card.text.count("| encoder |") == card.text.count("| decoder |") == card.text.count("| cross |") == 1
    assert ea_hf.is_patched(trainer.model.get_base_model())


LOAD_SNIPPET = """
import json, sys
if sys.argv[2] == "without":
    sys.modules["ea_hf"] = None  # ea_hf is not importable here
import torch
exec(sys.argv[1])
with torch.no_grad():
    predictions = model.eval()(values=torch.linspace(-1, 1, 10).reshape(1, 5, 2)).logits
print(json.dumps({"class": type(model).__module__ + "." + type(model).__name__, "predictions": predictions.tolist()}))
"""


@pytest.mark.full_table  # CI's second stage: fast: every kind of run gets its card
@pytest.mark.slow
def test_the_card_of_a_head_no_auto_class_loads_tells_how_to_load_it(runs, hub, monkeypatch, tmp_path):
    run_dir, repo = runs["timeseries-regression"], "test-user/series-regression"
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    assert main(["push", str(run_dir), "--repo-id", repo, "--endpoint", hub.endpoint]) == 0
    usage = str(run_card(run_dir, repo)).split("## How to use")[1].split("\n## ")[0]
    snippets = re.findall(r"```python\n(.*?)```", usage, flags=re.DOTALL)
    assert len(snippets) == 2 and "No transformers Auto class has this head" in usage
    model = dc_transformer.EADCTransformerForTimeSeriesRegression.from_pretrained(run_dir).eval()
    with torch.no_grad():
        expected = model(values=torch.linspace(-1, 1, 10).reshape(1, 5, 2)).logits
    env = {**os.environ, "PYTHONPATH": "", "HF_ENDPOINT": hub.endpoint, "HF_HUB_OFFLINE": "0"}
    env |= {"TRANSFORMERS_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(tmp_path / "home")}
    env |= {"HF_MODULES_CACHE": str(tmp_path / "modules")}
    installs = (("with", "ea_hf."), ("without", "transformers_modules."))
    for snippet, (ea_hf_installed, module) in zip(snippets, installs, strict=True):
        run = subprocess.run(
            [sys.executable, "-c", LOAD_SNIPPET, snippet, ea_hf_installed], capture_output=True, text=True, env=env
        )
        assert run.returncode == 0, run.stderr[-3000:]
        result = json.loads(run.stdout.strip().splitlines()[-1])
        assert result["class"].startswith(module) and result["class"].endswith("ForTimeSeriesRegression")
        assert (torch.tensor(result["predictions"]) - expected).abs().max() <= 1e-5

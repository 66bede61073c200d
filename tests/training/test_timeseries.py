"""Time-series data and recipes (kind ``timeseries``): UEA/UCR .ts loading (aeon), JapaneseVowels offline,
scaling, padding, recipe checks, and short end-to-end runs of classification (with pre-training) and
regression."""

import math

import numpy as np
import pytest
import torch
import transformers
from testing import write_ts

from ea_hf.modeling.dc_transformer import (
    EADCTransformerForTimeSeriesClassification,
    EADCTransformerForTimeSeriesRegression,
)
from ea_hf.training.kinds.timeseries import (
    SeriesCollator,
    TimeSeriesKind,
    archive_task,
    hold_out,
    load_ts_file,
    load_uea,
    series_dataset,
    standardise,
    weights_origin,
)
from ea_hf.training.recipe import RecipeError, expand_sweep, load_recipe, recipe_from_dict
from ea_hf.training.run_dir import read_metrics
from ea_hf.training.trainer import evaluate_run, run_recipe

pytest.importorskip("aeon", reason="UEA/UCR data is the optional timeseries extra (aeon)")


def test_japanese_vowels_loads_offline_from_the_aeon_wheel():
    splits = load_uea("JapaneseVowels")
    (train, train_labels), (test, test_labels) = splits["train"], splits["test"]
    assert (len(train), len(test)) == (270, 370)
    assert {s.shape[1] for s in train + test} == {12}
    assert min(len(s) for s in train + test) == 7 and max(len(s) for s in train + test) == 29
    assert sorted(set(train_labels)) == [str(i) for i in range(1, 10)] and len(set(test_labels)) == 9


@pytest.mark.parametrize(
    "archive, shape, sizes", [("Covid3Month", (84, 1), (140, 61)), ("CardanoSentiment", (24, 2), (74, 33))]
)
def test_regression_archives_load_by_name_with_their_task(archive, shape, sizes):
    assert archive_task(archive) == "regression"
    splits = load_uea(archive)  # the archive's own task: aeon's regression loader
    assert (len(splits["train"][0]), len(splits["test"][0])) == sizes
    assert {series.shape for split in splits.values() for series in split[0]} == {shape}
    targets = splits["train"][1] + splits["test"][1]
    assert all(isinstance(y, float) for y in targets) and len(set(targets)) > 10


def test_a_stated_task_that_contradicts_the_archive_is_refused():
    with pytest.raises(RecipeError, match="Covid3Month is a regression archive, not classification"):
        load_recipe("timeseries/japanese-vowels", ["data.archive=Covid3Month", "data.task=classification"])
    with pytest.raises(RecipeError, match="JapaneseVowels is a classification archive, not regression"):
        load_recipe("timeseries/japanese-vowels", ["data.task=regression"])
    with pytest.raises(RecipeError, match="data.task: is required with local .ts files"):
        local = ["data.source=local", "data.archive=null", "data.files={train: a.ts}", "data.task=null"]
        load_recipe("timeseries/japanese-vowels", local)
    # The command: a regression archive under the classification recipe, its task taken from the archive.
    recipe = load_recipe("timeseries/japanese-vowels", ["data.archive=Covid3Month", "data.task=null"])
    kind = TimeSeriesKind()
    assert kind.metric_names(recipe) == ("rmse",) and kind.card_info(recipe).dataset_name == "Monash TSER Covid3Month"


@pytest.mark.parametrize("name", ["covid3month", "cardano-sentiment"])
def test_shipped_regression_recipes_run_offline(name, tmp_path):
    tiny = ["model.config.hidden_size=16", "model.config.num_layers=1", "model.config.num_attention_heads=2"]
    overrides = [*tiny, "sweep=null", "variants=null", "pretrain.epochs=1", "train.epochs=1"]
    recipe = load_recipe(f"timeseries/{name}", [*overrides, f"output_dir={tmp_path}"])
    shipped = expand_sweep(load_recipe(f"timeseries/{name}"))  # the evidence: 4 models x 5 seeds
    assert len(shipped) == 20 and {run.output_dir.split("/")[-2] for run in shipped} == {
        "ea-dc-transformer",
        "dc-transformer",
        "transformer",
        "ea-dc-transformer-1x1",
    }
    ablation = next(run for run in shipped if run.output_dir.endswith("ea-dc-transformer-1x1/seed=5"))
    assert ablation.ea.enabled and ablation.evolution().kernel_size == 1 and ablation.train.seed == 5
    metrics = run_recipe(recipe)["test"]
    assert set(metrics) >= {"rmse", "loss"} and 0.0 < metrics["rmse"] < 10.0
    assert metrics["rmse"] == pytest.approx(math.sqrt(metrics["loss"]), rel=1e-4)


def test_the_papers_table_i_recipe_validates_and_names_missing_data(tmp_path):
    """Six archives x three models x three seeds, every run a valid regression recipe; offline (the test guard
    refuses the network), loading an archive that aeon does not bundle says what to do."""
    runs = expand_sweep(load_recipe("timeseries/table-i"))
    assert len(runs) == 6 * 3 * 3
    archives = {run.data.archive for run in runs}
    assert archives == {
        "AppliancesEnergy",
        "BenzeneConcentration",
        "BeijingPM10Quality",
        "BeijingPM25Quality",
        "LiveFuelMoistureContent",
        "IEEEPPG",
    }
    assert {archive_task(archive) for archive in archives} == {"regression"}
    assert {TimeSeriesKind().metric_names(run) for run in runs} == {("rmse",)}
    with pytest.raises(FileNotFoundError, match="'IEEEPPG' is neither bundled with aeon nor in its download cache"):
        load_uea("IEEEPPG")


def test_validation_split_is_held_out_of_training_per_class():
    splits = load_uea("JapaneseVowels")
    held = hold_out(splits, 0.2)
    (train, train_labels), (validation, validation_labels) = held["train"], held["validation"]
    assert (len(train), len(validation)) == (216, 54) and held["test"] is splits["test"]
    # 30 training series per speaker: 6 of each go to validation.
    assert {label: validation_labels.count(label) for label in set(validation_labels)} == {
        str(i): 6 for i in range(1, 10)
    }
    fingerprint = {series.tobytes() for series in splits["train"][0]}
    assert {s.tobytes() for s in train} | {s.tobytes() for s in validation} == fingerprint
    assert not {s.tobytes() for s in train} & {s.tobytes() for s in validation}
    again, other = hold_out(splits, 0.2)["validation"][0], hold_out(splits, 0.2, seed=1)["validation"][0]
    assert all(np.array_equal(a, b) for a, b in zip(again, validation, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(other, validation, strict=True))
    with pytest.raises(ValueError, match="between 0 and 1"):
        hold_out(splits, 1.0)
    with pytest.raises(ValueError, match="already has a validation split"):
        hold_out(held, 0.2)
    with pytest.raises(ValueError, match="leaves a split empty"):
        hold_out({"train": (train[:3], train_labels[:3])}, 0.1, stratify=False)


def test_ts_files_standardising_and_padding(tmp_path):
    generator = np.random.default_rng(0)
    series = [generator.normal(3.0, 2.0, size=(length, 2)).astype(np.float32) for length in (4, 6, 5)]
    path = write_ts(tmp_path / "x.ts", series, ["b", "a", "b"])
    values, labels = load_ts_file(path)
    assert labels == ["b", "a", "b"] and [v.shape for v in values] == [(4, 2), (6, 2), (5, 2)]
    assert np.allclose(values[1], series[1], atol=1e-5)
    scaled = standardise({"train": (values, labels), "test": (values[:1], labels[:1])})
    steps = np.concatenate(scaled["train"][0])
    assert np.allclose(steps.mean(0), 0.0, atol=1e-5) and np.allclose(steps.std(0), 1.0, atol=1e-4)
    assert np.allclose(scaled["test"][0][0], scaled["train"][0][0])  # the test split uses the train statistics
    data = series_dataset(scaled)
    assert data["train"].features["label"].names == ["a", "b"] and data["train"]["label"] == [1, 0, 1]
    batch = SeriesCollator()([data["train"][i] for i in range(3)])
    assert batch["values"].shape == (3, 6, 2) and batch["attention_mask"].sum(1).tolist() == [4, 6, 5]
    assert torch.equal(batch["values"][0, 4:], torch.zeros(2, 2)) and batch["labels"].tolist() == [1, 0, 1]
    with pytest.raises(ValueError, match="has 3 series but 2 labels"):
        series_dataset({"train": (values, labels[:2])})
    with pytest.raises(FileNotFoundError, match="no .ts file"):
        load_ts_file(tmp_path / "missing.ts")


def test_the_card_says_where_the_weights_came_from():
    base = {"name": "t", "kind": "timeseries", "data": {"archive": "JapaneseVowels", "source": "uea"}}
    assert weights_origin(recipe_from_dict(base)) == "trained from scratch"
    pretrained = weights_origin(recipe_from_dict(base, ["pretrain.epochs=3"]))
    assert pretrained == (
        "pre-trained by masked value reconstruction on the training series (3 epochs), then trained on the task"
    )
    given = recipe_from_dict({**base, "model": {"name_or_path": "org/ea-dc-transformer"}})
    assert weights_origin(given) == "fine-tuned from org/ea-dc-transformer"


def test_timeseries_recipes_are_checked():
    base = {"name": "t", "kind": "timeseries", "data": {"task": "classification", "source": "uea"}}
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(base, ["data.task=sst2", "pretrain.epochs=-1", "data.validation_fraction=1.5"])
    assert dict(info.value.problems) == {
        "data.task": "expected 'classification' or 'regression' or null, got 'sst2'",
        "data.archive": "name the UEA/UCR archive (e.g. JapaneseVowels)",
        "pretrain.epochs": "must not be negative",
        "data.validation_fraction": "must be at least 0 and below 1",
    }
    with pytest.raises(RecipeError, match="data.validation_fraction: unknown key"):  # other kinds have no hold-out
        recipe_from_dict(
            {"name": "t", "model": {"name_or_path": "m"}, "data": {"task": "rte"}}, ["data.validation_fraction=0.1"]
        )
    with pytest.raises(RecipeError, match="data.source: must be one of hub, local, rotten-tomatoes; got 'uea'"):
        recipe_from_dict({"name": "t", "model": {"name_or_path": "m"}, "data": {"task": "rte", "source": "uea"}})
    with pytest.raises(RecipeError, match="expected a UEA/UCR .ts file"):
        recipe_from_dict({**base, "data": {"task": "regression", "source": "local", "files": {"train": "x.csv"}}})
    runs = {run.output_dir: run for run in expand_sweep(load_recipe("timeseries/japanese-vowels"))}
    assert len(runs) == 20  # 4 models (with the 1x1 ablation) x 5 seeds
    assert runs["runs/japanese-vowels/ea-dc-transformer-1x1/seed=4"].evolution().kernel_size == 1
    transformer = runs["runs/japanese-vowels/transformer/seed=2"]
    assert not transformer.ea.enabled and transformer.model.config["attention_ratio"] == 1.0
    ea = runs["runs/japanese-vowels/ea-dc-transformer/seed=3"]
    assert (ea.ea.enabled, ea.train.optimizer, ea.train.learning_rate, ea.pretrain.mask_ratio) == (
        True,
        "radam",
        1e-3,
        0.15,
    )


@pytest.mark.full_table  # CI's second stage: fast: the regression runs from local files
@pytest.mark.slow
def test_japanese_vowels_with_pretraining_end_to_end(tmp_path):
    overrides = [
        "variants=null",
        "sweep=null",
        "pretrain.epochs=2",
        "train.epochs=15",
        f"output_dir={tmp_path / 'run'}",
    ]
    metrics = run_recipe(load_recipe("timeseries/japanese-vowels", overrides))["test"]
    assert metrics["accuracy"] >= 0.8  # 9 classes: chance is 0.11 (seen 0.95 after these 15 epochs)
    assert (tmp_path / "run" / "pretrained" / "model.safetensors").exists()
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "run")
    assert type(model) is EADCTransformerForTimeSeriesClassification
    assert (model.config.alpha, model.config.beta) == (0.1, 0.9)  # the recipe's tuned EA settings
    assert model.config.id2label[0] == "1" and model.config.num_labels == 9
    assert evaluate_run(tmp_path / "run")["test"]["accuracy"] == metrics["accuracy"]
    assert read_metrics(tmp_path / "run")["test"]["accuracy"] == metrics["accuracy"]


def test_regression_from_local_ts_files(tmp_path):
    """The target is the mean of the first variable: a model that learns gets well below the targets' spread."""
    generator = np.random.default_rng(1)

    def split(count):
        series = [
            generator.normal(generator.normal(), 1.0, size=(int(generator.integers(5, 12)), 2)) for _ in range(count)
        ]
        return series, [float(one[:, 0].mean()) for one in series]

    files = {}
    for name, count in (("train", 96), ("test", 48)):
        series, targets = split(count)
        files[name] = write_ts(tmp_path / f"{name}.ts", series, targets, regression=True)
    spread = float(np.std(split(48)[1]))
    recipe = recipe_from_dict(
        {
            "name": "regression",
            "kind": "timeseries",
            "model": {"config": {"hidden_size": 16, "num_layers": 2, "num_attention_heads": 2, "dropout": 0.0}},
            "data": {"task": "regression", "source": "local", "files": files, "validation_fraction": 0.25},
            "train": {"optimizer": "radam", "learning_rate": 3e-3, "batch_size": 16, "epochs": 30},
            "output_dir": str(tmp_path / "run"),
        },
        ["train.eval_strategy=no", "train.save_strategy=no"],
    )
    results = run_recipe(recipe)
    metrics = results["test"]
    assert math.isfinite(metrics["rmse"]) and metrics["rmse"] < 0.5 * spread
    # A quarter of the training series are held out (no classes to stratify by) and evaluated too.
    assert math.isfinite(results["validation"]["rmse"]) and results["validation"]["rmse"] < 0.5 * spread
    model = EADCTransformerForTimeSeriesRegression.from_pretrained(tmp_path / "run")
    assert model.config.num_targets == 1

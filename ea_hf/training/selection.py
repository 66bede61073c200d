"""Selection on validation, the runner's protocol for a sweep that compares EA with its baseline.

A recipe with ``select.metric`` (see :class:`~.recipe.SelectSection`) runs in two stages:

1. every run of its sweep and variants trains and is evaluated on the selection split alone (``validation``);
2. its configurations, each pooling the runs that differ only by seed, are ranked by their mean on that split;
   the best one is chosen, and the best baseline (EA off, always among the candidates) is its reference. Only
   the runs of these two are evaluated on the test split, once; the others never are.

What was selected, on what and why is written to ``selection.json`` in the sweep's output directory, which
``ea-hf card`` states in the cards of the runs below it.

Example:
    >>> candidates = [Candidate("runs/x/ea", {1: 0.80, 2: 0.84}, True), Candidate("runs/x/baseline", {1: 0.83}, False)]
    >>> ranked = rank(candidates, lower_is_better=False)
    >>> [candidate.name for candidate in ranked], round(ranked[0].mean, 3)
    (['runs/x/baseline', 'runs/x/ea'], 0.83)
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .evidence import pools_seeds, seed_evidence, seed_group_name
from .recipe import Recipe
from .run_dir import compare_runs, read_metrics, write_atomically

SELECTION_FILE = "selection.json"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration: its runs' directory without the seed part, each seed's score on the selection split,
    and whether it evolves attention."""

    name: str
    scores: dict[int, float]
    evolving: bool

    @property
    def mean(self) -> float:
        return statistics.fmean(self.scores.values())


@dataclasses.dataclass(frozen=True)
class Selection:
    """What a selection chose: the configuration, the baseline it is compared with (the best one with EA off;
    the same as ``chosen`` where no EA setting did better), every candidate in rank order, and on what."""

    metric: str
    split: str
    test_split: str
    lower_is_better: bool
    ranked: tuple[Candidate, ...]
    chosen: Candidate
    baseline: Candidate

    def to_dict(self, folder: Path | None = None) -> dict[str, Any]:
        """The selection as ``selection.json`` records it; ``folder``: the configurations named relative to it
        (the sweep's folder, so that the record stays true when the folder moves)."""

        def named(candidate: Candidate) -> str:
            return candidate.name if folder is None else os.path.relpath(candidate.name, folder)

        return {
            "metric": self.metric,
            "split": self.split,
            "test_split": self.test_split,
            "lower_is_better": self.lower_is_better,
            "rule": self.rule,
            "chosen": named(self.chosen),
            "baseline": named(self.baseline),
            "candidates": [
                {"name": named(c), "evolving": c.evolving, "mean": c.mean, "scores": c.scores} for c in self.ranked
            ],
        }

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> Selection:
        """The selection that ``selection.json`` records (:meth:`to_dict`), its configurations named as there.

        Example:
            >>> ea, baseline = Candidate("ea", {1: 0.9}, True), Candidate("baseline", {1: 0.8}, False)
            >>> selection = Selection("accuracy", "validation", "test", False, (ea, baseline), ea, baseline)
            >>> Selection.from_dict(json.loads(json.dumps(selection.to_dict()))) == selection
            True
        """
        ranked = tuple(
            Candidate(c["name"], {int(seed): float(score) for seed, score in c["scores"].items()}, c["evolving"])
            for c in record["candidates"]
        )
        by_name = {candidate.name: candidate for candidate in ranked}
        return cls(
            record["metric"],
            record["split"],
            record["test_split"],
            record["lower_is_better"],
            ranked,
            by_name[record["chosen"]],
            by_name[record["baseline"]],
        )

    @property
    def rule(self) -> str:
        """How the choice was made, in a sentence's words (``selection.json`` records it)."""
        direction = "lowest" if self.lower_is_better else "highest"
        return (
            f"the configuration with the {direction} mean {self.metric} on {self.split} over its seeds, among "
            f"{len(self.ranked)} (the baseline, EA off, included); {self.test_split} evaluated once, for it "
            "and the best baseline only"
        )

    def table(self) -> str:
        """The candidates in rank order with their validation means, the chosen and the baseline marked."""
        lines = [f"Selection on {self.split} {self.metric} ({'lower' if self.lower_is_better else 'higher'} is "
                 f"better), mean over seeds:"]  # fmt: skip
        for candidate in self.ranked:
            marks = [mark for mark, who in (("chosen", self.chosen), ("baseline", self.baseline)) if candidate is who]
            seeds = len(candidate.scores)
            lines.append(f"  {candidate.mean:.4f}  {candidate.name}  ({seeds} seed{'s' * (seeds > 1)})"
                         + (f"  <- {', '.join(marks)}" if marks else ""))  # fmt: skip
        if self.chosen is self.baseline:
            lines.append("No EA setting reached the baseline on validation: the baseline is the choice.")
        return "\n".join(lines)


def rank(candidates: Sequence[Candidate], lower_is_better: bool) -> list[Candidate]:
    """Best first by mean score; a tie goes to the baseline, then to the order of the recipe (stable)."""
    return sorted(candidates, key=lambda c: ((c.mean if lower_is_better else -c.mean), c.evolving))


def candidates_of(runs: Sequence[Recipe], metric: str, split: str) -> list[Candidate]:
    """The runs' configurations (their seeds pooled) with each run's ``metric`` on ``split``, in run order."""
    groups: dict[str, Candidate] = {}
    for recipe in runs:
        name = seed_group_name(recipe.output_dir)
        scores = read_metrics(recipe.output_dir).get(split, {})
        if metric not in scores:
            raise ValueError(f"{recipe.output_dir} has no {metric} on {split!r}; was it evaluated?")
        group = groups.setdefault(name, Candidate(name, {}, recipe.ea.enabled))
        group.scores[recipe.train.seed] = float(scores[metric])
    return list(groups.values())


def select(runs: Sequence[Recipe]) -> Selection:
    """Choose among the finished stage-1 runs of one selection recipe (see the module docstring)."""
    settings = runs[0].select
    metric, kind = settings.metric, runs[0].task_kind
    lower_is_better = kind.lower_is_better(metric)
    ranked = tuple(rank(candidates_of(runs, metric, settings.split), lower_is_better))
    baselines = [candidate for candidate in ranked if not candidate.evolving]
    if not baselines:
        raise ValueError("a selection needs a baseline (EA off) among its runs")
    return Selection(metric, settings.split, settings.test_split, lower_is_better, ranked, ranked[0], baselines[0])


def selected_runs(runs: Sequence[Recipe], selection: Selection) -> list[Recipe]:
    """The runs of the chosen configuration and of the baseline: the only ones evaluated on the test split."""
    names = {selection.chosen.name, selection.baseline.name}
    return [recipe for recipe in runs if seed_group_name(recipe.output_dir) in names]


def held_out_report(runs: Sequence[Recipe], selection: Selection) -> str:
    """The test split of the chosen configuration and the baseline, the only runs evaluated on it: the seed
    comparison (``ea-hf compare --seeds``, against the baseline) where seeds are pooled, else the runs side by
    side."""
    run_dirs = [recipe.output_dir for recipe in selected_runs(runs, selection)]
    head = f"{selection.test_split}, evaluated once, for the chosen configuration and the baseline:\n"
    if not pools_seeds(run_dirs):  # one seed each
        return head + compare_runs(run_dirs, splits=[selection.test_split])
    reference = Path(selection.baseline.name).name  # as seed_evidence names its groups
    return head + str(seed_evidence(run_dirs, reference=reference, metric=selection.metric,
                                    split=selection.test_split))  # fmt: skip


def write_selection(output_dir: str | Path, selection: Selection) -> Path:
    """``selection.json`` in the sweep's folder ``output_dir``, its configurations named relative to it."""
    record = selection.to_dict(Path(output_dir))
    return write_atomically(Path(output_dir) / SELECTION_FILE, json.dumps(record, indent=2) + "\n")


def selection_of(run_dir: str | Path) -> tuple[Selection, str] | None:
    """The selection that ``run_dir`` took part in (``selection.json`` in a folder above it), and the name its
    configuration has there (its folder relative to the selection's); None where it took part in none."""
    group = Path(seed_group_name(Path(run_dir).resolve()))
    for folder in group.parents if group.name else ():
        path = folder / SELECTION_FILE
        if path.is_file():
            selection = Selection.from_dict(json.loads(path.read_text()))
            name = os.path.relpath(group, folder)
            if any(candidate.name == name for candidate in selection.ranked):
                return selection, name
    return None

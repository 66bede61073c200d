"""Task kind ``glue``: the nine GLUE tasks (their columns, labels and metrics), loading from the Hub or local
files, tokenisation, and the kind's recipe section.

Example:
    >>> GLUE_TASKS["wnli"].label_names  # WNLI's order differs from RTE's and QNLI's
    ('not_entailment', 'entailment')
    >>> GLUE_TASKS["mnli"].eval_splits
    ('validation_matched', 'validation_mismatched')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import transformers

from ..data_files import check_table_file, load_checked_file
from ..recipe import DataSection, Recipe
from ..rotten_tomatoes import rotten_tomatoes
from ..suggestions import did_you_mean
from ..task_kind import CardInfo, Preprocessed, TaskKind

METRIC_DIR = Path(__file__).resolve().parents[1] / "metrics" / "glue"
LABEL_COLUMN = "label"
DEFAULT_HUB_ID = "nyu-mll/glue"
#: ``data.source`` of the offline Rotten Tomatoes corpus (see :mod:`ea_hf.training.rotten_tomatoes`).
ROTTEN_TOMATOES = "rotten-tomatoes"


@dataclasses.dataclass(frozen=True)
class GlueTask:
    """What a GLUE task's data looks like (as in ``nyu-mll/glue``) and how it is scored."""

    name: str
    #: How GLUE writes the name (``SST-2``).
    title: str
    text_columns: tuple[str, ...]
    #: Class names in label-id order; None for regression (STS-B).
    label_names: tuple[str, ...] | None
    #: Metric keys; the first is the task's headline metric.
    metrics: tuple[str, ...]
    eval_splits: tuple[str, ...] = ("validation",)

    @property
    def is_regression(self) -> bool:
        return self.label_names is None

    @property
    def num_labels(self) -> int:
        return 1 if self.label_names is None else len(self.label_names)


GLUE_TASKS: dict[str, GlueTask] = {
    task.name: task
    for task in [
        GlueTask("cola", "CoLA", ("sentence",), ("unacceptable", "acceptable"), ("matthews_correlation",)),
        GlueTask("sst2", "SST-2", ("sentence",), ("negative", "positive"), ("accuracy",)),
        GlueTask("mrpc", "MRPC", ("sentence1", "sentence2"), ("not_equivalent", "equivalent"), ("f1", "accuracy")),
        GlueTask("stsb", "STS-B", ("sentence1", "sentence2"), None, ("pearson", "spearmanr")),
        GlueTask("qqp", "QQP", ("question1", "question2"), ("not_duplicate", "duplicate"), ("f1", "accuracy")),
        GlueTask(
            "mnli",
            "MNLI",
            ("premise", "hypothesis"),
            ("entailment", "neutral", "contradiction"),
            ("accuracy",),
            eval_splits=("validation_matched", "validation_mismatched"),
        ),
        GlueTask("qnli", "QNLI", ("question", "sentence"), ("entailment", "not_entailment"), ("accuracy",)),
        GlueTask("rte", "RTE", ("sentence1", "sentence2"), ("entailment", "not_entailment"), ("accuracy",)),
        GlueTask("wnli", "WNLI", ("sentence1", "sentence2"), ("not_entailment", "entailment"), ("accuracy",)),
    ]
}

_BUILDERS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def load_glue_data(task: str, source: str = "hub", hub_id: str = DEFAULT_HUB_ID, files: Mapping[str, str] = ()):
    """Load a task's splits as a ``datasets.DatasetDict`` with labels cast explicitly.

    ``source="hub"`` reads ``hub_id`` (config ``task``); ``source="local"`` reads ``files`` (split name ->
    csv/tsv/json/jsonl/parquet path) with the GLUE column names. Labels become a ``ClassLabel`` with the
    task's names (given as ids or as names), or float32 for STS-B.
    """
    import datasets

    spec = GLUE_TASKS[task]
    if source == "hub":
        loaded = datasets.load_dataset(hub_id, task)
        splits = {split: loaded[split] for split in ("train", *spec.eval_splits) if split in loaded}
    elif source == ROTTEN_TOMATOES:
        if task != "sst2":
            raise ValueError(f"data.source {ROTTEN_TOMATOES} holds SST-2-format sentences: data.task must be sst2")
        corpus = rotten_tomatoes()
        columns = ("sentence", LABEL_COLUMN)
        splits = {split: datasets.Dataset.from_dict({c: rows[c] for c in columns}) for split, rows in corpus.items()}
    elif source == "local":
        splits = {}
        for split, path in dict(files).items():
            path = Path(path)
            if not path.is_file():
                raise FileNotFoundError(f"data file for split {split!r} not found: {path}")
            builder = _BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise ValueError(f"unsupported data file type {path.suffix!r} ({', '.join(_BUILDERS)})")
            check_table_file(path, spec.text_columns, LABEL_COLUMN, spec.label_names)
            # Text stays text: by default pandas reads a sentence such as "NA" or "null" as a missing value, and a
            # column of sentences that all look like numbers ("007", "2.5") as numbers.
            options = (
                {"na_filter": False, "converters": dict.fromkeys(spec.text_columns, str)} if builder == "csv" else {}
            )
            if path.suffix.lower() == ".tsv":
                options |= {"delimiter": "\t", "quoting": 3}
            splits[split] = load_checked_file(builder, path, split, **options)
    else:
        raise ValueError(f"unknown data source {source!r}; expected 'hub', 'local' or {ROTTEN_TOMATOES!r}")
    return datasets.DatasetDict({split: cast_labels(dataset, spec, split) for split, dataset in splits.items()})


def cast_labels(dataset, spec: GlueTask, split: str = "data"):
    """Check a split's columns and cast its labels to the task's ClassLabel (float32 for regression)."""
    import datasets

    missing = [c for c in (*spec.text_columns, LABEL_COLUMN) if c not in dataset.column_names]
    if missing:
        raise ValueError(
            f"{spec.name} {split} split lacks column(s) {missing}; it has {dataset.column_names} "
            f"(GLUE {spec.name} uses {list(spec.text_columns) + [LABEL_COLUMN]})"
        )
    if spec.is_regression:
        return dataset.cast_column(LABEL_COLUMN, datasets.Value("float32"))
    names = list(spec.label_names)
    feature = dataset.features[LABEL_COLUMN]
    if isinstance(feature, datasets.ClassLabel):
        if list(feature.names) != names:
            raise ValueError(f"{spec.name} {split} labels are {feature.names}, expected {names} in that order")
        return dataset
    values = set(dataset.unique(LABEL_COLUMN))
    if all(isinstance(v, str) for v in values):
        unknown = sorted(values - set(names))
        if unknown:
            raise ValueError(f"{spec.name} {split} has unknown label(s) {unknown}; expected {names}")
        dataset = dataset.map(lambda row: {LABEL_COLUMN: names.index(row[LABEL_COLUMN])})
    else:
        bad = sorted(v for v in values if not isinstance(v, (int, np.integer)) or not 0 <= v < len(names))
        if bad:
            raise ValueError(f"{spec.name} {split} has label id(s) {bad} outside 0..{len(names) - 1} ({names})")
    return dataset.cast_column(LABEL_COLUMN, datasets.ClassLabel(names=names))


def tokenize(dataset, spec: GlueTask, tokenizer, max_length: int):
    """Tokenise a split (single sentences or pairs, truncated to ``max_length``); keep only model inputs."""

    def encode(batch: dict[str, list[Any]]) -> dict[str, Any]:
        texts = [batch[column] for column in spec.text_columns]
        encoded = tokenizer(*texts, truncation=True, max_length=max_length)
        encoded["labels"] = batch[LABEL_COLUMN]
        return encoded

    return dataset.map(encode, batched=True, remove_columns=dataset.column_names, desc=f"Tokenizing {spec.name}")


def load_glue_metric(task: str):
    """The GLUE metric of ``task`` as an ``evaluate`` module, from the copy inside ea_hf (works offline)."""
    import evaluate

    return evaluate.load(str(METRIC_DIR), task)


def _predicted(eval_prediction, spec: GlueTask) -> np.ndarray:
    logits = eval_prediction.predictions
    if isinstance(logits, tuple):
        logits = logits[0]
    return logits.squeeze(-1) if spec.is_regression else logits.argmax(-1)


def correct_fn(task: str):
    """Per-example correctness (1.0 right, 0.0 wrong) of a classification task's predictions; None for STS-B,
    whose score is a correlation over the whole split."""
    spec = GLUE_TASKS[task]
    if spec.is_regression:
        return None
    return lambda eval_prediction: (_predicted(eval_prediction, spec) == eval_prediction.label_ids).astype(float)


def compute_metrics_fn(task: str):
    """A ``Trainer`` ``compute_metrics`` function for ``task``."""
    spec = GLUE_TASKS[task]
    metric = load_glue_metric(task)

    def compute(eval_prediction) -> dict[str, float]:
        return metric.compute(predictions=_predicted(eval_prediction, spec), references=eval_prediction.label_ids)

    return compute


# --------------------------------------------------------------------------------------------------
# The task kind
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class GlueData(DataSection):
    """Kind ``glue``: the task names the columns and metric, not the source. ``source: hub`` reads ``hub_id``
    (default ``nyu-mll/glue``); ``source: local`` reads csv, tsv, json, jsonl or parquet files with the GLUE
    column names; ``source: rotten-tomatoes`` (task ``sst2``) is the offline corpus of
    :mod:`ea_hf.training.rotten_tomatoes`: train, validation and test splits by film."""

    task: str = ""
    source: Literal["hub", "local", "rotten-tomatoes"] = "hub"
    max_length: int = 128


@dataclasses.dataclass
class GlueRecipe(Recipe):
    data: GlueData = dataclasses.field(default_factory=GlueData)


class GlueKind(TaskKind):
    """Text classification (or STS-B regression) on one of the nine GLUE tasks."""

    name = "glue"
    recipe_class = GlueRecipe
    preprocessor_class = "AutoTokenizer"
    peft_task_type = "SEQ_CLS"

    def check(self, recipe: Recipe, problems: list[tuple[str, str]]) -> None:
        task = recipe.data.task
        if not task:
            problems.append(("data.task", "is required"))
        elif task not in GLUE_TASKS:
            hint = did_you_mean(task, GLUE_TASKS)
            problems.append(("data.task", f"unknown GLUE task {task!r}{hint}; one of {', '.join(GLUE_TASKS)}"))
        for split, path in recipe.data.files.items():
            if Path(path).suffix.lower() not in _BUILDERS:
                problems.append(
                    (f"data.files.{split}", f"unsupported file type {path!r} (csv, tsv, json, jsonl, parquet)")
                )
        if recipe.data.max_length <= 0:
            problems.append(("data.max_length", "must be positive"))
        if recipe.data.source == ROTTEN_TOMATOES and task in GLUE_TASKS and task != "sst2":  # one problem per key
            problems.append(("data.task", f"must be sst2 with data.source: {ROTTEN_TOMATOES} (SST-2's sentences)"))

    def task_label(self, recipe: Recipe) -> str:
        return recipe.data.task

    def metric_names(self, recipe: Recipe) -> tuple[str, ...]:
        return GLUE_TASKS[recipe.data.task].metrics

    def card_info(self, recipe: Recipe) -> CardInfo:
        spec = GLUE_TASKS[recipe.data.task]
        hub_id = recipe.data.hub_id or DEFAULT_HUB_ID
        if recipe.data.source == "hub":
            return CardInfo(
                pipeline_tag="text-classification",
                task_type="text-classification",
                task_text=f"GLUE {spec.title}",
                dataset_name=f"GLUE {spec.title}",
                dataset_type=hub_id,
                dataset_config=spec.name,
                hub_datasets=(hub_id,),
            )
        if recipe.data.source == ROTTEN_TOMATOES:
            return CardInfo(
                pipeline_tag="text-classification",
                task_type="text-classification",
                task_text="sentiment classification",
                dataset_name="Rotten Tomatoes review snippets (Pang and Lee)",
                dataset_type="local",
                data_text="Rotten Tomatoes review snippets (Pang and Lee; fresh = 1, rotten = 0), split by film",
            )
        # Local files in a GLUE task's format: not GLUE's data, so named as what they are.
        names = [column.rstrip("12") for column in spec.text_columns]
        rows = f"{names[0]}s" if len(names) == 1 else f"{'-'.join(dict.fromkeys(names))} pairs"
        return CardInfo(
            pipeline_tag="text-classification",
            task_type="text-classification",
            task_text="text regression" if spec.is_regression else "text classification",
            dataset_name=f"{spec.title}-format local files",
            dataset_type="local",
            data_text=f"{spec.title}-format {rows} in local files: {recipe.data.file_names()}",
        )

    def load_data(self, recipe: Recipe):
        spec = GLUE_TASKS[recipe.data.task]
        data = recipe.data
        return load_glue_data(spec.name, data.source, data.hub_id or DEFAULT_HUB_ID, data.files), spec.label_names

    def preprocess(self, recipe, data, label_names, model, processor) -> Preprocessed:
        spec = GLUE_TASKS[recipe.data.task]
        splits = {split: tokenize(dataset, spec, processor, recipe.data.max_length) for split, dataset in data.items()}
        collator = transformers.DataCollatorWithPadding(processor)
        return Preprocessed(splits, collator, compute_metrics_fn(spec.name), per_example_scores=correct_fn(spec.name))

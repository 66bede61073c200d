"""Task kind ``timeseries``: multivariate time series for EA-DC-Transformer (loading, scaling, batching, the
model, its pre-training phase) and the kind's recipe sections.

Series are [T, C] arrays of varying length T. They come from the UEA/UCR ``.ts`` format (read with aeon,
the optional ``timeseries`` extra, which also ships some UEA archives such as JapaneseVowels, so those load
offline by name) or from arrays. Values are standardised per variable with the training split's statistics;
batches are right-padded with an ``attention_mask``.

Example:
    >>> import numpy as np
    >>> data = series_dataset({"train": ([np.ones((3, 2)), np.zeros((5, 2))], ["a", "b"])})
    >>> data["train"].features["label"].names, len(data["train"][1]["values"])
    (['a', 'b'], 5)
    >>> batch = SeriesCollator()([data["train"][0], data["train"][1]])
    >>> batch["values"].shape, batch["attention_mask"].tolist()
    (torch.Size([2, 5, 2]), [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import transformers

from ...modeling.dc_transformer import (
    EADCTransformerConfig,
    EADCTransformerForPreTraining,
    EADCTransformerForTimeSeriesClassification,
    EADCTransformerForTimeSeriesRegression,
)
from ..data_files import check_classes, check_series, check_ts_labels, check_variables, one_line, ts_data_line
from ..models import optimizer_override
from ..recipe import DataSection, Recipe
from ..run_dir import PRETRAINED_DIR
from ..task_kind import CardInfo, Preprocessed, TaskKind, head_losses


def _import_aeon():
    try:
        import aeon.datasets
    except ImportError:
        raise ImportError('reading UEA/UCR .ts data needs aeon: pip install "ea_hf[timeseries]"') from None
    return aeon.datasets


def load_ts_file(path: str | Path, task: str | None = None) -> tuple[list[np.ndarray], list[str]]:
    """Series ([T, C] float32 arrays) and labels of a UEA/UCR ``.ts`` file, checked first (see
    :mod:`ea_hf.training.data_files`): one ValueError naming the file, and the line where there is one, for a file
    that is empty, binary or malformed, holds no series or a missing value, or (``task`` given) lacks the task's
    labels."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no .ts file there")
    data_line = ts_data_line(path)
    aeon = _import_aeon()
    try:
        values, labels, header = aeon.load_from_ts_file(str(path), return_meta_data=True)
    except Exception as error:  # aeon's parser raises OSError, ValueError, IndexError... on a malformed file
        raise ValueError(
            f"{path}: aeon cannot read this .ts file ({one_line(error)}), expected a UEA/UCR header, @data, then "
            "one series a line (values separated by commas, variables by colons, the label last)"
        ) from None
    series, labels = [np.asarray(one, dtype=np.float32).T for one in values], [str(label) for label in labels]
    if task is not None:
        check_ts_labels(path, labels, header, task == "regression", first_line=data_line + 1)
    check_series(str(path), series, labels, task == "regression", first_line=data_line + 1)
    return series, labels


def archive_task(name: str) -> str | None:
    """The task of an archive that aeon knows by name: ``regression`` for the Monash time-series extrinsic
    regression archive (TPAMI Table I's datasets), ``classification`` for the UCR/UEA archives; None if unknown.

    Example:
        >>> archive_task("Covid3Month"), archive_task("JapaneseVowels"), archive_task("NoSuchArchive")
        ('regression', 'classification', None)
    """
    from aeon.datasets import tsc_datasets, tser_datasets

    regression = {*tser_datasets.tser_soton, *tser_datasets.tser_monash}
    classification = {*tsc_datasets.univariate, *tsc_datasets.multivariate, *tsc_datasets.UCR2015}
    if name in regression:
        return "regression"
    return "classification" if name in classification else None


def resolved_task(archive: str | None, task: str | None) -> str:
    """``task`` as stated, else the archive's own (see :func:`archive_task`), else classification."""
    return task or (archive_task(archive) if archive else None) or "classification"


def load_uea(
    name: str, splits: Sequence[str] = ("train", "test"), task: str | None = None
) -> dict[str, tuple[list[np.ndarray], list[Any]]]:
    """An archive by name (UCR/UEA classification or Monash regression), from aeon's bundled copies (offline)
    or its download cache; ``task`` None: the archive's own (see :func:`archive_task`). Labels are class names
    (str) or regression targets (float)."""
    datasets = _import_aeon()
    task = resolved_task(name, task)
    load = datasets.load_regression if task == "regression" else datasets.load_classification
    loaded = {}
    for split in splits:
        try:
            values, labels = load(name, split=split)
        except (OSError, ValueError) as error:
            if archive_task(name) is None:
                raise
            raise FileNotFoundError(
                f"the {task} archive {name!r} is neither bundled with aeon nor in its download cache, and could not "
                f"be downloaded ({error}). Run once with network access, or give its .ts files with "
                "data.source: local"
            ) from error
        targets = [float(y) for y in labels] if task == "regression" else [str(y) for y in labels]
        series = [np.asarray(one, dtype=np.float32).T for one in values]
        check_series(f"the archive {name!r} ({split} split)", series, targets, task == "regression")
        loaded[split] = (series, targets)
    return loaded


def hold_out(
    splits: dict[str, tuple[list[np.ndarray], Sequence[Any]]], fraction: float, seed: int = 0, stratify: bool = True
) -> dict[str, tuple[list[np.ndarray], list[Any]]]:
    """Move ``fraction`` of the training series into a ``validation`` split (per class when ``stratify``).

    The shuffle depends on ``seed`` only, so every model and training seed of a search sees the same split,
    and the test split is never looked at: hyper-parameters are chosen on validation, as in the paper.

    Example:
        >>> import numpy as np
        >>> train = ([np.full((2, 1), i, dtype=np.float32) for i in range(10)], ["a"] * 5 + ["b"] * 5)
        >>> held = hold_out({"train": train}, 0.2)
        >>> len(held["train"][0]), sorted(held["validation"][1])
        (8, ['a', 'b'])
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"the validation fraction must be between 0 and 1, got {fraction}")
    if "validation" in splits:
        raise ValueError("the data already has a validation split; leave data.validation_fraction at 0")
    values, labels = splits["train"]
    rng = np.random.default_rng(seed)
    groups = (
        [np.flatnonzero(np.asarray(labels) == label) for label in sorted(set(labels))]
        if stratify
        else [np.arange(len(values))]
    )
    held = np.concatenate([rng.permutation(group)[: round(fraction * len(group))] for group in groups])
    if len(held) == 0 or len(held) == len(values):
        raise ValueError(f"a validation fraction of {fraction} of {len(values)} training series leaves a split empty")
    is_held = np.zeros(len(values), dtype=bool)
    is_held[held] = True

    def take(mask: np.ndarray) -> tuple[list[np.ndarray], list[Any]]:
        indices = np.flatnonzero(mask)
        return [values[i] for i in indices], [labels[i] for i in indices]

    return {**splits, "train": take(~is_held), "validation": take(is_held)}


def standardise(splits: dict[str, tuple[list[np.ndarray], Any]]) -> dict[str, tuple[list[np.ndarray], Any]]:
    """Scale every variable to mean 0 and standard deviation 1 with the training split's statistics."""
    steps = np.concatenate(splits["train"][0], axis=0)
    mean, std = steps.mean(axis=0), steps.std(axis=0) + 1e-8
    return {split: ([(series - mean) / std for series in values], labels) for split, (values, labels) in splits.items()}


def series_dataset(splits: Mapping[str, tuple[Sequence[np.ndarray], Sequence[Any]]], regression: bool = False):
    """A ``datasets.DatasetDict`` with ``values`` ([T, C] lists) and ``label`` (a ClassLabel with the sorted
    class names of all splits, or float32 targets for regression)."""
    import datasets

    label_feature: Any = datasets.Value("float32")
    if not regression:
        names = sorted({str(label) for _, labels in splits.values() for label in labels})
        label_feature = datasets.ClassLabel(names=names)
    result = {}
    for split, (values, labels) in splits.items():
        if len(values) != len(labels):
            raise ValueError(f"the {split} split has {len(values)} series but {len(labels)} labels")
        channels = {np.shape(series)[1] for series in values}
        if len(channels) > 1:
            raise ValueError(f"the {split} split mixes series with {sorted(channels)} variables")
        features = datasets.Features(
            {"values": datasets.Sequence(datasets.Sequence(datasets.Value("float32"))), "label": label_feature}
        )
        targets = [float(label) for label in labels] if regression else [str(label) for label in labels]
        result[split] = datasets.Dataset.from_dict(
            {"values": [np.asarray(series).tolist() for series in values], "label": targets}, features=features
        )
    return datasets.DatasetDict(result)


class SeriesCollator:
    """Pads a list of examples (``values`` [T, C], ``label``) to the longest, with an ``attention_mask``."""

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        series = [torch.as_tensor(example["values"], dtype=torch.float32) for example in examples]
        longest, channels = max(len(s) for s in series), series[0].shape[1]
        values = torch.zeros(len(series), longest, channels)
        mask = torch.zeros(len(series), longest, dtype=torch.long)
        for row, one in enumerate(series):
            values[row, : len(one)] = one
            mask[row, : len(one)] = 1
        batch = {"values": values, "attention_mask": mask}
        if "label" in examples[0] and examples[0]["label"] is not None:
            batch["labels"] = torch.tensor([example["label"] for example in examples])
        return batch


def series_metrics_fn(regression: bool):
    """``compute_metrics``: accuracy (classification) or RMSE (regression)."""

    def compute(prediction) -> dict[str, float]:
        outputs, labels = prediction[0], prediction[1]
        outputs = outputs[0] if isinstance(outputs, tuple) else outputs
        if regression:
            return {"rmse": float(np.sqrt(np.mean((outputs.reshape(labels.shape) - labels) ** 2)))}
        return {"accuracy": float(np.mean(np.argmax(outputs, axis=-1) == labels))}

    return compute


# --------------------------------------------------------------------------------------------------
# The task kind
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class TimeSeriesData(DataSection):
    """Kind ``timeseries``: ``task`` is classification or regression; ``source: uea`` reads an archive by name
    (``archive``: UCR/UEA classification or Monash regression, from aeon's bundled copies or its cache; the task
    is the archive's unless stated), ``source: local`` reads ``.ts`` files (``task`` required)."""

    #: None: the archive's task (``source: uea``).
    task: Literal["classification", "regression"] | None = None
    source: Literal["uea", "local"] = "uea"
    archive: str | None = None
    #: Hold out this share of the training series (per class for classification) as a ``validation`` split to
    #: choose hyper-parameters on; the split depends on ``split_seed`` only.
    validation_fraction: float = 0.0
    split_seed: int = 0


@dataclasses.dataclass
class PretrainSection:
    """Self-supervised pre-training before fine-tuning (TPAMI section 3.3.2): hide ``mask_ratio`` of the input
    values and learn to reconstruct them, for ``epochs`` epochs of the training split (0: no pre-training); the
    fine-tuned model starts from the result."""

    epochs: float = 0.0
    learning_rate: float | None = None
    mask_ratio: float = 0.15


@dataclasses.dataclass
class TimeSeriesRecipe(Recipe):
    data: TimeSeriesData = dataclasses.field(default_factory=TimeSeriesData)
    pretrain: PretrainSection = dataclasses.field(default_factory=PretrainSection)


class TimeSeriesKind(TaskKind):
    """EA-DC-Transformer on multivariate time series: classification (accuracy) or regression (RMSE). The model
    is built from ``model.config`` and the ``ea`` section (EA off: DC-Transformer), or loaded from a checkpoint."""

    name = "timeseries"
    recipe_class = TimeSeriesRecipe

    def check(self, recipe: Recipe, problems: list[tuple[str, str]]) -> None:
        data = recipe.data
        if data.source == "uea" and not data.archive:
            problems.append(("data.archive", "name the UEA/UCR archive (e.g. JapaneseVowels)"))
        elif data.source == "uea" and importlib.util.find_spec("aeon") is not None:
            known = archive_task(data.archive)
            if known is not None and data.task is not None and data.task != known:
                problems.append(
                    (
                        "data.task",
                        f"{data.archive} is a {known} archive, not {data.task}; drop data.task to use its own",
                    )
                )
        if data.source == "local" and data.task is None:
            problems.append(("data.task", "is required with local .ts files (classification or regression)"))
        if not 0.0 <= data.validation_fraction < 1.0:
            problems.append(("data.validation_fraction", "must be at least 0 and below 1"))
        for split, path in data.files.items():
            if Path(path).suffix.lower() != ".ts":
                problems.append((f"data.files.{split}", f"expected a UEA/UCR .ts file, got {path!r}"))
        if recipe.pretrain.epochs < 0:
            problems.append(("pretrain.epochs", "must not be negative"))

    def needs_checkpoint(self, recipe: Recipe) -> bool:
        return False  # built from model.config

    def task_label(self, recipe: Recipe) -> str:
        return series_task(recipe.data)

    def metric_names(self, recipe: Recipe) -> tuple[str, ...]:
        return ("rmse",) if series_task(recipe.data) == "regression" else ("accuracy",)

    def card_info(self, recipe: Recipe) -> CardInfo:
        data = recipe.data
        task = series_task(data)
        archive = "Monash TSER" if task == "regression" else "UEA/UCR"
        name = f"{archive} {data.archive}" if data.source == "uea" else "local .ts files"
        # Neither the archives (aeon's copies) nor local files are Hub datasets: no ``datasets`` metadata.
        text = f"the {archive} archive's {data.archive}" if data.source == "uea" else f"series in {name}"
        # The Hub has no pipeline for time-series classification or regression (only forecasting).
        return CardInfo(
            pipeline_tag=None,
            task_type=f"time-series-{task}",
            task_text=f"time-series {task}",
            dataset_name=name,
            dataset_type=data.archive if data.source == "uea" else "local",
            data_text=text if data.source == "uea" else f"{text}: {data.file_names()}",
        )

    def model_details(self, config: dict[str, Any], recipe: Recipe) -> tuple[tuple[str, str], ...]:
        evolving = bool(config.get("alpha") or config.get("beta"))
        name = "EA-DC-Transformer" if evolving else "DC-Transformer"
        if not evolving and config.get("attention_ratio") == 1.0:
            name = "Transformer"
        ratio, heads = config["attention_ratio"], config["num_attention_heads"]
        width = round(ratio * config["hidden_size"])
        evolution = f"alpha {config['alpha']:g}, beta {config['beta']:g}, kernel {config['evolution_kernel_size']}"
        return (
            ("model", f"{name} (TPAMI 2023, section 3.3), {weights_origin(recipe)}"),
            ("hidden size d", str(config["hidden_size"])),
            ("blocks n", str(config["num_layers"])),
            ("attention ratio p", f"{ratio:g} ({width} of d to attention, {heads} heads)"),
            ("evolution", evolution if evolving else "none"),
            ("input variables", str(config["input_size"])),
        )

    def load_data(self, recipe: Recipe):
        data = recipe.data
        regression = series_task(data) == "regression"
        if data.source == "uea":
            splits = load_uea(data.archive, task=series_task(data))
            names = {split: f"the archive {data.archive!r} ({split} split)" for split in splits}
        else:
            splits = {split: load_ts_file(path, series_task(data)) for split, path in data.files.items()}
            names = {split: str(path) for split, path in data.files.items()}
        check_variables(splits, names)
        if not regression and "train" in splits:
            check_classes(names["train"], splits["train"][1])
        if data.validation_fraction:
            splits = hold_out(splits, data.validation_fraction, data.split_seed, stratify=not regression)
        loaded = series_dataset(standardise(splits), regression=regression)
        return loaded, None if regression else tuple(loaded["train"].features["label"].names)

    def example_losses(self, recipe: Recipe, config: transformers.PreTrainedConfig):
        regression = series_task(recipe.data) == "regression"  # (the regression head has no num_labels of 1)
        problem_type = "regression" if regression else "single_label_classification"
        return functools.partial(head_losses, problem_type=problem_type)

    def load_model(self, recipe: Recipe, label_names: tuple[str, ...] | None, data: dict[str, Any]):
        return series_model(recipe, label_names, data, recipe.model.name_or_path), None

    def preprocess(self, recipe, data, label_names, model, processor) -> Preprocessed:
        return Preprocessed(dict(data), SeriesCollator(), series_metrics_fn(regression=label_names is None))

    def before_training(self, recipe: Recipe, run_dir: Path, args: transformers.TrainingArguments) -> Recipe:
        return pretrain_series(recipe, run_dir, args) if recipe.pretrain.epochs > 0 else recipe


def series_task(data: TimeSeriesData) -> str:
    """The task of a recipe's data: as stated, or the archive's own (classification when aeon does not know it)."""
    return resolved_task(data.archive if data.source == "uea" else None, data.task)


def weights_origin(recipe: Recipe) -> str:
    """Where a run's weights came from, as the card says it: a checkpoint, the run's own pre-training, or
    nothing (trained from scratch)."""
    if recipe.model.name_or_path:
        return f"fine-tuned from {recipe.model.name_or_path}"
    if recipe.pretrain.epochs > 0:
        return (
            f"pre-trained by masked value reconstruction on the training series ({recipe.pretrain.epochs:g} "
            "epochs), then trained on the task"
        )
    return "trained from scratch"


def series_model(recipe: Recipe, label_names: tuple[str, ...] | None, data, name_or_path: str | None):
    """An EA-DC-Transformer for the task: from ``name_or_path`` (a pre-trained or fine-tuned checkpoint), or
    new from ``model.config`` and the ``ea`` settings (alpha = beta = 0 with EA off: DC-Transformer)."""
    head = EADCTransformerForTimeSeriesRegression if label_names is None else EADCTransformerForTimeSeriesClassification
    task = {"num_targets": 1} if label_names is None else {"num_labels": len(label_names)}
    if label_names is not None:
        task |= {"id2label": dict(enumerate(label_names)), "label2id": {n: i for i, n in enumerate(label_names)}}
    if name_or_path:
        return head.from_pretrained(name_or_path, **task)
    settings = recipe.evolution() if recipe.ea.enabled else None
    first = next(iter(data.values()))[0]["values"]
    longest = max(len(series) for split in data.values() for series in split["values"])
    config = EADCTransformerConfig(
        input_size=len(first[0]),
        max_position_embeddings=longest,
        alpha=settings.alpha if settings else 0.0,
        beta=settings.beta if settings else 0.0,
        evolution_kernel_size=settings.kernel_size if settings else 3,
        mask_ratio=recipe.pretrain.mask_ratio,
        **(recipe.model.config or {}),
        **task,
    )
    return head(config)


def pretrain_series(recipe: Recipe, run_dir: Path, args: transformers.TrainingArguments) -> Recipe:
    """Pre-train an EA-DC-Transformer by masked value reconstruction on the training split (saved in
    ``run_dir/pretrained``); return the recipe whose model starts from it."""
    transformers.set_seed(recipe.train.seed)
    data, label_names = recipe.task_kind.load_data(recipe)
    config = series_model(recipe, label_names, data, None).config
    model = EADCTransformerForPreTraining(config)
    phase = copy.deepcopy(recipe)
    phase.train.epochs, phase.train.max_steps = recipe.pretrain.epochs, -1
    phase.train.learning_rate = recipe.pretrain.learning_rate or recipe.train.learning_rate
    phase.train.eval_strategy = phase.train.save_strategy = "no"
    pretrain_args = dataclasses.replace(
        args,
        output_dir=str(run_dir / PRETRAINED_DIR),
        num_train_epochs=phase.train.epochs,
        max_steps=-1,
        learning_rate=phase.train.learning_rate,
        eval_strategy="no",
        save_strategy="no",
    )
    trainer = transformers.Trainer(
        model=model,
        args=pretrain_args,
        train_dataset=data["train"],
        data_collator=SeriesCollator(),
        optimizer_cls_and_kwargs=optimizer_override(phase),
    )
    trainer.train()
    trainer.save_model(str(run_dir / PRETRAINED_DIR))
    finetune = copy.deepcopy(recipe)
    finetune.model.name_or_path = str(run_dir / PRETRAINED_DIR)
    return finetune

"""Multivariate time series for EA-DC-Transformer recipes (kind ``timeseries``): loading, scaling, batching.

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

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _import_aeon():
    try:
        import aeon.datasets
    except ImportError:
        raise ImportError('reading UEA/UCR .ts data needs aeon: pip install "ea_hf[timeseries]"') from None
    return aeon.datasets


def load_ts_file(path: str | Path) -> tuple[list[np.ndarray], list[str]]:
    """Series ([T, C] float32 arrays) and labels of a UEA/UCR ``.ts`` file."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"no .ts file {str(path)!r}")
    values, labels = _import_aeon().load_from_ts_file(str(path), return_type="np-list")
    return [np.asarray(series, dtype=np.float32).T for series in values], [str(label) for label in labels]


def load_uea(name: str, splits: Sequence[str] = ("train", "test")) -> dict[str, tuple[list[np.ndarray], list[str]]]:
    """A UEA/UCR archive by name, from aeon's bundled copies (offline) or its download cache."""
    datasets = _import_aeon()
    loaded = {}
    for split in splits:
        values, labels = datasets.load_classification(name, split=split)
        loaded[split] = ([np.asarray(series, dtype=np.float32).T for series in values], [str(y) for y in labels])
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

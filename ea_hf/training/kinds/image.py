"""Task kind ``image``: image classification data (loading, train/eval transforms), metrics and the kind's
recipe section.

Data comes from a Hub dataset (e.g. ``ILSVRC/imagenet-1k``) or from local image folders, one directory per
split with one sub-directory per class (``train/cat/1.png``), read with ``datasets``' ``imagefolder``.

Example:
    >>> import numpy as np
    >>> compute = image_metrics_fn(num_labels=10)
    >>> logits = np.eye(10)[[3, 1, 2]] + np.arange(10) * 0.01  # predicts 3, 1, 2; 9, 8, ... next
    >>> compute((logits, np.array([3, 9, 5])))
    {'accuracy': 0.3333333333333333, 'top5_accuracy': 0.6666666666666666}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from ..data_files import check_image_folders
from ..models import unwrap_model
from ..recipe import DataSection, Recipe
from ..task_kind import CardInfo, Preprocessed, TaskKind

#: Splits that are neither trained on nor evaluated: ImageNet's test split has no labels.
UNLABELLED_SPLITS = ("test",)


def load_image_data(
    source: str,
    hub_id: str | None,
    files: Mapping[str, str],
    image_column: str = "image",
    label_column: str = "label",
):
    """A ``datasets.DatasetDict`` with columns ``image`` (PIL images) and ``label`` (a ``ClassLabel``).

    ``source="hub"`` loads ``hub_id``; ``source="local"`` reads ``files`` (split name -> image folder), checked
    first (see :func:`~ea_hf.training.data_files.check_image_folders`).
    """
    import datasets

    if source == "hub":
        data = datasets.load_dataset(hub_id)
    else:
        check_image_folders(files)
        data = datasets.load_dataset(
            "imagefolder", data_files={split: f"{Path(path)}/**" for split, path in files.items()}
        )
    data = datasets.DatasetDict(data)
    for split, dataset in data.items():
        for column in (image_column, label_column):
            if column not in dataset.column_names:
                raise ValueError(f"the {split} split has no column {column!r} (columns: {dataset.column_names})")
        if not isinstance(dataset.features[label_column], datasets.ClassLabel):
            raise ValueError(f"the {split} split's {label_column!r} column is not a ClassLabel")
    renames = {image_column: "image", label_column: "label"}
    return data.rename_columns({old: new for old, new in renames.items() if old != new})


def _random_resized_crop(image, size: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """The Inception crop: a random area and aspect ratio, resized to ``size``; random numbers from torch, so
    ``transformers.set_seed`` makes runs repeatable."""
    from PIL import Image

    width, height = image.size
    for _ in range(10):
        area = width * height * float(torch.empty(1).uniform_(*scale))
        aspect = float(torch.exp(torch.empty(1).uniform_(np.log(ratio[0]), np.log(ratio[1]))))
        w, h = round((area * aspect) ** 0.5), round((area / aspect) ** 0.5)
        if 0 < w <= width and 0 < h <= height:
            left = int(torch.randint(0, width - w + 1, ()))
            top = int(torch.randint(0, height - h + 1, ()))
            return image.resize((size, size), Image.BICUBIC, box=(left, top, left + w, top + h))
    return image.resize((size, size), Image.BICUBIC)  # no crop fitted: the whole image


def image_transform(
    processor: Any,
    image_size: int,
    train: bool,
    crop_scale: tuple[float, float] = (0.08, 1.0),
    horizontal_flip: bool = True,
) -> Callable[[dict], dict]:
    """A batch transform for ``Dataset.with_transform``: images -> normalised ``pixel_values``.

    Training: Inception crop (a random ``crop_scale`` share of the area) and random horizontal flip;
    evaluation: resize. Both at ``image_size`` (ViT fine-tunes at a higher resolution than it was
    pre-trained at, 384 instead of 224), then the processor's rescaling and normalisation.
    """
    from PIL import Image, ImageOps

    def transform(batch: dict) -> dict:
        images = []
        for image in batch["image"]:
            image = image.convert("RGB")
            if train:
                image = _random_resized_crop(image, image_size, crop_scale)
                if horizontal_flip and float(torch.rand(())) < 0.5:
                    image = ImageOps.mirror(image)
            else:
                image = image.resize((image_size, image_size), Image.BICUBIC)
            images.append(image)
        pixel_values = processor(images=images, do_resize=False, return_tensors="pt")["pixel_values"]
        return {"pixel_values": pixel_values, "labels": batch["label"]}

    return transform


def processor_image_size(processor: Any) -> int:
    size = getattr(processor, "size", None) or {}
    size = size if isinstance(size, Mapping) else vars(size)
    value = size.get("height") or size.get("shortest_edge")
    if not value:
        raise ValueError(f"cannot tell the image size of {type(processor).__name__}; set data.image_size")
    return int(value)


class PixelCollator:
    """Stacks ``pixel_values`` and labels; asks the model to interpolate its position embeddings when the
    images are not the size it was pre-trained at."""

    def __init__(self, interpolate_pos_encoding: bool) -> None:
        self.interpolate_pos_encoding = interpolate_pos_encoding

    def __call__(self, examples: list[dict]) -> dict[str, Any]:
        batch = {
            "pixel_values": torch.stack([example["pixel_values"] for example in examples]),
            "labels": torch.tensor([example["labels"] for example in examples]),
        }
        if self.interpolate_pos_encoding:
            batch["interpolate_pos_encoding"] = True
        return batch


def image_metrics_fn(num_labels: int) -> Callable[[Any], dict[str, float]]:
    """``compute_metrics`` for ``Trainer``: top-1 accuracy, and top-5 when there are more than 5 classes."""

    def compute(prediction) -> dict[str, float]:
        logits, labels = prediction[0], prediction[1]
        logits = logits[0] if isinstance(logits, tuple) else logits
        metrics = {"accuracy": float(np.mean(np.argmax(logits, axis=-1) == labels))}
        if num_labels > 5:
            top5 = np.argsort(-logits, axis=-1)[:, :5]
            metrics["top5_accuracy"] = float(np.mean((top5 == labels[:, None]).any(axis=-1)))
        return metrics

    return compute


# --------------------------------------------------------------------------------------------------
# The task kind
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ImageData(DataSection):
    """Kind ``image``: a Hub dataset (``hub_id``, with its ``image_column`` and ``label_column``) or local image
    folders (``files``: one directory per split, one sub-directory per class)."""

    source: Literal["hub", "local"] = "hub"
    image_column: str = "image"
    label_column: str = "label"
    #: The resolution to fine-tune at (None: the image processor's; a ViT then interpolates its position
    #: embeddings to the new size).
    image_size: int | None = None
    #: Training augmentation: the share of the image area an Inception crop keeps (min, max), and random
    #: horizontal flips.
    crop_scale: list[float] = dataclasses.field(default_factory=lambda: [0.08, 1.0])
    horizontal_flip: bool = True


@dataclasses.dataclass
class ImageRecipe(Recipe):
    data: ImageData = dataclasses.field(default_factory=ImageData)


class ImageKind(TaskKind):
    """Image classification (top-1 and top-5 accuracy)."""

    name = "image"
    recipe_class = ImageRecipe
    auto_class = "AutoModelForImageClassification"
    preprocessor_class = "AutoImageProcessor"
    # Image batches are made from the "image" column by a transform, after Trainer would have dropped it.
    remove_unused_columns = False

    def check(self, recipe: Recipe, problems: list[tuple[str, str]]) -> None:
        data = recipe.data
        if data.source == "hub" and not data.hub_id:
            problems.append(("data.hub_id", "required for kind 'image' from the Hub (e.g. ILSVRC/imagenet-1k)"))
        if data.image_size is not None and data.image_size <= 0:
            problems.append(("data.image_size", "must be positive"))
        scale = data.crop_scale
        if len(scale) != 2 or not 0.0 < scale[0] <= scale[1] <= 1.0:
            problems.append(("data.crop_scale", f"must be [min, max] with 0 < min <= max <= 1, got {scale}"))

    def task_label(self, recipe: Recipe) -> str:
        return "image"

    def metric_names(self, recipe: Recipe) -> tuple[str, ...]:
        return ("accuracy", "top5_accuracy")

    def card_info(self, recipe: Recipe) -> CardInfo:
        if recipe.data.source == "hub":  # a hub_id left in a local recipe is unused
            hub_id = recipe.data.hub_id
            return CardInfo(
                pipeline_tag="image-classification",
                task_type="image-classification",
                task_text="image classification",
                dataset_name=hub_id,
                dataset_type=hub_id,
                hub_datasets=(hub_id,),
                data_text=hub_id,
            )
        return CardInfo(
            pipeline_tag="image-classification",
            task_type="image-classification",
            task_text="image classification",
            dataset_name="local image folders",
            dataset_type="imagefolder",
            data_text=f"images in local folders, one sub-folder per class: {recipe.data.file_names()}",
        )

    def load_data(self, recipe: Recipe):
        data = recipe.data
        splits = load_image_data(data.source, data.hub_id, data.files, data.image_column, data.label_column)
        for split in UNLABELLED_SPLITS:
            splits.pop(split, None)
        return splits, tuple(next(iter(splits.values())).features["label"].names)

    def preprocess(self, recipe, data, label_names, model, processor) -> Preprocessed:
        image_size = recipe.data.image_size or processor_image_size(processor)
        augmentation = {"crop_scale": tuple(recipe.data.crop_scale), "horizontal_flip": recipe.data.horizontal_flip}
        processed = {
            split: dataset.with_transform(image_transform(processor, image_size, split == "train", **augmentation))
            for split, dataset in data.items()
        }
        native_size = getattr(unwrap_model(model).config, "image_size", image_size)
        return Preprocessed(processed, PixelCollator(image_size != native_size), image_metrics_fn(len(label_names)))

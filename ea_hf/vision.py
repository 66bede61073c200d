"""Image classification data for recipes of kind ``image``: loading, train/eval transforms, metrics.

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

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

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

    ``source="hub"`` loads ``hub_id``; ``source="local"`` reads ``files`` (split name -> image folder).
    """
    import datasets

    if source == "hub":
        data = datasets.load_dataset(hub_id)
    else:
        missing = [f"{split}: {path}" for split, path in files.items() if not Path(path).is_dir()]
        if missing:
            raise FileNotFoundError(f"image folders not found ({', '.join(missing)}); give one directory per split")
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

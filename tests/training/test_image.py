"""Image classification recipes (kind ``image``): data from image folders, transforms, metrics, and the
EA-ViT recipe end to end on real images (scikit-learn's digits) with a tiny ViT."""

import numpy as np
import pytest
import torch
import transformers
from testing import IMAGE_SIZE, tiny_model, tiny_vit_checkpoint

import ea_hf
from ea_hf.training.kinds.image import image_metrics_fn, image_transform, load_image_data
from ea_hf.training.recipe import RecipeError, load_recipe, recipe_from_dict
from ea_hf.training.run_dir import read_metrics
from ea_hf.training.trainer import evaluate_run, prepare, run_recipe


def test_image_folders_load_with_class_labels(digits_folders):
    data = load_image_data("local", None, digits_folders)
    assert {split: len(dataset) for split, dataset in data.items()} == {"train": 1400, "validation": 397}
    assert data["train"].features["label"].names == [str(d) for d in range(10)]
    assert data["train"][0]["image"].size == (IMAGE_SIZE, IMAGE_SIZE)
    with pytest.raises(FileNotFoundError, match="image folders not found"):
        load_image_data("local", None, {"train": digits_folders["train"] + "-missing"})


def test_transforms_give_normalised_pixels_at_the_requested_size(digits_folders):
    data = load_image_data("local", None, digits_folders)
    processor = transformers.ViTImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    evaluation = data["validation"].with_transform(image_transform(processor, 24, train=False))
    example = evaluation[0]
    assert example["pixel_values"].shape == (3, 24, 24) and example["labels"] == data["validation"][0]["label"]
    # Rescaled to [0, 1] and normalised with mean 0.5, std 0.5: values in [-1, 1], black background at -1.
    assert example["pixel_values"].min() == pytest.approx(-1.0) and example["pixel_values"].max() <= 1.0
    assert torch.equal(evaluation[0]["pixel_values"], example["pixel_values"])  # evaluation is deterministic
    training = data["train"].with_transform(image_transform(processor, 24, train=True))
    torch.manual_seed(0)
    first = training[0]["pixel_values"]
    torch.manual_seed(0)
    assert torch.equal(training[0]["pixel_values"], first)  # augmentation follows the torch seed
    assert any(not torch.equal(training[0]["pixel_values"], first) for _ in range(5))  # and is random


def test_image_metrics_are_top1_and_top5_accuracy():
    compute = image_metrics_fn(num_labels=10)
    logits = np.tile(np.arange(10.0), (4, 1))  # every row ranks 9, 8, 7, 6, 5, ...
    assert compute((logits, np.array([9, 5, 4, 0]))) == {"accuracy": 0.25, "top5_accuracy": 0.5}
    assert image_metrics_fn(num_labels=3)((logits[:2, :3], np.array([2, 0]))) == {"accuracy": 0.5}


def test_image_recipes_are_checked():
    base = {"name": "v", "kind": "image", "model": {"name_or_path": "m"}}
    with pytest.raises(RecipeError) as info:
        recipe_from_dict({**base, "data": {"task": "sst2", "image_size": 0}}, ["train.warmup_ratio=0.1"])
    assert dict(info.value.problems) == {
        "data.task": "unknown key",  # the image kind's data section has no task
        "data.hub_id": "required for kind 'image' from the Hub (e.g. ILSVRC/imagenet-1k)",
        "data.image_size": "must be positive",
    }
    with pytest.raises(RecipeError, match="give warmup_steps or warmup_ratio, not both"):
        load_recipe("vision/ea-vit-base-imagenet", ["train.warmup_ratio=0.1"])
    recipe = load_recipe("vision/ea-vit-base-imagenet")
    assert (recipe.ea.alpha, recipe.ea.beta, recipe.data.image_size) == (0.1, 0.3, 384)
    train = recipe.train
    assert (train.optimizer, train.momentum, train.learning_rate, train.lr_scheduler) == ("sgd", 0.9, 0.03, "cosine")
    assert (train.warmup_steps, train.max_steps, train.weight_decay) == (500, 20000, 0.0)
    assert train.batch_size * train.gradient_accumulation_steps == 512


def test_the_ea_vit_recipe_builds_sgd_with_momentum_and_a_cosine_schedule(digits_folders, tmp_path):
    checkpoint = tiny_vit_checkpoint(tmp_path / "tiny-vit")
    overrides = [f"model.name_or_path={checkpoint}", "data.source=local", f"data.files={digits_folders}"]
    recipe = load_recipe("vision/ea-vit-base-imagenet", [*overrides, f"output_dir={tmp_path / 'run'}"])
    trainer, eval_splits = prepare(recipe, tmp_path / "run")
    trainer.create_optimizer_and_scheduler(num_training_steps=recipe.train.max_steps)
    assert isinstance(trainer.optimizer, torch.optim.SGD)
    assert {(g["momentum"], g["weight_decay"]) for g in trainer.optimizer.param_groups} == {(0.9, 0.0)}
    learning_rates = []
    for _ in range(501):
        learning_rates.append(trainer.lr_scheduler.get_last_lr()[0])
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
    assert learning_rates[0] == 0.0 and learning_rates[250] == pytest.approx(0.015) and learning_rates[500] == 0.03
    assert trainer.args.max_grad_norm == 1.0 and list(eval_splits) == ["validation"]
    assert trainer.train_dataset[0]["pixel_values"].shape == (3, 384, 384)  # the paper's resolution
    assert ea_hf.is_patched(trainer.model)


@pytest.mark.slow
def test_the_ea_vit_recipe_learns_the_digits(digits_folders, tmp_path):
    """The shipped recipe with a tiny random ViT and the digits at 24 px, so the position embeddings are
    interpolated as at 384 px. The recipe's SGD at 0.03 and its Inception crops are for fine-tuning a
    pre-trained ViT on ImageNet; the tiny model learns from scratch, so it gets AdamW and milder crops."""
    checkpoint = tiny_vit_checkpoint(tmp_path / "tiny-vit")
    overrides = [f"model.name_or_path={checkpoint}", "data.source=local", f"data.files={digits_folders}"]
    overrides += ["data.image_size=24", "data.crop_scale=[0.85, 1.0]", "data.horizontal_flip=false"]
    overrides += ["train.optimizer=adamw", "train.learning_rate=3e-3", "train.lr_scheduler=linear"]
    overrides += ["train.max_steps=200", "train.warmup_steps=15", "train.batch_size=32"]
    overrides += ["train.gradient_accumulation_steps=1", "train.eval_strategy=no", "train.save_strategy=no"]
    recipe = load_recipe("vision/ea-vit-base-imagenet", [*overrides, f"output_dir={tmp_path / 'run'}"])
    metrics = run_recipe(recipe)["validation"]
    # Chance: 0.1 and 0.5. Seen 0.50 and 0.93 on torch 2.12 to 2.15; 0.25 and 0.80 on 2.8 and 2.10, which draw
    # other initial weights from the same seed (given the same weights, forward and backward are bit-identical).
    assert metrics["accuracy"] >= 0.2 and metrics["top5_accuracy"] >= 0.75

    model = transformers.AutoModelForImageClassification.from_pretrained(tmp_path / "run")
    assert type(model).__name__ == "EAViTForImageClassification" and ea_hf.is_patched(model)
    assert model.config.id2label[3] == "3" and model.config.hidden_dropout_prob == 0.1
    assert (tmp_path / "run" / "preprocessor_config.json").exists()
    assert evaluate_run(tmp_path / "run")["validation"]["accuracy"] == metrics["accuracy"]
    assert read_metrics(tmp_path / "run")["validation"]["accuracy"] == metrics["accuracy"]


def test_a_checkpoint_with_a_head_of_another_size_needs_the_option(digits_folders, tmp_path):
    checkpoint = tmp_path / "three-classes"
    tiny_model("vit", transformers.AutoModelForImageClassification, num_labels=3).save_pretrained(checkpoint)
    transformers.ViTImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(checkpoint)
    overrides = [f"model.name_or_path={checkpoint}", "data.source=local", f"data.files={digits_folders}"]
    recipe = load_recipe("vision/ea-vit-base-imagenet", [*overrides, f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(ValueError, match="set model.ignore_mismatched_sizes=true"):
        prepare(recipe, tmp_path / "run")
    recipe.model.ignore_mismatched_sizes = True
    trainer, _ = prepare(recipe, tmp_path / "run")
    assert trainer.model.classifier.out_features == 10 and trainer.model.config.num_labels == 10

"""Running a recipe: load the checkpoint, patch it (or not, for the baseline), fine-tune with ``Trainer``,
evaluate every split and save everything into the run directory.

Run directory layout::

    recipe.yaml                  the resolved recipe (file + overrides + defaults)
    config.json, model.safetensors, modeling files, tokenizer files   the final model, as ea_hf.patch saves it
    checkpoints/checkpoint-N/    Trainer checkpoints (resume from the last one with ``resume=True``)
    eval/<split>/metrics.json    metrics of each evaluated split
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from .attention import AttentionMapEvolution
from .configuration import EvolvingAttentionSettings
from .glue import GLUE_TASKS, compute_metrics_fn, load_glue_data, tokenize
from .patching import patch
from .recipe import Recipe, recipe_from_dict
from .vision import (
    UNLABELLED_SPLITS,
    PixelCollator,
    image_metrics_fn,
    image_transform,
    load_image_data,
    processor_image_size,
)

CHECKPOINTS = "checkpoints"
RECIPE_FILE = "recipe.yaml"
EVAL_DIR = "eval"


def resolve_model_path(name_or_path: str) -> str:
    """A Hub id or directory; ``package:NAME`` is the checkpoint shipped by package NAME (``get_model_path()``)."""
    if not name_or_path.startswith("package:"):
        return name_or_path
    module_name = name_or_path.removeprefix("package:")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"model.name_or_path {name_or_path!r}: cannot import {module_name!r} ({error})") from None
    if not hasattr(module, "get_model_path"):
        raise ValueError(f"model.name_or_path {name_or_path!r}: {module_name} has no get_model_path()")
    return str(module.get_model_path())


def evolution_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for m in model.modules() if isinstance(m, AttentionMapEvolution) for p in m.parameters()]


class EvolvingAttentionTrainer(transformers.Trainer):
    """``Trainer`` with an optional separate learning rate for the added evolution parameters."""

    def __init__(self, *args: Any, ea_learning_rate: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ea_learning_rate = ea_learning_rate

    def create_optimizer(self, model: nn.Module | None = None):
        if self.ea_learning_rate is None or self.optimizer is not None:
            return super().create_optimizer(model) if model is not None else super().create_optimizer()
        model = self.model if model is None else model
        evolution = {id(p) for p in evolution_parameters(model)}
        decay_names = set(self.get_decay_parameter_names(model))
        groups: dict[str, dict[str, Any]] = {
            "decay": {"params": [], "weight_decay": self.args.weight_decay},
            "no_decay": {"params": [], "weight_decay": 0.0},
            "evolution": {"params": [], "weight_decay": 0.0, "lr": self.ea_learning_rate},
        }
        for name, parameter in model.named_parameters():
            if not parameter.requires_grad:
                continue
            group = "evolution" if id(parameter) in evolution else "decay" if name in decay_names else "no_decay"
            groups[group]["params"].append(parameter)
        optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, model)
        self.optimizer = optimizer_cls([g for g in groups.values() if g["params"]], **optimizer_kwargs)
        return self.optimizer


def training_arguments(recipe: Recipe, run_dir: Path) -> transformers.TrainingArguments:
    train = recipe.train
    return transformers.TrainingArguments(
        output_dir=str(run_dir / CHECKPOINTS),
        learning_rate=train.learning_rate,
        per_device_train_batch_size=train.batch_size,
        per_device_eval_batch_size=train.eval_batch_size or train.batch_size,
        num_train_epochs=train.epochs,
        max_steps=train.max_steps,
        # A float below 1 is a ratio of the total steps.
        warmup_steps=train.warmup_steps or train.warmup_ratio,
        lr_scheduler_type=train.lr_scheduler,
        optim="sgd" if train.optimizer == "sgd" else "adamw_torch",  # radam: see prepare()
        optim_args=f"momentum={train.momentum}" if train.optimizer == "sgd" else None,
        weight_decay=train.weight_decay,
        adam_epsilon=train.adam_epsilon,
        max_grad_norm=train.max_grad_norm,
        gradient_accumulation_steps=train.gradient_accumulation_steps,
        seed=train.seed,
        eval_strategy=train.eval_strategy,
        eval_steps=train.eval_steps,
        save_strategy=train.save_strategy,
        save_steps=train.save_steps,
        save_total_limit=train.save_total_limit,
        logging_steps=train.logging_steps,
        fp16=train.fp16,
        bf16=train.bf16,
        # Without this, processes launched by torchrun/accelerate on a machine without an accelerator would
        # each train alone on all the data instead of forming a gloo process group.
        use_cpu=not torch.accelerator.is_available(),
        # The GLUE losses are means over sequences, which DDP's gradient averaging already gets right; token
        # averaging would multiply them (and their gradients) by the number of processes (transformers#35078).
        average_tokens_across_devices=False,
        # Image batches are made from the "image" column by a transform, after Trainer would have dropped it.
        remove_unused_columns=recipe.kind != "image",
        report_to="none",
    )


#: What transformers configs call their hidden-state and attention-probability dropout (BERT and ViT
#: families; T5; BART family and DistilBERT).
DROPOUT_ATTRIBUTES = (
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "dropout_rate",
    "dropout",
    "attention_dropout",
)


def dropout_settings(config: transformers.PreTrainedConfig, dropout: float) -> dict[str, float]:
    """Config overrides that set every dropout ``config`` has for hidden states and attention to ``dropout``."""
    names = [name for name in DROPOUT_ATTRIBUTES if hasattr(config, name)]
    if not names:
        raise ValueError(
            f"model.dropout: {type(config).__name__} has none of the dropout settings {', '.join(DROPOUT_ATTRIBUTES)}; "
            "leave model.dropout unset to keep the checkpoint's"
        )
    return dict.fromkeys(names, dropout)


#: Per recipe kind: the model's auto class, its preprocessor's auto class and peft's task type.
KINDS = {
    "glue": ("AutoModelForSequenceClassification", "AutoTokenizer", "SEQ_CLS"),
    "image": ("AutoModelForImageClassification", "AutoImageProcessor", None),
    "timeseries": ("AutoModelForSequenceClassification", None, None),
}
PRETRAINED_DIR = "pretrained"


def _series_model(recipe: Recipe, label_names: tuple[str, ...] | None, data, name_or_path: str | None):
    """An EA-DC-Transformer for the task: from ``name_or_path`` (a pre-trained or fine-tuned checkpoint), or
    new from ``model.config`` and the ``ea`` settings (alpha = beta = 0 with EA off: DC-Transformer)."""
    from .dc_transformer import (
        EADCTransformerConfig,
        EADCTransformerForTimeSeriesClassification,
        EADCTransformerForTimeSeriesRegression,
    )

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


def _load_model(recipe: Recipe, label_names: tuple[str, ...] | None, adapter_dir: Path | None = None, data=None):
    """The recipe's model (patched, and wrapped in a LoRA adapter if asked) and its preprocessor.

    ``label_names`` None means a regression head with one output.
    """
    model_class, processor_class, peft_task_type = KINDS[recipe.kind]
    if recipe.kind == "timeseries":
        return _series_model(recipe, label_names, data, recipe.model.name_or_path), None
    model_path = resolve_model_path(recipe.model.name_or_path)
    config_kwargs: dict[str, Any] = {"num_labels": 1 if label_names is None else len(label_names)}
    if label_names is None:
        config_kwargs["problem_type"] = "regression"
    else:
        config_kwargs["id2label"] = dict(enumerate(label_names))
        config_kwargs["label2id"] = {name: i for i, name in enumerate(label_names)}
    common = {"revision": recipe.model.revision, "trust_remote_code": recipe.model.trust_remote_code}
    if recipe.model.dropout is not None:
        config = transformers.AutoConfig.from_pretrained(model_path, **common)
        config_kwargs |= dropout_settings(config, recipe.model.dropout)
    processor = getattr(transformers, processor_class).from_pretrained(model_path, **common)
    try:
        model = getattr(transformers, model_class).from_pretrained(
            model_path, **common, **config_kwargs, ignore_mismatched_sizes=recipe.model.ignore_mismatched_sizes
        )
    except RuntimeError as error:
        if "ignore_mismatched_sizes" not in str(error):
            raise
        raise ValueError(
            f"{recipe.model.name_or_path} has weights (usually a task head) of another size than this task "
            "needs; set model.ignore_mismatched_sizes=true to start them afresh"
        ) from error
    if recipe.ea.enabled:
        patch(model, **recipe.ea_settings())
    if recipe.peft.method == "lora":
        from .adapters import load_adapter, lora_config

        if adapter_dir is not None:
            model = load_adapter(model, adapter_dir)
        else:
            import peft

            lora = recipe.peft
            config = lora_config(
                model,
                r=lora.r,
                lora_alpha=lora.lora_alpha,
                lora_dropout=lora.dropout,
                target_modules=lora.target_modules,
                task_type=peft_task_type,
            )
            model = peft.get_peft_model(model, config)
    return model, processor


def _load_data(recipe: Recipe):
    """The recipe's splits (raw) and label names (None for regression)."""
    data = recipe.data
    if recipe.kind == "timeseries":
        from .timeseries import hold_out, load_ts_file, load_uea, series_dataset, standardise

        if data.source == "uea":
            splits = load_uea(data.archive)
        else:
            splits = {split: load_ts_file(path) for split, path in data.files.items()}
        regression = data.task == "regression"
        if data.validation_fraction:
            splits = hold_out(splits, data.validation_fraction, data.split_seed, stratify=not regression)
        loaded = series_dataset(standardise(splits), regression=regression)
        return loaded, None if regression else tuple(loaded["train"].features["label"].names)
    if recipe.kind == "image":
        splits = load_image_data(data.source, data.hub_id, data.files, data.image_column, data.label_column)
        return splits, tuple(next(iter(splits.values())).features["label"].names)
    spec = GLUE_TASKS[data.task]
    return load_glue_data(spec.name, data.source, data.hub_id or "nyu-mll/glue", data.files), spec.label_names


def _preprocess(recipe: Recipe, data, label_names: tuple[str, ...] | None, model, processor):
    """Model-ready splits, the batch collator and ``compute_metrics``."""
    if recipe.kind == "timeseries":
        from .timeseries import SeriesCollator, series_metrics_fn

        return dict(data), SeriesCollator(), series_metrics_fn(regression=label_names is None)
    if recipe.kind == "image":
        image_size = recipe.data.image_size or processor_image_size(processor)
        augmentation = {"crop_scale": tuple(recipe.data.crop_scale), "horizontal_flip": recipe.data.horizontal_flip}
        processed = {
            split: dataset.with_transform(image_transform(processor, image_size, split == "train", **augmentation))
            for split, dataset in data.items()
        }
        native_size = getattr(unwrap_model(model).config, "image_size", image_size)
        return processed, PixelCollator(image_size != native_size), image_metrics_fn(len(label_names))
    spec = GLUE_TASKS[recipe.data.task]
    processed = {split: tokenize(dataset, spec, processor, recipe.data.max_length) for split, dataset in data.items()}
    return processed, transformers.DataCollatorWithPadding(processor), compute_metrics_fn(spec.name)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (or the model itself)."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def metric_names(recipe: Recipe) -> tuple[str, ...]:
    """The metrics a recipe reports, headline first."""
    if recipe.kind == "timeseries":
        return ("rmse",) if recipe.data.task == "regression" else ("accuracy",)
    return ("accuracy", "top5_accuracy") if recipe.kind == "image" else GLUE_TASKS[recipe.data.task].metrics


def prepare(
    recipe: Recipe,
    run_dir: Path,
    callbacks: list[transformers.TrainerCallback] | None = None,
    train: bool = True,
    args: transformers.TrainingArguments | None = None,
    adapter_dir: Path | None = None,
):
    """The Trainer (model, preprocessor, processed splits) for a recipe, nothing trained yet, and its eval
    splits.

    With ``train=False`` (evaluation only) the train split is neither kept nor processed. ``adapter_dir``
    loads a trained PEFT adapter instead of creating a new one.
    """
    args = training_arguments(recipe, run_dir) if args is None else args
    # New weights (classifier head, convolutions) are part of the run: same seed, same run.
    transformers.set_seed(recipe.train.seed)
    # In a distributed run the main process fills the datasets cache first; the others then read it.
    with args.main_process_first(desc="loading and preprocessing the data"):
        data, label_names = _load_data(recipe)
        if recipe.kind == "image":
            for split in UNLABELLED_SPLITS:
                data.pop(split, None)
        if not train:
            data.pop("train", None)
        elif "train" not in data:
            raise ValueError(f"the data has no 'train' split (splits: {list(data)})")
        limits = {"train": recipe.data.max_train_samples}
        for split in data:
            limit = limits.get(split, recipe.data.max_eval_samples)
            if limit is not None and limit < len(data[split]):
                data[split] = data[split].select(range(limit))
        model, processor = _load_model(recipe, label_names, adapter_dir, data)
        processed, collator, compute_metrics = _preprocess(recipe, data, label_names, model, processor)
    eval_splits = {split: dataset for split, dataset in processed.items() if split != "train"}
    trainer = EvolvingAttentionTrainer(
        model=model,
        args=args,
        train_dataset=processed.get("train"),
        eval_dataset=eval_splits or None,
        processing_class=processor,
        data_collator=collator,
        compute_metrics=compute_metrics,
        ea_learning_rate=recipe.ea.learning_rate,
        callbacks=callbacks,
        optimizer_cls_and_kwargs=_radam(recipe) if recipe.train.optimizer == "radam" else None,
    )
    return trainer, eval_splits


def _radam(recipe: Recipe) -> tuple[type, dict[str, Any]]:
    """Rectified Adam as the paper's time-series experiments use it (betas 0.9, 0.99)."""
    train = recipe.train
    return torch.optim.RAdam, {"lr": train.learning_rate, "betas": (0.9, 0.99), "weight_decay": train.weight_decay}


def write_metrics(run_dir: Path, split: str, metrics: dict[str, Any]) -> Path:
    path = run_dir / EVAL_DIR / split / "metrics.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    return path


def evaluate_splits(trainer: transformers.Trainer, eval_splits: dict[str, Any], run_dir: Path) -> dict[str, dict]:
    results = {}
    for split, dataset in eval_splits.items():
        metrics = trainer.evaluate(eval_dataset=dataset, metric_key_prefix=split)
        results[split] = {key.removeprefix(f"{split}_"): value for key, value in metrics.items()}
        if trainer.is_world_process_zero():
            write_metrics(run_dir, split, results[split])
    return results


def run_recipe(
    recipe: Recipe, resume: bool = False, callbacks: list[transformers.TrainerCallback] | None = None
) -> dict[str, dict]:
    """Fine-tune and evaluate one recipe (no sweep); return the metrics by split.

    A run directory that already holds a run is only reused with ``resume=True``, which continues from its
    last Trainer checkpoint (or starts afresh if there is none). Launched by ``torchrun`` or
    ``accelerate launch``, every process calls this; the run is then data-parallel and only the main process
    writes files.
    """
    run_dir = Path(recipe.output_dir)
    args = training_arguments(recipe, run_dir)
    is_main = args.process_index == 0  # also sets up the process group of a distributed launch
    occupied = run_dir.exists() and any(run_dir.iterdir())
    args.distributed_state.wait_for_everyone()  # all have looked before the main one writes: they agree
    if occupied and not resume:
        raise FileExistsError(
            f"{run_dir} already holds a run; continue it with --resume (resume=True) or choose another output_dir"
        )
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / RECIPE_FILE).write_text(recipe.to_yaml())
    if recipe.kind == "timeseries" and recipe.pretrain.epochs > 0:
        recipe = pretrain_series(recipe, run_dir, args)
    trainer, eval_splits = prepare(recipe, run_dir, callbacks, args=args)
    last = transformers.trainer_utils.get_last_checkpoint(str(run_dir / CHECKPOINTS)) if resume else None
    trainer.train(resume_from_checkpoint=last)
    if recipe.peft.merge:
        results = evaluate_splits(trainer, eval_splits, run_dir)  # merging rewrites the model's modules
        if trainer.is_world_process_zero():
            trainer.model.merge_and_unload().save_pretrained(run_dir)
            trainer.processing_class.save_pretrained(run_dir)
        return results
    trainer.save_model(str(run_dir))  # the full model, or the adapter for a PEFT run
    return evaluate_splits(trainer, eval_splits, run_dir)


def pretrain_series(recipe: Recipe, run_dir: Path, args: transformers.TrainingArguments) -> Recipe:
    """Pre-train an EA-DC-Transformer by masked value reconstruction on the training split (saved in
    ``run_dir/pretrained``); return the recipe whose model starts from it."""
    import copy
    import dataclasses

    from .dc_transformer import EADCTransformerForPreTraining
    from .timeseries import SeriesCollator

    transformers.set_seed(recipe.train.seed)
    data, label_names = _load_data(recipe)
    config = _series_model(recipe, label_names, data, None).config
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
        optimizer_cls_and_kwargs=_radam(phase) if phase.train.optimizer == "radam" else None,
    )
    trainer.train()
    trainer.save_model(str(run_dir / PRETRAINED_DIR))
    finetune = copy.deepcopy(recipe)
    finetune.model.name_or_path = str(run_dir / PRETRAINED_DIR)
    return finetune


def read_run_recipe(run_dir: str | Path) -> Recipe:
    import yaml

    path = Path(run_dir) / RECIPE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no {RECIPE_FILE})")
    return recipe_from_dict(yaml.safe_load(path.read_text()))


def evaluate_run(run_dir: str | Path) -> dict[str, dict]:
    """Re-evaluate the final model of a run on its evaluation splits (rewrites eval/<split>/metrics.json)."""
    run_dir = Path(run_dir)
    recipe = read_run_recipe(run_dir)
    if (run_dir / "adapter_config.json").is_file():
        # A PEFT run saved its adapter: rebuild the base as the run did, then load the adapter onto it.
        trainer, eval_splits = prepare(recipe, run_dir, train=False, adapter_dir=run_dir)
        return evaluate_splits(trainer, eval_splits, run_dir)
    recipe.model.name_or_path = str(run_dir)
    recipe.ea.enabled = False  # the saved model is already what it is: EA or baseline
    recipe.peft.method = None
    trainer, eval_splits = prepare(recipe, run_dir, train=False)
    return evaluate_splits(trainer, eval_splits, run_dir)


def read_metrics(run_dir: str | Path) -> dict[str, dict]:
    root = Path(run_dir) / EVAL_DIR
    return {path.parent.name: json.loads(path.read_text()) for path in sorted(root.glob("*/metrics.json"))}


def describe_evolution(settings: EvolvingAttentionSettings) -> str:
    """A short label for a comparison table: ``a=0.2 b=0.2 k=3`` (``residual a=0.2``, ``echo S=2 scalar``)."""
    if settings.method == "echo":
        return f"echo S={settings.echoes} {settings.echo_state}"
    if settings.method == "residual":
        return f"residual a={settings.alpha:g}"
    return f"a={settings.alpha:g} b={settings.beta:g} k={settings.kernel_size}"


def compare_runs(run_dirs: list[str | Path]) -> str:
    """A table of runs side by side: task, EA settings and the task's metrics for every evaluated split."""
    rows = []
    for run_dir in run_dirs:
        recipe = read_run_recipe(run_dir)
        names = metric_names(recipe)
        task = "image" if recipe.kind == "image" else recipe.data.task
        ea = describe_evolution(recipe.evolution()) if recipe.ea.enabled else "off"
        for split, metrics in read_metrics(run_dir).items():
            scores = " ".join(f"{name}={metrics[name]:.4f}" for name in names if name in metrics)
            rows.append((str(run_dir), task, ea, split, scores))
    if not rows:
        return "no evaluated runs"
    header = ("run", "task", "ea", "split", "metrics")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in [header, *rows]]
    return "\n".join(lines)

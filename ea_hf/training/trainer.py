"""Running a recipe: load the checkpoint, patch it (or not, for the baseline), fine-tune with ``Trainer``,
evaluate every split and save everything into the run directory (see ``run_dir.py``). What differs between
tasks comes from the recipe's task kind (``task_kind.py``).
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from accelerate import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch import nn
from transformers.trainer_utils import EvalLoopOutput, EvalPrediction

from ..modeling.evolution import AttentionMapEvolution
from .models import load_model, optimizer_override
from .ramp import EvolutionRamp
from .recipe import Recipe
from .run_dir import (
    ADAPTER_CONFIG,
    CHECKPOINTS,
    RECIPE_FILE,
    disk_full_error,
    last_complete_checkpoint,
    read_run_recipe,
    write_evaluation,
)


def threads_note(threads: int, load: float | None, cores: int | None) -> str:
    """What the progress bar of training says before the bar: the threads torch computes with and, where the
    system reports them, the load average of the last minute and the cores. A load above the cores means other
    processes share them, and a run takes about load / cores times as long as on an idle machine.

    Example:
        >>> threads_note(2, 7.93, 2)
        '2 threads, load 7.9 on 2 cores'
        >>> threads_note(4, None, None)
        '4 threads'
    """
    note = f"{threads} thread{'s' if threads != 1 else ''}"
    return note if load is None or cores is None else f"{note}, load {load:.1f} on {cores} cores"


def current_threads_note() -> str:
    """:func:`threads_note` of this process and machine now."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not on Windows, nor where the system does not report it
        load = None
    return threads_note(torch.get_num_threads(), load, os.cpu_count())


class ProgressWithThreads(transformers.ProgressCallback):
    """Trainer's progress bar, described by :func:`current_threads_note`: on a shared machine a run slows down by
    as much as other processes take of the cores, and the bar shows it."""

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        if self.training_bar is not None:
            self.training_bar.set_description(current_threads_note(), refresh=False)

    def on_step_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            self.training_bar.set_description(current_threads_note(), refresh=False)  # shown as the bar moves
        super().on_step_end(args, state, control, **kwargs)


def evolution_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for m in model.modules() if isinstance(m, AttentionMapEvolution) for p in m.parameters()]


def gate_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The learned gates (``alpha_gate``, ``beta_gate``) of the evolution modules (``gates: learned``)."""
    modules = [m for m in model.modules() if isinstance(m, AttentionMapEvolution) and m.learned_gates]
    return [p for m in modules for p in (m.alpha_gate, m.beta_gate) if p is not None]


class EvolvingAttentionTrainer(transformers.Trainer):
    """``Trainer`` with optional separate learning rates for the added evolution parameters and for the learned gates
    among them (``gates_learning_rate``; None: the evolution parameters' rate), and an evaluation
    loss that is the mean over the split's examples (``example_losses``, see ``TaskKind.example_losses``).

    Trainer's own evaluation loss is the mean of each batch's mean loss. In a distributed run the processes'
    last batches are filled up with examples from the start of the split (accelerate's ``even_batches``), which
    enter those batches' means, so the loss moves with the number of processes and the batch size. Each example's
    loss is instead taken before the processes' predictions are gathered, where the fill-ups are dropped, and
    summed over the split: one process and several give the same loss, at any batch size.
    """

    def __init__(
        self,
        *args: Any,
        ea_learning_rate: float | None = None,
        gates_learning_rate: float | None = None,
        per_example_scores: Callable[[Any], Any] | None = None,
        example_losses: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> None:
        if example_losses is not None:
            metrics, reduce = kwargs.get("compute_metrics"), kwargs.get("preprocess_logits_for_metrics")
            kwargs["compute_metrics"] = functools.partial(_metrics_and_loss, metrics)
            kwargs["preprocess_logits_for_metrics"] = functools.partial(_with_example_losses, reduce, example_losses)
        super().__init__(*args, **kwargs)
        self.ea_learning_rate = ea_learning_rate
        self.gates_learning_rate = gates_learning_rate
        self.per_example_scores = per_example_scores
        self.example_losses = example_losses

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> EvalLoopOutput:
        output = super().evaluation_loop(*args, **kwargs)
        if self.example_losses is None or output.predictions is None:
            return output
        return output._replace(predictions=output.predictions[0])  # the kind's predictions, without the losses

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        state = self.accelerator.state
        if self.args.fsdp_plugin_args is not None and state.distributed_type == DistributedType.MULTI_CPU:
            # accelerate only shards on accelerators and otherwise falls back to DDP without a word; FSDP2 runs
            # on CPU processes over gloo (torch tests it so), which is what a CPU launch that asked for it gets.
            # The process state too: every AcceleratorState() built later copies its distributed type.
            PartialState().distributed_type = state.distributed_type = DistributedType.FSDP
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            self.is_fsdp_enabled = True

    def create_optimizer(self, model: nn.Module | None = None):
        if (self.ea_learning_rate is None and self.gates_learning_rate is None) or self.optimizer is not None:
            return super().create_optimizer(model) if model is not None else super().create_optimizer()
        model = self.model if model is None else model
        evolution = {id(p) for p in evolution_parameters(model)}
        gates = {id(p) for p in gate_parameters(model)} if self.gates_learning_rate is not None else set()
        evolution_rate = self.args.learning_rate if self.ea_learning_rate is None else self.ea_learning_rate
        decay_names = set(self.get_decay_parameter_names(model))
        groups: dict[str, dict[str, Any]] = {
            "decay": {"params": [], "weight_decay": self.args.weight_decay},
            "no_decay": {"params": [], "weight_decay": 0.0},
            "evolution": {"params": [], "weight_decay": 0.0, "lr": evolution_rate},
            "gates": {"params": [], "weight_decay": 0.0, "lr": self.gates_learning_rate},
        }
        for name, parameter in model.named_parameters():
            if not parameter.requires_grad:
                continue
            group = "gates" if id(parameter) in gates else "evolution" if id(parameter) in evolution else None
            group = group or ("decay" if name in decay_names else "no_decay")
            groups[group]["params"].append(parameter)
        optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, model)
        self.optimizer = optimizer_cls([g for g in groups.values() if g["params"]], **optimizer_kwargs)
        return self.optimizer


def _with_example_losses(reduce, example_losses, logits, labels) -> tuple[Any, torch.Tensor]:
    """Trainer's ``preprocess_logits_for_metrics`` of :class:`EvolvingAttentionTrainer`: (what the kind keeps of
    the logits, each example's summed loss and count)."""
    losses = example_losses(logits, labels)
    if reduce is example_losses:  # the kind keeps just these (a language model's token losses)
        return losses, losses
    return (logits if reduce is None else reduce(logits, labels)), losses


def _metrics_and_loss(compute_metrics, prediction: EvalPrediction) -> dict[str, float]:
    """The kind's metrics, and ``loss``: the split's summed example losses over their count (in float64), which
    takes the place of Trainer's own."""
    predictions, losses = prediction.predictions
    metrics = {} if compute_metrics is None else compute_metrics(EvalPrediction(predictions, prediction.label_ids))
    totals = np.asarray(losses, dtype=np.float64).reshape(-1, 2).sum(0)
    return {**metrics, "loss": float(totals[0] / max(totals[1], 1.0))}


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
        optim="sgd" if train.optimizer == "sgd" else "adamw_torch",  # radam: see optimizer_override
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
        # FSDP2, its units the model's _no_split_modules and the saved model gathered whole (the defaults).
        fsdp=train.fsdp,
        fsdp_config={"version": 2} if train.fsdp else None,
        # Without this, processes launched by torchrun/accelerate on a machine without an accelerator would
        # each train alone on all the data instead of forming a gloo process group.
        use_cpu=not torch.accelerator.is_available(),
        # The GLUE losses are means over sequences, which DDP's gradient averaging already gets right; token
        # averaging would multiply them (and their gradients) by the number of processes (transformers#35078).
        average_tokens_across_devices=False,
        remove_unused_columns=recipe.task_kind.remove_unused_columns,
        report_to="none",
    )


def prepare(
    recipe: Recipe,
    run_dir: Path,
    callbacks: list[transformers.TrainerCallback] | None = None,
    train: bool = True,
    args: transformers.TrainingArguments | None = None,
    adapter_dir: Path | None = None,
    eval_splits: Sequence[str] | None = None,
):
    """The Trainer (model, preprocessor, processed splits) for a recipe, nothing trained yet, and its eval
    splits.

    With ``train=False`` (evaluation only) the train split is neither kept nor processed. ``adapter_dir``
    loads a trained PEFT adapter instead of creating a new one. ``eval_splits``: the only splits evaluated
    (during training too; None: every split but train), an error where the data has one of them not.
    """
    args = training_arguments(recipe, run_dir) if args is None else args
    # New weights (classifier head, convolutions) are part of the run: same seed, same run.
    transformers.set_seed(recipe.train.seed)
    # In a distributed run the main process fills the datasets cache first; the others then read it.
    kind = recipe.task_kind
    with args.main_process_first(desc="loading and preprocessing the data"):
        data, label_names = kind.load_data(recipe)
        missing = [split for split in eval_splits or () if split == "train" or split not in data]
        if missing:
            raise ValueError(f"the data has no {missing[0]!r} split to evaluate (splits: {list(data)})")
        for split in [split for split in data if eval_splits is not None and split not in ("train", *eval_splits)]:
            del data[split]
        if not train:
            data.pop("train", None)
        elif "train" not in data:
            raise ValueError(f"the data has no 'train' split (splits: {list(data)})")
        limits = {"train": recipe.data.max_train_samples}
        for split in data:
            limit = limits.get(split, recipe.data.max_eval_samples)
            if limit is not None and limit < len(data[split]):
                data[split] = data[split].select(range(limit))
        model, processor = load_model(recipe, label_names, data, adapter_dir)
        prepared = kind.preprocess(recipe, data, label_names, model, processor)
    processed = prepared.splits
    if recipe.ea.enabled and recipe.ea.ramp_ratio > 0 and train:
        # First, so that the callbacks given see the values the ramp sets for each step.
        callbacks = [EvolutionRamp(model, recipe.ea.ramp_ratio), *(callbacks or [])]
    eval_splits = {split: dataset for split, dataset in processed.items() if split != "train"}
    trainer = EvolvingAttentionTrainer(
        model=model,
        args=args,
        train_dataset=processed.get("train"),
        eval_dataset=eval_splits or None,
        processing_class=processor,
        data_collator=prepared.collator,
        compute_metrics=prepared.compute_metrics,
        preprocess_logits_for_metrics=prepared.preprocess_logits,
        ea_learning_rate=recipe.ea.learning_rate,
        gates_learning_rate=recipe.ea.gates_learning_rate,
        per_example_scores=prepared.per_example_scores,
        example_losses=kind.example_losses(recipe, model.config),
        callbacks=callbacks,
        optimizer_cls_and_kwargs=optimizer_override(recipe),
    )
    if trainer.pop_callback(transformers.ProgressCallback) is not None:  # not in notebooks, nor with disable_tqdm
        trainer.add_callback(ProgressWithThreads)
    return trainer, eval_splits


def evaluate_splits(trainer: transformers.Trainer, eval_splits: dict[str, Any], run_dir: Path) -> dict[str, dict]:
    """Evaluate every split; write their metrics and, where the task kind has them, per-example scores, all at
    once when the last split is done (see :func:`~.run_dir.write_evaluation`)."""
    results, scores_by_split = {}, {}
    per_example = getattr(trainer, "per_example_scores", None)
    for split, dataset in eval_splits.items():
        if per_example is None:
            metrics, scores = trainer.evaluate(eval_dataset=dataset, metric_key_prefix=split), None
        else:  # the predictions as well as the metrics, in one pass
            output = trainer.predict(dataset, metric_key_prefix=split)
            metrics, scores = output.metrics, per_example(output)
            if trainer.state.epoch is not None:  # as evaluate's metrics have it
                metrics["epoch"] = trainer.state.epoch
        results[split] = {key.removeprefix(f"{split}_"): value for key, value in metrics.items()}
        if scores is not None:
            scores_by_split[split] = scores
    if trainer.is_world_process_zero():
        write_evaluation(run_dir, results, scores_by_split)
    return results


def run_recipe(
    recipe: Recipe,
    resume: bool = False,
    callbacks: list[transformers.TrainerCallback] | None = None,
    eval_splits: Sequence[str] | None = None,
) -> dict[str, dict]:
    """Fine-tune and evaluate one recipe (no sweep); return the metrics by split (``eval_splits``: only these).

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
    existed = run_dir.exists()
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / RECIPE_FILE).write_text(recipe.to_yaml())
    try:
        recipe = recipe.task_kind.before_training(recipe, run_dir, args)
        trainer, evaluated = prepare(recipe, run_dir, callbacks, args=args, eval_splits=eval_splits)
    except BaseException:
        # Bad data or a model that does not load: a run that never started leaves no directory that a rerun
        # would take for a run to --resume.
        if is_main and not occupied:
            _remove_run(run_dir, keep_folder=existed)
        raise
    try:
        return _train_save_evaluate(trainer, evaluated, recipe, run_dir, resume)
    except Exception as error:
        # A full disk: one error that says so and where to resume from, whatever the library that hit it said.
        full = disk_full_error(error, run_dir)
        if full is None:
            raise
        raise full from error


def _train_save_evaluate(trainer, eval_splits: dict[str, Any], recipe: Recipe, run_dir: Path, resume: bool):
    last = last_complete_checkpoint(run_dir) if resume else None
    trainer.train(resume_from_checkpoint=last)
    if recipe.peft.merge:
        results = evaluate_splits(trainer, eval_splits, run_dir)  # merging rewrites the model's modules
        if trainer.is_world_process_zero():
            trainer.model.merge_and_unload().save_pretrained(run_dir)
            trainer.processing_class.save_pretrained(run_dir)
        return results
    trainer.save_model(str(run_dir))  # the full model, or the adapter for a PEFT run
    return evaluate_splits(trainer, eval_splits, run_dir)


def _remove_run(run_dir: Path, keep_folder: bool) -> None:
    if not keep_folder:
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    for entry in run_dir.iterdir():
        shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)


def evaluate_run(run_dir: str | Path, splits: Sequence[str] | None = None) -> dict[str, dict]:
    """Re-evaluate the final model of a run on its evaluation splits (``splits``: only these), rewriting their
    eval/<split>/metrics.json."""
    run_dir = Path(run_dir)
    recipe = read_run_recipe(run_dir)
    if (run_dir / ADAPTER_CONFIG).is_file():
        # A PEFT run saved its adapter: rebuild the base as the run did, then load the adapter onto it.
        trainer, eval_splits = prepare(recipe, run_dir, train=False, adapter_dir=run_dir, eval_splits=splits)
        return evaluate_splits(trainer, eval_splits, run_dir)
    recipe.model.name_or_path = str(run_dir)
    recipe.model.gguf_file = None  # the run saved an ordinary checkpoint
    recipe.ea.enabled = False  # the saved model is already what it is: EA or baseline
    recipe.peft.method = None
    trainer, eval_splits = prepare(recipe, run_dir, train=False, eval_splits=splits)
    return evaluate_splits(trainer, eval_splits, run_dir)

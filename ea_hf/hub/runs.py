"""Publishing runs: the model card of a run directory (``ea-hf card``, no network) and its upload with the
card (``ea-hf push``). What the card says about the task comes from the run's task kind.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import transformers
import yaml
from huggingface_hub import CommitInfo, ModelCard

from ..training.models import evolution_settings, resolve_model_path
from ..training.recipe import Recipe
from ..training.run_dir import ADAPTER_CONFIG, check_finished, read_metrics, read_run_recipe
from ..training.selection import selection_sentence
from .cards import (
    Origin,
    TaskResults,
    auto_class_of,
    checkpoint_origin,
    evolution_parameters_in,
    parameters_in,
    remote_class_of,
    render_card,
    stored_settings,
)
from .upload import publishable_files, upload


def _origin(name_or_path: str | None, revision: str | None = None) -> Origin:
    """:func:`checkpoint_origin` of a recipe's checkpoint (``package:NAME`` read from the package's folder)."""
    if not name_or_path:
        return Origin()
    try:
        folder = resolve_model_path(name_or_path)
    except ValueError:  # a package not installed here: its origin is unknown
        folder = None
    return checkpoint_origin(name_or_path, folder, revision)


def _base_model_text(name_or_path: str | None, architecture: str) -> str:
    """How the card's text names a base model that has no Hub id (never by a local path)."""
    if not name_or_path:
        return f"a new {architecture} model (built from its config, not from a pretrained checkpoint)"
    if name_or_path.startswith("package:"):
        return f"the checkpoint that the Python package `{name_or_path.removeprefix('package:')}` ships"
    return "a local checkpoint"


def _recipe_yaml(recipe: Recipe) -> tuple[str, str | None]:
    """The recipe as the card shows it, and the note that says what was changed: ``package:NAME`` checkpoints
    (the model, a tokenizer) named by their Hub id where their files tell it, and absolute local paths (data
    files, the run directory, a local checkpoint) by their last component: a published card says what the
    files were, not where they sat on the machine that trained it."""
    replaced, shortened = [], []

    def public(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: public(item) for key, item in value.items()}
        if isinstance(value, list):
            return [public(item) for item in value]
        if isinstance(value, str) and value.startswith("package:"):
            hub_id = _origin(value).hub_id
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


def run_card(run_dir: str | Path, repo_id: str | None = None, license: Mapping[str, str] | None = None) -> ModelCard:
    """The model card of a run directory (``ea-hf card``), rendered locally from its files.

    The settings are those of the saved model's config; a PEFT run saves no config, so its settings are those
    ``ea_hf.patch`` gives the recipe's base model (the model the adapter loads onto), computed without weights.
    The base model (``base_model``) and its license come from the recipe's checkpoint
    (:func:`~ea_hf.hub.cards.checkpoint_origin`); ``license`` (``{"license": "mit"}``, or ``license: other``
    with ``license_name`` and ``license_link``) states the license where the checkpoint does not, or another.
    """
    run_dir = check_finished(run_dir)
    recipe = read_run_recipe(run_dir)
    kind = recipe.task_kind
    recipe_yaml, note = _recipe_yaml(recipe)
    metrics = read_metrics(run_dir)
    task = TaskResults(
        kind.card_info(recipe), recipe_yaml, metrics, kind.metric_names(recipe), note, selection_sentence(run_dir)
    )
    origin = _origin(recipe.model.name_or_path, recipe.model.revision)
    common = {"repo_id": repo_id or recipe.name, "task": task, "base_model": origin.hub_id}
    common["license"] = dict(license) if license else origin.license
    common["from_scratch"] = not recipe.model.name_or_path
    common["added_parameters"] = evolution_parameters_in(run_dir)
    if (run_dir / ADAPTER_CONFIG).is_file():
        return render_card(
            settings=evolution_settings(recipe),
            architecture="base model's",
            auto_class=kind.auto_class,
            adapter=True,
            base_model_text=_base_model_text(recipe.model.name_or_path, "transformers"),
            **common,
        )
    config = transformers.AutoConfig.from_pretrained(run_dir)
    saved = config.to_dict()
    architecture = (saved.get("architectures") or [saved.get("model_type", "")])[0]
    details = kind.model_details(saved, recipe)
    if details:
        details = (*details, ("parameters", f"{parameters_in(run_dir):,}"))
    return render_card(
        settings=stored_settings(config),
        architecture=architecture,
        auto_class=auto_class_of(saved),
        model_details=details,
        remote_class=remote_class_of(saved),
        base_model_text=_base_model_text(recipe.model.name_or_path, architecture),
        **common,
    )


def push_run(
    run_dir: str | Path,
    repo_id: str,
    *,
    private: bool | None = None,
    revision: str | None = None,
    endpoint: str | None = None,
    token: str | bool | None = None,
    commit_message: str | None = None,
    license: Mapping[str, str] | None = None,
) -> CommitInfo:
    """Upload a run directory: its final model (or adapter), tokenizer or image processor, modeling files,
    the resolved recipe and a generated README.md model card (``license`` as :func:`run_card` takes it).
    Checkpoints and metrics files stay local (the metrics are in the card)."""
    run_dir = check_finished(run_dir)
    card = run_card(run_dir, repo_id, license)
    files: dict[str, Path | bytes] = {**publishable_files(run_dir), "README.md": str(card).encode()}
    message = commit_message or f"Upload {run_dir.name} (ea-hf push)"
    return upload(
        files, repo_id, private=private, revision=revision, endpoint=endpoint, token=token, commit_message=message
    )

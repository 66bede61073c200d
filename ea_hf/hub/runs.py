"""Publishing runs: the model card of a run directory (``ea-hf card``, no network) and its upload with the
card (``ea-hf push``). What the card says about the task comes from the run's task kind.
"""

from __future__ import annotations

from pathlib import Path

import transformers
from huggingface_hub import CommitInfo, ModelCard

from ..training.models import evolution_settings
from ..training.run_dir import ADAPTER_CONFIG, check_finished, read_metrics, read_run_recipe
from .cards import (
    TaskResults,
    auto_class_of,
    evolution_parameters_in,
    parameters_in,
    remote_class_of,
    render_card,
    stored_settings,
)
from .upload import publishable_files, upload


def run_card(run_dir: str | Path, repo_id: str | None = None) -> ModelCard:
    """The model card of a run directory (``ea-hf card``), rendered locally from its files.

    The settings are those of the saved model's config; a PEFT run saves no config, so its settings are those
    ``ea_hf.patch`` gives the recipe's base model (the model the adapter loads onto), computed without weights.
    """
    run_dir = check_finished(run_dir)
    recipe = read_run_recipe(run_dir)
    kind = recipe.task_kind
    task = TaskResults(kind.card_info(recipe), recipe.to_yaml(), read_metrics(run_dir), kind.metric_names(recipe))
    common = {"repo_id": repo_id or recipe.name, "task": task, "base_model": recipe.model.name_or_path}
    common["added_parameters"] = evolution_parameters_in(run_dir)
    if (run_dir / ADAPTER_CONFIG).is_file():
        return render_card(
            settings=evolution_settings(recipe),
            architecture="base model's",
            auto_class=kind.auto_class,
            adapter=True,
            **common,
        )
    config = transformers.AutoConfig.from_pretrained(run_dir)
    saved = config.to_dict()
    details = kind.model_details(saved, recipe)
    if details:
        details = (*details, ("parameters", f"{parameters_in(run_dir):,}"))
    return render_card(
        settings=stored_settings(config),
        architecture=(saved.get("architectures") or [saved.get("model_type", "")])[0],
        auto_class=auto_class_of(saved),
        model_details=details,
        remote_class=remote_class_of(saved),
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
) -> CommitInfo:
    """Upload a run directory: its final model (or adapter), tokenizer or image processor, modeling files,
    the resolved recipe and a generated README.md model card. Checkpoints and metrics files stay local (the
    metrics are in the card)."""
    run_dir = check_finished(run_dir)
    card = run_card(run_dir, repo_id)
    files: dict[str, Path | bytes] = {**publishable_files(run_dir), "README.md": str(card).encode()}
    message = commit_message or f"Upload {run_dir.name} (ea-hf push)"
    return upload(
        files, repo_id, private=private, revision=revision, endpoint=endpoint, token=token, commit_message=message
    )

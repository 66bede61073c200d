"""Publishing runs: the model card of a run directory (``ea-hf card``, no network) and its upload with the
card (``ea-hf push``). The run is read once (:func:`~ea_hf.hub.run_record.read_run`) and its card rendered from
that record (:func:`~ea_hf.hub.cards.render_card`); what the card says about the task comes from the run's task
kind.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from huggingface_hub import CommitInfo, ModelCard

from .cards import render_card
from .run_record import read_run
from .upload import publishable_files, upload


def run_card(run_dir: str | Path, repo_id: str | None = None, license: Mapping[str, str] | None = None) -> ModelCard:
    """The model card of a run directory (``ea-hf card``), rendered locally from its files, each read once
    (``repo_id`` and ``license`` as :func:`~ea_hf.hub.cards.render_card` takes them)."""
    return render_card(read_run(run_dir), repo_id, license)


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
    record = read_run(run_dir)
    card = render_card(record, repo_id, license)
    files: dict[str, Path | bytes] = {**publishable_files(record.folder), "README.md": str(card).encode()}
    message = commit_message or f"Upload {record.folder.name} (ea-hf push)"
    return upload(
        files, repo_id, private=private, revision=revision, endpoint=endpoint, token=token, commit_message=message
    )

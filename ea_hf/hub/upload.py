"""Uploads to the Hugging Face Hub: one commit of a model's files (creating the repository and branch where
needed), ``push_to_hub`` of EA models with their card (:func:`push_model`), and one :class:`HubError` line
for every way an upload fails. The token and endpoint come from the usual places (``HF_TOKEN``,
``hf auth login``, ``HF_ENDPOINT``) unless given; local files are only ever read.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import transformers
from huggingface_hub import CommitInfo, CommitOperationAdd, HfApi
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

from .cards import model_card

#: Parts of a run directory that are not part of the published model (README.md is generated).
NOT_PUBLISHED = ("checkpoints", "eval", "training_args.bin", "README.md")

try:  # huggingface_hub 2.x talks through httpx2, 1.x through httpx
    from httpx2 import TransportError
except ImportError:  # pragma: no cover
    from httpx import TransportError


class HubError(OSError):
    """An upload to the Hub that failed; the message says why. Local files are never changed."""


def publishable_files(folder: Path) -> dict[str, Path]:
    """The files of a run (or save) directory that make up the published model, by path in the repository."""
    files = {}
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if path.is_file() and relative.parts[0] not in NOT_PUBLISHED and not relative.parts[0].startswith("."):
            files[relative.as_posix()] = path
    return files


def _hub_error(error: BaseException, where: str, endpoint: str) -> HubError | None:
    """The :class:`HubError` for an upload failure, looking through the wrappers huggingface_hub adds (an LFS
    upload failure arrives as a RuntimeError caused by the HTTP error); None if it is not a Hub failure."""
    while error is not None and not isinstance(error, (HfHubHTTPError, TransportError, OfflineModeIsEnabled)):
        error = error.__cause__
    if isinstance(error, OfflineModeIsEnabled):
        return HubError("HF_HUB_OFFLINE is set; unset it to upload")
    if isinstance(error, TransportError):
        return HubError(f"cannot reach the Hub at {endpoint} ({type(error).__name__}: {error})")
    if error is None:
        return None
    status = error.response.status_code if error.response is not None else None
    if status in (401, 403):
        return HubError(
            f"the Hub refused the token for {where} (HTTP {status}): set HF_TOKEN or run `hf auth login` "
            "with a token that may write there"
        )
    detail = error.server_message or str(error).splitlines()[0]
    return HubError(f"uploading to {where} failed (HTTP {status}): {detail}")


def upload(
    files: Mapping[str, Path | bytes],
    repo_id: str,
    *,
    private: bool | None = None,
    revision: str | None = None,
    endpoint: str | None = None,
    token: str | bool | None = None,
    commit_message: str = "Upload evolving attention model",
    commit_description: str | None = None,
    create_pr: bool = False,
) -> CommitInfo:
    """Create the repository (and branch) if needed and commit ``files`` in one commit.

    Files the repository already has with the same content are skipped by huggingface_hub, so pushing the
    same files again changes nothing. Raises :class:`HubError` naming the cause.
    """
    api = HfApi(endpoint=endpoint, token=token)
    where = f"{repo_id} at {api.endpoint}"
    try:
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        if revision is not None:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        operations = [
            CommitOperationAdd(
                path_in_repo=path, path_or_fileobj=content if isinstance(content, bytes) else str(content)
            )
            for path, content in files.items()
        ]
        return api.create_commit(
            repo_id,
            operations,
            commit_message=commit_message,
            commit_description=commit_description,
            revision=revision,
            create_pr=create_pr,
        )
    except (HfHubHTTPError, TransportError, OfflineModeIsEnabled, RuntimeError) as error:
        reason = _hub_error(error, where, api.endpoint)
        if reason is None:
            raise
        raise reason from None


def save_preprocessor(source: str, folder: Path) -> str | None:
    """Save the tokenizer or image processor that ``source`` (a Hub id or directory) has into ``folder``;
    the class name, or None if it has none."""
    for loader in (transformers.AutoTokenizer, transformers.AutoImageProcessor):
        try:
            preprocessor = loader.from_pretrained(source)
        except (OSError, ValueError, KeyError):
            continue
        preprocessor.save_pretrained(folder)
        return type(preprocessor).__name__
    return None


def push_model(
    model: Any,
    repo_id: str,
    *,
    commit_message: str | None = None,
    commit_description: str | None = None,
    private: bool | None = None,
    token: str | bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    max_shard_size: int | str | None = "50GB",
    tags: list[str] | None = None,
    endpoint: str | None = None,
) -> CommitInfo:
    """``push_to_hub`` of EA models: the saved model (config with its EA settings and ``auto_map``,
    safetensors, modeling files), the tokenizer or image processor of the checkpoint it was loaded from when
    there is one, and the EA model card."""
    card = model_card(model, repo_id)
    if tags:
        card.data.tags = [*card.data.tags, *tags]
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder, max_shard_size=max_shard_size)
        if getattr(model, "name_or_path", None):
            save_preprocessor(model.name_or_path, Path(folder))
        files: dict[str, Path | bytes] = {**publishable_files(Path(folder)), "README.md": str(card).encode()}
        return upload(
            files,
            repo_id,
            private=private,
            revision=revision,
            endpoint=endpoint,
            token=token,
            commit_message=commit_message or "Upload evolving attention model",
            commit_description=commit_description,
            create_pr=create_pr,
        )

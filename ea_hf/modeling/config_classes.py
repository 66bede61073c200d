"""EA config classes: one subclass per supported transformers config class, made on demand
(``BertConfig`` -> ``EABertConfig``, ``model_type="ea-bert"``), holding the settings under ``evolving_attention``.

This file is copied beside the weights of saved EA checkpoints (``trust_remote_code``): it imports only torch,
transformers and sibling files (single-dot relative imports).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import transformers
from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

from .settings import CONFIG_ATTRIBUTE

EA_PREFIX = "EA"
_class_lock = threading.RLock()
_config_classes: dict[type, type] = {}


def ea_model_type(base_model_type: str) -> str:
    return f"ea-{base_model_type}"


def cached_ea_class(base: type, cache: dict[type, type], build: Callable[[str], type]) -> type:
    """Return ``cache[base]``, building the EA class ``EA<base>`` once (thread-safe); EA classes map to themselves."""
    if getattr(base, "evolving_attention_base", None) is not None:
        return base
    with _class_lock:
        if base not in cache:
            cache[base] = build(EA_PREFIX + base.__name__)
        return cache[base]


def evolving_attention_config_class(base: type[PreTrainedConfig]) -> type[PreTrainedConfig]:
    """The EA config class for a transformers config class (``BertConfig`` -> ``EABertConfig``).

    The subclass adds the ``evolving_attention`` field and a distinct ``model_type`` (``ea-bert``);
    everything else is the base config.

    Args:
        base: a transformers config class; an EA config class is returned as it is.

    Returns:
        The EA config class, built once per base class and shared after that.

    Example:
        >>> from transformers import BertConfig
        >>> evolving_attention_config_class(BertConfig).model_type
        'ea-bert'
    """

    def build(name: str) -> type[PreTrainedConfig]:
        namespace = {
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"{base.__name__} with Evolving Attention settings (``{CONFIG_ATTRIBUTE}``).",
            "__annotations__": {CONFIG_ATTRIBUTE: dict | None},
            CONFIG_ATTRIBUTE: None,
            "model_type": ea_model_type(base.model_type),
            "evolving_attention_base": base,
        }
        cls = strict(type(name, (base,), namespace))
        cls._auto_class = "AutoConfig"
        return cls

    return cached_ea_class(base, _config_classes, build)


def _transformers_class(ea_name: str, base_type: type) -> type | None:
    """Resolve ``EA<Name>`` to the transformers class ``<Name>`` if it is a subclass of ``base_type``."""
    if not ea_name.startswith(EA_PREFIX):
        return None
    try:
        base = getattr(transformers, ea_name[len(EA_PREFIX) :])
    except (AttributeError, ImportError):
        return None
    return base if isinstance(base, type) and issubclass(base, base_type) else None


def __getattr__(name: str) -> Any:
    # Lets ``auto_map`` entries such as "configuration.EABertConfig" resolve without building every class.
    base = _transformers_class(name, PreTrainedConfig)
    if base is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return evolving_attention_config_class(base)

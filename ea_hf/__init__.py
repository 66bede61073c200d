"""ea_hf: Evolving Attention for Hugging Face Transformers.

>>> import ea_hf
>>> from transformers import BertConfig, BertForSequenceClassification
>>> model = BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=2,
...                                                  num_attention_heads=4, intermediate_size=37))
>>> model = ea_hf.patch(model, alpha=0.2, beta=0.2)
>>> ea_hf.summary(model).added_parameters
296

The package is layered (see docs/how-it-works.md): ``modeling`` (the core, copied beside checkpoints),
``ops`` and ``integrations``, ``training``, ``hub``, ``cli``; each imports only from the layers below it. The
registrations that connect them run as ``ea_hf`` is imported (:func:`register_extensions`): the EA Auto classes,
so that ``transformers.AutoModel*.from_pretrained`` loads EA checkpoints after ``import ea_hf``, the fused
kernels (``ea_hf.ops`` registers them as it is imported) and ``push_to_hub`` with model cards. The public names
are imported when first used (PEP 562).

The one exception is the ``ea-hf`` command (``ea_hf_cli``, outside this package): it parses its arguments, and
answers ``--help`` and ``--version``, without torch or transformers, and registers when a command runs.
"""

import sys
import warnings
from typing import TYPE_CHECKING, Any

from .lazy import lazy_attribute

if TYPE_CHECKING:  # what _PUBLIC imports on first use, for type checkers and documentation tools
    from .modeling import (
        ARCHITECTURES,
        ATTENTION_IMPLEMENTATION,
        AttentionMapEvolution,
        EvolvingAttentionSettings,
        PatchSummary,
        evolving_attention_config_class,
        evolving_attention_forward,
        evolving_attention_model_class,
        is_patched,
        patch,
        register_auto_classes,
        summary,
        supported_model_types,
        unpatch,
    )
    from .visualization import plot_attention

__version__ = "0.2.0"

#: Where each public name lives (imported on first use).
_PUBLIC = {
    "ARCHITECTURES": ".modeling",
    "ATTENTION_IMPLEMENTATION": ".modeling",
    "AttentionMapEvolution": ".modeling",
    "EvolvingAttentionSettings": ".modeling",
    "PatchSummary": ".modeling",
    "evolving_attention_config_class": ".modeling",
    "evolving_attention_forward": ".modeling",
    "evolving_attention_model_class": ".modeling",
    "is_patched": ".modeling",
    "patch": ".modeling",
    "register_auto_classes": ".modeling",
    "summary": ".modeling",
    "supported_model_types": ".modeling",
    "unpatch": ".modeling",
    "plot_attention": ".visualization",
}

#: The module of the ``ea-hf`` command's entry point, which registers only once a command runs.
CLI_ENTRY_POINT = "ea_hf_cli"


def register_extensions() -> None:
    """Connect ea_hf to transformers (idempotent): the EA Auto classes (the EA-DC-Transformer's too), the fused
    kernels and attention tail, and ``push_to_hub`` of EA models with their model cards. Importing ``ea_hf`` runs
    it; the ``ea-hf`` command runs it before a command.

    Example:
        >>> import transformers
        >>> register_extensions()
        >>> transformers.AutoConfig.for_model("ea-bert").model_type
        'ea-bert'
    """
    from . import ops  # noqa: F401  (registers the fused kernels and the attention tail)
    from .hub.upload import push_model
    from .modeling import register_auto_classes, register_hub_publisher
    from .modeling.dc_transformer import register as register_dc_transformer

    register_auto_classes()
    register_dc_transformer()
    register_hub_publisher(push_model)


def __getattr__(name: str) -> Any:
    if name == "ADAPTERS":  # the architecture table's name before 0.2, easily taken for ea_hf.adapters (PEFT)
        warnings.warn("ea_hf.ADAPTERS is now ea_hf.ARCHITECTURES", FutureWarning, stacklevel=2)
        return __getattr__("ARCHITECTURES")
    return lazy_attribute(globals(), _PUBLIC, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


__all__ = [
    "ARCHITECTURES",
    "ATTENTION_IMPLEMENTATION",
    "AttentionMapEvolution",
    "EvolvingAttentionSettings",
    "PatchSummary",
    "evolving_attention_config_class",
    "evolving_attention_forward",
    "evolving_attention_model_class",
    "is_patched",
    "patch",
    "plot_attention",
    "register_auto_classes",
    "summary",
    "supported_model_types",
    "unpatch",
]

if CLI_ENTRY_POINT not in sys.modules:
    register_extensions()

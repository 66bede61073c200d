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
registrations that connect them run here, once: the EA Auto classes, the fused kernels (``ea_hf.ops`` registers
them as it is imported) and ``push_to_hub`` with model cards.
"""

import warnings
from typing import Any

from . import ops  # noqa: F401  (registers the fused kernels and the attention tail)
from .hub.upload import push_model
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
    register_hub_publisher,
    summary,
    supported_model_types,
    unpatch,
)
from .modeling.dc_transformer import register as register_dc_transformer
from .visualization import plot_attention

__version__ = "0.2.0"

register_auto_classes()
register_dc_transformer()
register_hub_publisher(push_model)


def __getattr__(name: str) -> Any:
    if name == "ADAPTERS":  # the architecture table's name before 0.2, easily taken for ea_hf.adapters (PEFT)
        warnings.warn("ea_hf.ADAPTERS is now ea_hf.ARCHITECTURES", FutureWarning, stacklevel=2)
        return ARCHITECTURES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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

"""ea_hf: Evolving Attention for Hugging Face Transformers.

>>> import ea_hf
>>> from transformers import BertConfig, BertForSequenceClassification
>>> model = BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=2,
...                                                  num_attention_heads=4, intermediate_size=37))
>>> model = ea_hf.patch(model, alpha=0.2, beta=0.2)
>>> ea_hf.summary(model).added_parameters
296
"""

from .attention import ATTENTION_IMPLEMENTATION, AttentionMapEvolution, evolving_attention_forward
from .configuration import EvolvingAttentionSettings, evolving_attention_config_class
from .dc_transformer import register as register_dc_transformer
from .modeling import evolving_attention_model_class, register_auto_classes
from .patching import ADAPTERS, PatchSummary, is_patched, patch, summary, supported_model_types, unpatch
from .visualization import plot_attention

__version__ = "0.1.0"

register_auto_classes()
register_dc_transformer()

__all__ = [
    "ADAPTERS",
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

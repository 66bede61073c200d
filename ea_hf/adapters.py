"""PEFT adapters of EA models: the public import path of :mod:`ea_hf.integrations.peft`
(``from ea_hf.adapters import load_adapter, lora_config``)."""

from .integrations.peft import ADAPTER_CONFIG, HEAD_NAMES, attention_projections, load_adapter, lora_config

__all__ = ["ADAPTER_CONFIG", "HEAD_NAMES", "attention_projections", "load_adapter", "lora_config"]

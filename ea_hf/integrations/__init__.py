"""Integrations with other libraries: :mod:`ea_hf.integrations.peft` (LoRA adapters of EA models)."""

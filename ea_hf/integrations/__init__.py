"""Integrations with other libraries: :mod:`ea_hf.integrations.peft` (LoRA adapters of EA models) and
:mod:`ea_hf.integrations.sentence_transformers` (EA inside a ``SentenceTransformer``)."""

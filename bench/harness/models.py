"""The benchmarks' models and inputs: dtypes by name, a model built with the same random weights for every
variant, and random token ids."""

from __future__ import annotations

from typing import Any

from harness.ea import EA_ALPHA, EA_BETA, import_ea_hf

#: Dtype names of the command lines and the torch dtypes they stand for.
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
#: Bytes an element of each dtype name.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
#: BERT-Base (transformers.BertConfig defaults) except for the position table, which must reach N = 2048
#: (attention_gpu.py's model, and the byte table's).
BERT_BASE_CONFIG = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "vocab_size": 30522,
    "max_position_embeddings": 2048,
}
#: ~125M parameters (124,668,672): SmolLM/Llama-style proportions with grouped-query attention (4 key/value heads)
#: (the decoder benchmarks' model, harness/decoder.py, and the byte table's).
LLAMA_125M_CONFIG = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "intermediate_size": 2048,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}
#: Attention implementations a benchmark model runs: eager, sdpa, or Evolving Attention (``ea``).
ATTENTIONS = ("eager", "sdpa", "ea")


def torch_dtype(name: str) -> Any:
    """The torch dtype of a dtype name (``bf16`` -> ``torch.bfloat16``)."""
    import torch

    return getattr(torch, TORCH_DTYPES[name])


def build_model(
    model_class: Any,
    config: Any,
    attention: str,
    *,
    device: Any = "cpu",
    dtype: Any = None,
    layers: list[int] | tuple[int, ...] | None = None,
) -> Any:
    """``model_class(config)`` with random weights drawn from seed 0 (the same for every variant), its attention
    ``eager``, ``sdpa`` or ``ea`` (``ea_hf.patch`` with :data:`EA_ALPHA` and :data:`EA_BETA` on ``layers``, None:
    every layer; the layers it leaves run eager), then moved to ``device`` and ``dtype`` (None: as built)."""
    import torch

    if attention not in ATTENTIONS:
        raise ValueError(f"attention {attention!r} is not one of {ATTENTIONS}")
    torch.manual_seed(0)
    model = model_class(config)
    model.set_attn_implementation("sdpa" if attention == "sdpa" else "eager")
    if attention == "ea":
        import_ea_hf().patch(model, alpha=EA_ALPHA, beta=EA_BETA, layers=layers)
    return model.to(device=device, dtype=dtype)


def random_batch(
    vocab_size: int, batch: int, length: int, device: Any = "cpu", *, labels: int = 0, mask: bool = True
) -> dict[str, Any]:
    """Random ``input_ids`` [batch, length] drawn from seed 1 on the CPU whatever the device (so that every device
    sees the same tokens); with ``mask`` an all-ones ``attention_mask`` (transformers then passes no mask to the
    attention functions); with ``labels`` > 0, a class label in ``range(labels)`` per sequence, drawn after the
    ids."""
    import torch

    generator = torch.Generator().manual_seed(1)
    inputs = {"input_ids": torch.randint(0, vocab_size, (batch, length), generator=generator).to(device)}
    if mask:
        inputs["attention_mask"] = torch.ones(batch, length, dtype=torch.long, device=device)
    if labels:
        inputs["labels"] = torch.randint(0, labels, (batch,), generator=generator).to(device)
    return inputs


def parameter_count(model: Any) -> int:
    """The model's parameters, counted."""
    return sum(p.numel() for p in model.parameters())

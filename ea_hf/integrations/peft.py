"""PEFT adapters for evolving attention models: LoRA on the attention projections with the evolution
convolutions (new weights, so always trained) and the task head fully trainable.

Needs the ``peft`` extra (``pip install "ea_hf[peft]"``).

Example:
    >>> import torch, transformers, ea_hf, peft
    >>> from ea_hf.integrations.peft import lora_config
    >>> config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...                                  intermediate_size=64, vocab_size=99)
    >>> model = ea_hf.patch(transformers.BertForSequenceClassification(config))
    >>> lora = lora_config(model, r=4)
    >>> sorted(lora.target_modules)[:3]
    ['bert.encoder.layer.0.attention.self.key', 'bert.encoder.layer.0.attention.self.query', \
'bert.encoder.layer.0.attention.self.value']
    >>> peft_model = peft.get_peft_model(model, lora)
    >>> trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    >>> sum("evolving_attention" in n for n in trainable), sum("lora_A" in n for n in trainable)
    (4, 6)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn
from transformers.pytorch_utils import Conv1D

from ..modeling.attach import find_attention_sites, is_patched
from ..modeling.attention import MODULE_ATTRIBUTE

if TYPE_CHECKING:
    import peft

#: Names transformers gives task heads that are new when fine-tuning starts.
HEAD_NAMES = ("classifier", "score", "classification_head")
#: The heads peft's SEQ_CLS task type trains by itself.
_PEFT_SEQ_CLS_HEADS = ("classifier", "score")

ADAPTER_CONFIG = "adapter_config.json"


def _import_peft():
    try:
        import peft
    except ImportError:
        raise ImportError('PEFT adapters need the peft package: pip install "ea_hf[peft]"') from None
    return peft


def attention_projections(model: nn.Module) -> list[str]:
    """Full names of the linear layers inside the model's attention modules (query, key, value, output; GPT-2's
    are transformers ``Conv1D`` layers, linear layers with the weight transposed)."""
    return [
        f"{site.name}.{name}"
        for site in find_attention_sites(model)
        for name, module in site.module.named_modules()
        if isinstance(module, (nn.Linear, Conv1D))
    ]


def lora_config(
    model: nn.Module,
    *,
    r: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.1,
    target_modules: list[str] | None = None,
    task_type: str | None = "SEQ_CLS",
    **kwargs: Any,
) -> peft.LoraConfig:
    """A ``peft.LoraConfig`` for ``model`` (patched or not) that also trains what LoRA cannot adapt.

    ``target_modules`` defaults to every projection of the attention modules (full names, so an
    ``output.dense`` inside attention is not confused with the feed-forward ``output.dense``). The evolution
    modules (randomly initialised by :func:`ea_hf.patch`) and the task head (``classifier``, ``score`` or
    ``classification_head``) are ``modules_to_save``: trained in full and stored in the adapter. ``task_type``
    is peft's (``"SEQ_CLS"`` for text classification; ``None`` for other heads, e.g. image classification).
    """
    peft = _import_peft()
    modules_to_save = [MODULE_ATTRIBUTE] if is_patched(model) else []
    modules_to_save += [
        name
        for name in HEAD_NAMES
        if isinstance(getattr(model, name, None), nn.Module)
        and not (task_type == "SEQ_CLS" and name in _PEFT_SEQ_CLS_HEADS)
    ]
    if target_modules is None:
        target_modules = attention_projections(model)
    # peft must know that Conv1D weights are stored transposed (it would otherwise guess so, with a warning).
    modules = dict(model.named_modules())
    kwargs.setdefault("fan_in_fan_out", any(isinstance(modules.get(name), Conv1D) for name in target_modules))
    return peft.LoraConfig(
        task_type=task_type,
        r=r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=target_modules,
        modules_to_save=modules_to_save,
        **kwargs,
    )


def load_adapter(model: nn.Module, adapter_dir: str | Path, **kwargs: Any) -> peft.PeftModel:
    """Load a saved adapter onto ``model``, a base patched with the same evolving attention settings.

    The evolution weights come from the adapter, so the base's own (random) ones do not matter. A base that
    is patched when the adapter expects a plain one, or the reverse, is refused with the reason.
    """
    peft = _import_peft()
    adapter_dir = Path(adapter_dir)
    config_path = adapter_dir / ADAPTER_CONFIG
    if not config_path.is_file():
        raise FileNotFoundError(f"{adapter_dir} holds no PEFT adapter (no {ADAPTER_CONFIG})")
    expects_evolution = MODULE_ATTRIBUTE in (json.loads(config_path.read_text()).get("modules_to_save") or [])
    if expects_evolution and not is_patched(model):
        raise ValueError(
            f"the adapter in {adapter_dir} trains evolving attention modules; patch the base model with the "
            "settings it was trained with (ea_hf.patch) before loading it"
        )
    if is_patched(model) and not expects_evolution:
        raise ValueError(f"the adapter in {adapter_dir} was trained on a plain model; load it onto an unpatched base")
    return peft.PeftModel.from_pretrained(model, str(adapter_dir), **kwargs)

"""The modeling core: everything an EA model needs to run, and nothing else.

The files of this folder are flat siblings that import one another with single-dot relative imports and
otherwise only torch, transformers and huggingface_hub: transformers copies them beside every saved EA
checkpoint, so ``trust_remote_code=True`` loads it where ea_hf is not installed. This ``__init__`` is not
copied; it only gathers the public names.

Bottom to top: ``settings`` (the one definition of every setting), ``versions`` (release numbers), ``call_state``
(the per-call state), ``history`` (decoding), ``masks`` (the convolution's masks and the attention mask pair),
``step`` (the evolution step's settings and maps and the kernels' gate format), ``kernels`` (the fused kernels'
protocols and registries: they plug in here), ``convolution`` (the evolution step and its autograd node),
``scores`` (S and the grouped-query products), ``attention_tail`` (mask, softmax, dropout, the product with the
values and their gradients),
``map_reuse`` (spent maps taken for new ones), ``attention_core`` (a layer's core as one autograd node),
``compiled`` (the core while torch.compile traces), ``evolution`` and ``echo`` (the per-layer modules) with the
``methods`` registry, ``sinks`` (attention sinks), ``attention`` (the transformers attention function),
``architectures`` (the table), ``attach`` (sites, plans, hooks), ``config_classes`` and ``model_classes`` (the EA
classes), ``patching`` (patch, unpatch, summary) and ``dc_transformer`` (EA-DC-Transformer).
"""

from typing import TYPE_CHECKING, Any

from ..lazy import lazy_attribute

if TYPE_CHECKING:  # what _PUBLIC imports on first use, for type checkers and documentation tools
    from .architectures import ARCHITECTURES, ArchitectureSpec, supported_model_types
    from .attach import is_patched
    from .attention import ATTENTION_IMPLEMENTATION, evolving_attention_forward, register_attention
    from .config_classes import evolving_attention_config_class
    from .echo import EchoAttention
    from .evolution import AttentionMapEvolution
    from .kernels import register_fused_attention_tail, register_fused_kernel
    from .methods import EVOLUTION_METHODS
    from .model_classes import (
        auto_class_names,
        evolving_attention_model_class,
        register_auto_classes,
        register_hub_publisher,
    )
    from .patching import PatchSummary, patch, summary, unpatch
    from .settings import ATTENTION_ROLES, EvolvingAttentionSettings

#: Where each public name lives: imported on first use (PEP 562), so that ``ea_hf.modeling.settings`` (what the
#: ``ea-hf`` command's options are built from) imports without torch.
_PUBLIC = {
    "ARCHITECTURES": ".architectures",
    "ArchitectureSpec": ".architectures",
    "supported_model_types": ".architectures",
    "is_patched": ".attach",
    "ATTENTION_IMPLEMENTATION": ".attention",
    "evolving_attention_forward": ".attention",
    "register_attention": ".attention",
    "evolving_attention_config_class": ".config_classes",
    "EchoAttention": ".echo",
    "AttentionMapEvolution": ".evolution",
    "register_fused_attention_tail": ".kernels",
    "register_fused_kernel": ".kernels",
    "EVOLUTION_METHODS": ".methods",
    "auto_class_names": ".model_classes",
    "evolving_attention_model_class": ".model_classes",
    "register_auto_classes": ".model_classes",
    "register_hub_publisher": ".model_classes",
    "PatchSummary": ".patching",
    "patch": ".patching",
    "summary": ".patching",
    "unpatch": ".patching",
    "ATTENTION_ROLES": ".settings",
    "EvolvingAttentionSettings": ".settings",
}


def __getattr__(name: str) -> Any:
    return lazy_attribute(globals(), _PUBLIC, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


__all__ = [
    "ARCHITECTURES",
    "ATTENTION_IMPLEMENTATION",
    "ATTENTION_ROLES",
    "EVOLUTION_METHODS",
    "ArchitectureSpec",
    "AttentionMapEvolution",
    "EchoAttention",
    "EvolvingAttentionSettings",
    "PatchSummary",
    "auto_class_names",
    "evolving_attention_config_class",
    "evolving_attention_forward",
    "evolving_attention_model_class",
    "is_patched",
    "patch",
    "register_attention",
    "register_auto_classes",
    "register_fused_attention_tail",
    "register_fused_kernel",
    "register_hub_publisher",
    "summary",
    "supported_model_types",
    "unpatch",
]

"""Attaching evolution modules: where a model's attention lives (sites, layer stacks, roles), checking settings
against it, and adding or removing the evolution modules and the hooks that route the per-call chain.

This file is copied beside the weights of saved EA checkpoints (``trust_remote_code``): it imports only torch,
transformers and sibling files (single-dot relative imports).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping

from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel

from .architectures import architecture_of
from .attention import ATTENTION_IMPLEMENTATION, MODULE_ATTRIBUTE, pass_cache
from .call_state import start_chain
from .methods import EVOLUTION_METHODS
from .settings import ATTENTION_ROLES, EvolvingAttentionSettings, RoleSettings, resolve_role_settings


@dataclasses.dataclass(frozen=True)
class AttentionSite:
    """One attention module of a model and its place in a layer stack."""

    name: str
    module: nn.Module
    stack_name: str
    layer: int
    role: str
    #: The layer's attention type (``config.layer_types``: full or sliding-window) where it splits the chain.
    chain: str | None = None


def find_attention_sites(model: nn.Module) -> list[AttentionSite]:
    """Every attention module of a supported model, with its stack, layer index and role.

    An attention module at ``<stack>.<list>.<i>.<...>`` is layer ``i`` of ``<stack>``.

    Decoder self-attention layers of different attention types (``config.layer_types``: Gemma, Qwen) form
    separate chains: during cached decoding a sliding-window layer's map covers only the keys its cache still
    holds, so it cannot feed a full-attention layer the map that layer would get in one full pass.
    """
    spec = architecture_of(model)
    layer_types = getattr(model.config.get_text_config(), "layer_types", None)
    sites = []
    for name, module in model.named_modules():
        if type(module).__name__ not in spec.attention:
            continue
        parts = name.split(".")
        numeric = [i for i, part in enumerate(parts) if part.isdigit()]
        if not numeric or numeric[0] == 0:
            raise ValueError(f"Cannot place attention module {name!r} in a layer stack")
        index = numeric[0]
        stack_name = ".".join(parts[: index - 1])
        if parts[-1] in spec.cross_attention:
            role = "cross"
        elif getattr(module, "is_causal", False):
            role = "decoder"
        else:
            role = "encoder"
        layer = int(parts[index])
        chain = layer_types[layer] if role == "decoder" and layer_types and layer < len(layer_types) else None
        sites.append(AttentionSite(name, module, stack_name, layer, role, chain))
    if not sites:
        raise ValueError(f"Found no attention modules ({', '.join(spec.attention)}) in {type(model).__name__}")
    return sites


def attention_roles(model: nn.Module) -> list[str]:
    """The attention roles a model has, in :data:`ATTENTION_ROLES` order."""
    present = {site.role for site in find_attention_sites(model)}
    return [role for role in ATTENTION_ROLES if role in present]


def is_patched(model: nn.Module) -> bool:
    """Whether any module of ``model`` holds an evolving attention module (patched, or loaded as an EA model).

    Args:
        model: any torch module; a transformers model usually.

    Returns:
        True if :func:`~.patching.patch` has patched the model (or it was loaded from an EA checkpoint) and
        :func:`~.patching.unpatch` has not undone it since.

    Example:
        >>> import ea_hf
        >>> from transformers import BertConfig, BertModel
        >>> model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        ...                              intermediate_size=37))
        >>> ea_hf.is_patched(model), ea_hf.is_patched(ea_hf.patch(model))
        (False, True)
    """
    return any(hasattr(module, MODULE_ATTRIBUTE) for module in model.modules())


def plan_evolution(
    model: nn.Module, settings: Mapping[str, EvolvingAttentionSettings]
) -> list[tuple[EvolvingAttentionSettings, list[AttentionSite]]]:
    """Check that ``settings`` fit ``model`` and return, per layer stack, its settings and sites in layer order,
    without touching the model.

    Raises ValueError naming every problem at once.
    """
    sites = find_attention_sites(model)
    problems = []
    if not settings:
        problems.append("no attention role is left to patch")
    unknown_roles = sorted(set(settings) - {s.role for s in sites})
    if unknown_roles:
        problems.append(f"settings for attention role(s) {unknown_roles} that {type(model).__name__} does not have")
    by_stack: dict[tuple[str, str], list[AttentionSite]] = {}
    for site in sites:
        by_stack.setdefault((site.stack_name, site.role), []).append(site)
    shared_layers = architecture_of(model).shared_layers
    planned = []
    for (stack_name, role), stack_sites in by_stack.items():
        chosen = settings.get(role)
        if chosen is None:
            continue
        num_layers = len(stack_sites)
        if chosen.layers is not None and shared_layers:
            problems.append(
                f"{type(model).__name__} calls one layer's weights at every depth, so its layers evolve together: "
                "leave layers unset (all), or leave the model plain"
            )
            continue
        if chosen.layers is not None:
            attending = sorted(site.layer for site in stack_sites)
            missing = [i for i in chosen.layers if i not in attending]
            if missing and attending == list(range(num_layers)):
                problems.append(
                    f"layer indices {missing} out of range for {stack_name or 'the model'} "
                    f"({role}), which has {num_layers} layers (0..{num_layers - 1})"
                )
                continue
            if missing:  # a hybrid stack (Qwen3.5): its linear-attention layers have no map to evolve
                problems.append(
                    f"layers {missing} of {stack_name or 'the model'} ({role}) have no attention map to evolve; "
                    f"its attention layers are {attending}"
                )
                continue
        planned.append((chosen, sorted(stack_sites, key=lambda s: s.layer)))
    if problems:
        raise ValueError("Cannot patch the model: " + "; ".join(problems))
    return planned


def attach_evolution(
    model: PreTrainedModel,
    settings: Mapping[str, EvolvingAttentionSettings],
    plan: list[tuple[EvolvingAttentionSettings, list[AttentionSite]]] | None = None,
) -> None:
    """Give the model's attention modules their evolution modules and route attention through them.

    The model's classes and config are left as they are (see :func:`~.patching.patch` for the full conversion). ``plan``
    is :func:`plan_evolution`'s result when the caller has already validated the settings.
    """
    if plan is None:
        plan = plan_evolution(model, settings)
    spec = architecture_of(model)
    layer_types = getattr(model.config.get_text_config(), "layer_types", None)
    for chosen, stack_sites in plan:
        previous: dict[str | None, int] = {}  # the last evolving layer of each chain in this stack
        evolving = [site for site in stack_sites if chosen.layers is None or site.layer in chosen.layers]
        masks_of_chain: dict[str | None, set[str | None]] = {}
        for site in evolving:
            kind = layer_types[site.layer] if layer_types and site.layer < len(layer_types) else None
            masks_of_chain.setdefault(site.chain, set()).add(kind)
        for site in evolving:
            reference = next(site.module.parameters())
            num_heads = operator.attrgetter(spec.num_heads_attribute)(site.module)
            where = {"role": site.role, "position": site.layer, "previous": previous.get(site.chain)}
            where |= {"device": reference.device, "dtype": reference.dtype}
            head_dim = getattr(site.module, spec.head_dim_attribute, None)
            head_dim = head_dim or query_projection(site.module).out_features // num_heads
            evolution = EVOLUTION_METHODS[chosen.method].from_settings(chosen, num_heads, head_dim, **where)
            # One mask for the whole chain (its layers share one attention type): each layer's softmax masks
            # what the others' kernels leave out (see AttentionMapEvolution.skip_masked_tails).
            evolution.skip_masked_tails = len(masks_of_chain[site.chain]) == 1
            evolution.shared_across_layers = spec.shared_layers
            setattr(site.module, MODULE_ATTRIBUTE, evolution)
            if evolution.causal:
                site.module.register_forward_pre_hook(pass_cache, with_kwargs=True)
            previous[site.chain] = site.layer
        stack = model.get_submodule(stack_sites[0].stack_name)
        if not any(hook is start_chain for hook in stack._forward_pre_hooks.values()):
            stack.register_forward_pre_hook(start_chain, with_kwargs=True)
    set_attention_implementation(model, ATTENTION_IMPLEMENTATION)


def query_projection(attention: nn.Module) -> nn.Linear:
    """The query projection of an attention module: the first linear layer in it (query, q, q_proj, q_lin)."""
    for module in attention.modules():
        if isinstance(module, nn.Linear):
            return module
    raise ValueError(f"{type(attention).__name__} has no linear query projection")


def set_attention_implementation(model: nn.Module, implementation: str) -> None:
    """Set the attention implementation on every config in the model (T5's stacks keep their own copies)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, PreTrainedConfig):
            config._attn_implementation_internal = implementation


def detach_evolution(model: nn.Module) -> None:
    """Remove what :func:`attach_evolution` added (modules and chain hooks)."""
    for module in model.modules():
        if hasattr(module, MODULE_ATTRIBUTE):
            delattr(module, MODULE_ATTRIBUTE)
        for handle_id, hook in list(module._forward_pre_hooks.items()):
            if hook is start_chain or hook is pass_cache:
                del module._forward_pre_hooks[handle_id]
                module._forward_pre_hooks_with_kwargs.pop(handle_id, None)


def resolve_settings(
    model: nn.Module, encoder: EvolvingAttentionSettings, overrides: Mapping[str, RoleSettings]
) -> dict[str, EvolvingAttentionSettings]:
    """Settings per attention role of ``model``: the encoder's, the papers' defaults, and the user's overrides
    (see :func:`~.settings.role_settings`)."""
    return resolve_role_settings(attention_roles(model), encoder, overrides, type(model).__name__)

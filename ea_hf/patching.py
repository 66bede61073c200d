"""Walking a transformers model: where its attention lives, and turning it into Evolving Attention.

Each supported architecture is described by an :class:`ArchitectureAdapter`, a few lines of data naming
its attention classes. Everything else is found by walking the module tree: an attention module inside
``<stack>.<list>.<i>`` is layer ``i`` of ``<stack>``, and the layers of one stack form one residual chain.

This file is copied beside the weights of saved EA checkpoints (see ``configuration.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel

from .attention import (
    ATTENTION_IMPLEMENTATION,
    MODULE_ATTRIBUTE,
    AttentionMapEvolution,
    EchoAttention,
    pass_cache,
    start_chain,
)
from .configuration import (
    ATTENTION_KINDS,
    CONFIG_ATTRIBUTE,
    EvolvingAttentionSettings,
    default_settings,
)


@dataclasses.dataclass(frozen=True)
class ArchitectureAdapter:
    """Where an architecture keeps its attention.

    Args:
        attention: class names of its attention modules (those that call transformers' attention interface
            with the full logits of one layer).
        num_heads_attribute: attribute of those modules holding the number of heads.
        cross_attention: attribute names under which its layers hold encoder-decoder attention modules.
            Other attention modules are decoder self-attention if their ``is_causal`` is true, else encoder
            self-attention.
    """

    attention: tuple[str, ...]
    num_heads_attribute: str = "num_attention_heads"
    cross_attention: tuple[str, ...] = ()


_BART_FAMILY: dict[str, Any] = {"num_heads_attribute": "num_heads", "cross_attention": ("encoder_attn",)}

#: Supported architectures, by transformers ``model_type``. All share the attention-interface path.
ADAPTERS: dict[str, ArchitectureAdapter] = {
    "bert": ArchitectureAdapter(("BertSelfAttention",)),
    "roberta": ArchitectureAdapter(("RobertaSelfAttention",)),
    "xlm-roberta": ArchitectureAdapter(("XLMRobertaSelfAttention",)),
    "camembert": ArchitectureAdapter(("CamembertSelfAttention",)),
    "electra": ArchitectureAdapter(("ElectraSelfAttention",)),
    "distilbert": ArchitectureAdapter(("DistilBertSelfAttention",), num_heads_attribute="n_heads"),
    "vit": ArchitectureAdapter(("ViTAttention",)),
    "deit": ArchitectureAdapter(("DeiTAttention",)),
    "t5": ArchitectureAdapter(("T5Attention",), num_heads_attribute="n_heads", cross_attention=("EncDecAttention",)),
    "bart": ArchitectureAdapter(("BartAttention",), **_BART_FAMILY),
    "mbart": ArchitectureAdapter(("MBartAttention",), **_BART_FAMILY),
    "marian": ArchitectureAdapter(("MarianAttention",), **_BART_FAMILY),
}


@dataclasses.dataclass(frozen=True)
class AttentionSite:
    """One attention module of a model and its place in a layer stack."""

    name: str
    module: nn.Module
    stack_name: str
    layer: int
    kind: str


@dataclasses.dataclass(frozen=True)
class PatchedModule:
    """One row of :func:`summary`."""

    name: str
    kind: str
    layer: int
    previous_layer: int | None
    alpha: float
    beta: float
    kernel_size: int
    parameters: int
    method: str = "conv"


@dataclasses.dataclass(frozen=True)
class PatchSummary:
    """What :func:`summary` reports: the evolving attention modules and the parameters they add."""

    modules: tuple[PatchedModule, ...]
    added_parameters: int
    total_parameters: int

    def __str__(self) -> str:
        header = f"{'module':<52} {'kind':<8} {'method':<8} {'layer':>5} {'prev':>5} {'alpha':>6} {'beta':>6} {'k':>3}"
        lines = [f"{header} {'params':>8}"]
        for m in self.modules:
            prev = "-" if m.previous_layer is None else str(m.previous_layer)
            kernel = str(m.kernel_size) if m.method == "conv" else "-"
            lines.append(
                f"{m.name:<52} {m.kind:<8} {m.method:<8} {m.layer:>5} {prev:>5} {m.alpha:>6g} {m.beta:>6g} "
                f"{kernel:>3} {m.parameters:>8,}"
            )
        share = 100.0 * self.added_parameters / max(self.total_parameters, 1)
        lines.append(
            f"{len(self.modules)} evolving attention modules, {self.added_parameters:,} added parameters "
            f"({share:.3f} % of {self.total_parameters:,})"
        )
        return "\n".join(lines)


def base_model_type(config) -> str:
    """The transformers model_type of a config, seen through an EA config class (``ea-bert`` -> ``bert``)."""
    return getattr(type(config), "evolving_attention_base", type(config)).model_type


def supported_model_types() -> list[str]:
    return sorted(ADAPTERS)


def adapter_for(model: nn.Module) -> ArchitectureAdapter:
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"Expected a transformers PreTrainedModel, got {type(model).__name__}")
    model_type = base_model_type(config)
    adapter = ADAPTERS.get(model_type)
    if adapter is None:
        raise ValueError(
            f"Evolving attention does not support model_type {model_type!r} ({type(model).__name__}). "
            f"Supported: {', '.join(supported_model_types())}."
        )
    return adapter


def find_attention_sites(model: nn.Module) -> list[AttentionSite]:
    """Every attention module of a supported model, with its stack, layer index and kind.

    An attention module at ``<stack>.<list>.<i>.<...>`` is layer ``i`` of ``<stack>``.
    """
    adapter = adapter_for(model)
    sites = []
    for name, module in model.named_modules():
        if type(module).__name__ not in adapter.attention:
            continue
        parts = name.split(".")
        numeric = [i for i, part in enumerate(parts) if part.isdigit()]
        if not numeric or numeric[0] == 0:
            raise ValueError(f"Cannot place attention module {name!r} in a layer stack")
        index = numeric[0]
        stack_name = ".".join(parts[: index - 1])
        if parts[-1] in adapter.cross_attention:
            kind = "cross"
        elif getattr(module, "is_causal", False):
            kind = "decoder"
        else:
            kind = "encoder"
        sites.append(AttentionSite(name, module, stack_name, int(parts[index]), kind))
    if not sites:
        raise ValueError(f"Found no attention modules ({', '.join(adapter.attention)}) in {type(model).__name__}")
    return sites


def attention_kinds(model: nn.Module) -> list[str]:
    """The attention kinds a model has, in :data:`ATTENTION_KINDS` order."""
    present = {site.kind for site in find_attention_sites(model)}
    return [kind for kind in ATTENTION_KINDS if kind in present]


def is_patched(model: nn.Module) -> bool:
    return any(hasattr(module, MODULE_ATTRIBUTE) for module in model.modules())


def plan_evolution(
    model: nn.Module, settings: Mapping[str, EvolvingAttentionSettings]
) -> list[tuple[EvolvingAttentionSettings, list[AttentionSite]]]:
    """Check that ``settings`` fit ``model`` and return, per layer stack, its settings and sites in layer order,
    without touching the model.

    Raises ValueError (or NotImplementedError for decoders) naming every problem at once.
    """
    sites = find_attention_sites(model)
    problems = []
    if not any(site.kind == "encoder" for site in sites):
        decoder = next(site.name for site in sites if site.kind != "encoder")
        raise NotImplementedError(
            f"{type(model).__name__} is a decoder-only model ({decoder}, ...); evolving attention supports "
            "encoder and encoder-decoder models. Use an encoder configuration (is_decoder=False) or a "
            "sequence-to-sequence model."
        )
    if not settings:
        problems.append("no attention kind is left to patch")
    unknown_kinds = sorted(set(settings) - {s.kind for s in sites})
    if unknown_kinds:
        problems.append(f"settings for attention kind(s) {unknown_kinds} that {type(model).__name__} does not have")
    by_stack: dict[tuple[str, str], list[AttentionSite]] = {}
    for site in sites:
        by_stack.setdefault((site.stack_name, site.kind), []).append(site)
    planned = []
    for (stack_name, kind), stack_sites in by_stack.items():
        chosen = settings.get(kind)
        if chosen is None:
            continue
        num_layers = len(stack_sites)
        if chosen.layers is not None:
            out_of_range = [i for i in chosen.layers if i >= num_layers]
            if out_of_range:
                problems.append(
                    f"layer indices {out_of_range} out of range for {stack_name or 'the model'} "
                    f"({kind}), which has {num_layers} layers (0..{num_layers - 1})"
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

    The model's classes and config are left as they are (see :func:`patch` for the full conversion). ``plan``
    is :func:`plan_evolution`'s result when the caller has already validated the settings.
    """
    if plan is None:
        plan = plan_evolution(model, settings)
    adapter = adapter_for(model)
    for chosen, stack_sites in plan:
        previous = None
        for site in stack_sites:
            if chosen.layers is not None and site.layer not in chosen.layers:
                continue
            reference = next(site.module.parameters())
            num_heads = getattr(site.module, adapter.num_heads_attribute)
            common = {"kind": site.kind, "position": site.layer, "previous": previous}
            common |= {"device": reference.device, "dtype": reference.dtype}
            if chosen.method == "echo":
                evolution = EchoAttention(
                    num_heads,
                    head_dim=query_projection(site.module).out_features // num_heads,
                    echoes=chosen.echoes,
                    state=chosen.echo_state,
                    max_positions=chosen.max_positions,
                    **common,
                )
            else:
                evolution = AttentionMapEvolution(
                    num_heads,
                    alpha=chosen.alpha,
                    beta=chosen.beta,
                    kernel_size=chosen.kernel_size,
                    init=chosen.init,
                    method=chosen.method,
                    **common,
                )
            setattr(site.module, MODULE_ATTRIBUTE, evolution)
            if evolution.causal:
                site.module.register_forward_pre_hook(pass_cache, with_kwargs=True)
            previous = site.layer
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


def _register_output_capture(model: PreTrainedModel) -> None:
    # transformers records `output_attentions` & co. per model class, registered in PreTrainedModel.__init__;
    # a class swapped in afterwards needs the same entry.
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

    _CAN_RECORD_REGISTRY[model] = model._can_record_outputs


KindSettings = EvolvingAttentionSettings | Mapping[str, Any] | bool | None


def resolve_settings(
    model: nn.Module, encoder: EvolvingAttentionSettings, overrides: Mapping[str, KindSettings]
) -> dict[str, EvolvingAttentionSettings]:
    """Settings per attention kind of ``model``: the encoder's, the papers' defaults, and the user's overrides.

    An override is an :class:`EvolvingAttentionSettings`, a mapping of fields to change in the default,
    ``False`` to leave that kind plain, or ``None``/``True`` for the default.
    """
    kinds = attention_kinds(model)
    settings = default_settings(kinds, encoder)
    problems = []
    for kind, override in overrides.items():
        if override is None or override is True:
            continue
        if kind not in kinds:
            if override is not False:
                problems.append(f"{type(model).__name__} has no {kind} attention to configure")
            continue
        if override is False:
            settings.pop(kind)
        elif isinstance(override, EvolvingAttentionSettings):
            settings[kind] = override
        elif isinstance(override, Mapping):
            try:
                settings[kind] = EvolvingAttentionSettings.from_dict({**settings[kind].to_dict(), **override})
            except ValueError as error:
                problems.append(f"{kind}: {error}")
        else:
            problems.append(
                f"{kind} must be a mapping of settings, EvolvingAttentionSettings, True or False; got {override!r}"
            )
    if problems:
        raise ValueError("Cannot patch the model: " + "; ".join(problems))
    return settings


def patch(
    model: PreTrainedModel,
    alpha: float | None = None,
    beta: float | None = None,
    kernel_size: int = 3,
    layers: list[int] | None = None,
    init: str = "kaiming_uniform",
    *,
    method: str = "conv",
    echoes: int = 2,
    echo_state: str = "scalar",
    max_positions: int | None = None,
    decoder: KindSettings = None,
    cross: KindSettings = None,
) -> PreTrainedModel:
    """Turn a loaded transformers model into an Evolving Attention model, in place.

    Every self-attention layer (or those listed in ``layers``) gets a ``kernel_size`` x ``kernel_size``
    convolution over its attention map, mixed as in TPAMI 2023 section 3.1; the new weights are drawn from
    torch's RNG with the ``init`` scheme. The model and its config become their EA classes (``EABert...``,
    ``model_type="ea-bert"``), so ``save_pretrained`` writes an EA checkpoint that the Auto classes load
    back, with ea_hf installed or through ``trust_remote_code=True``. All checks run before anything is
    changed; on error the model is left as it was.

    Encoder-decoder models (T5, BART, mBART, Marian) have two more chains, each with its own settings:
    decoder self-attention and encoder-decoder (cross) attention. Both convolve causally. By default they
    follow the papers' translation setup: no skip connection (alpha = 0), the encoder's beta, kernel and
    init, every layer.

    ``method`` picks the evolution: ``"conv"`` (Evolving Attention, the default), ``"residual"`` (the
    residual mix alone, no convolution and no new weights; beta = 0) or ``"echo"`` (echo attention: ``echoes``
    gated refinements of each layer's own logits with a ``scalar``, ``row`` or ``column`` state; alpha =
    beta = 0; ``max_positions`` bounds the sequence length of the vector states).

    Args:
        model: a loaded model of a supported architecture (see :data:`ADAPTERS`).
        alpha: weight of the previous layer's logits, in [0, 1] (encoder self-attention); default 0.2 (0 for
            ``echo``).
        beta: weight of the convolution branch, in [0, 1] (encoder; default for the other chains); default
            0.2 (0 for ``residual`` and ``echo``).
        kernel_size: odd kernel size of the convolution (encoder; default for the other chains).
        layers: indices of the encoder layers to patch; ``None`` for all.
        init: convolution initialisation, one of ``kaiming_uniform`` (default), ``xavier_uniform``,
            ``normal`` or ``dirac`` (encoder; default for the other chains).
        decoder: decoder self-attention settings: a mapping of fields that override the default (e.g.
            ``{"alpha": 0.1, "layers": [0, 1]}``), an :class:`EvolvingAttentionSettings`, or ``False`` to
            leave it plain.
        cross: encoder-decoder attention settings, in the same forms as ``decoder``.

    Returns:
        The same model object, patched.

    Example:
        >>> import ea_hf
        >>> from transformers import BertConfig, BertModel
        >>> model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        ...                              intermediate_size=37))
        >>> model = ea_hf.patch(model, alpha=0.2, beta=0.2)
        >>> model.config.model_type, type(model).__name__
        ('ea-bert', 'EABertModel')

        An encoder-decoder model, with a skip connection in the decoder too and plain cross attention:

        >>> from transformers import T5Config, T5ForConditionalGeneration
        >>> t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
        ...                                          num_heads=4, decoder_start_token_id=0))
        >>> t5 = ea_hf.patch(t5, alpha=0.2, beta=0.2, decoder={"alpha": 0.1}, cross=False)
        >>> {kind: s["alpha"] for kind, s in t5.config.evolving_attention.items()}
        {'encoder': 0.2, 'decoder': 0.1}
    """
    from .configuration import evolving_attention_config_class
    from .modeling import auto_map_for, evolving_attention_model_class

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"ea_hf.patch expects a transformers PreTrainedModel, got {type(model).__name__}")
    encoder = EvolvingAttentionSettings.for_method(
        method,
        alpha,
        beta,
        kernel_size=kernel_size,
        layers=layers,
        init=init,
        echoes=echoes,
        echo_state=echo_state,
        max_positions=max_positions,
    )
    if is_patched(model) or getattr(model.config, CONFIG_ATTRIBUTE, None) is not None:
        raise ValueError(f"{type(model).__name__} is already patched with evolving attention; call ea_hf.unpatch first")
    settings = resolve_settings(model, encoder, {"decoder": decoder, "cross": cross})
    plan = plan_evolution(model, settings)
    model_class = evolving_attention_model_class(type(model))
    config_class = evolving_attention_config_class(type(model.config))

    original_attention = model.config._attn_implementation
    attach_evolution(model, settings, plan)
    config = model.config
    config.__class__ = config_class
    setattr(config, CONFIG_ATTRIBUTE, {kind: s.to_dict() for kind, s in settings.items()})
    config.auto_map = auto_map_for(config_class)
    model.__class__ = model_class
    _register_output_capture(model)
    model._ea_original_attn_implementation = original_attention
    return model


def unpatch(model: PreTrainedModel) -> PreTrainedModel:
    """Undo :func:`patch` in place: remove the evolution modules and restore the original classes.

    Works on models patched by :func:`patch` and on EA models loaded from a checkpoint; the result computes
    exactly what the original architecture computes. Returns the same model object.

    Example:
        >>> import ea_hf
        >>> from transformers import BertConfig, BertModel
        >>> model = ea_hf.patch(BertModel(BertConfig(hidden_size=32, num_hidden_layers=2,
        ...                                          num_attention_heads=4, intermediate_size=37)))
        >>> type(ea_hf.unpatch(model)).__name__
        'BertModel'
    """
    if not is_patched(model):
        raise ValueError(f"{type(model).__name__} is not patched with evolving attention")
    detach_evolution(model)
    config = model.config
    base_config_class = getattr(type(config), "evolving_attention_base", None)
    if base_config_class is not None:
        config.__class__ = base_config_class
    config.__dict__.pop(CONFIG_ATTRIBUTE, None)
    config.__dict__.pop("auto_map", None)
    base_model_class = getattr(type(model), "evolving_attention_base", None)
    if base_model_class is not None:
        model.__class__ = base_model_class
        _register_output_capture(model)
    original = model.__dict__.pop("_ea_original_attn_implementation", None)
    set_attention_implementation(model, model.get_correct_attn_implementation(original))
    return model


def summary(model: nn.Module) -> PatchSummary:
    """Report the evolving attention modules of a model and the number of parameters they add.

    Example:
        >>> import ea_hf
        >>> from transformers import BertConfig, BertModel
        >>> model = ea_hf.patch(BertModel(BertConfig(hidden_size=32, num_hidden_layers=2,
        ...                                          num_attention_heads=4, intermediate_size=37)))
        >>> ea_hf.summary(model).added_parameters  # 2 layers x (4*4*3*3 + 4)
        296
    """
    rows = []
    for name, module in model.named_modules():
        if isinstance(module, AttentionMapEvolution):
            rows.append(
                PatchedModule(
                    name=name,
                    kind=module.kind,
                    layer=module.position,
                    previous_layer=module.previous,
                    alpha=module.alpha,
                    beta=module.beta,
                    kernel_size=module.kernel_size,
                    parameters=sum(p.numel() for p in module.parameters()),
                    method=module.method,
                )
            )
    return PatchSummary(
        modules=tuple(rows),
        added_parameters=sum(row.parameters for row in rows),
        total_parameters=sum(p.numel() for p in model.parameters()),
    )

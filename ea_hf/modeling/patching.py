"""``ea_hf.patch``, ``unpatch`` and ``summary``: turning a loaded transformers model into its Evolving Attention
class and back, in place.

This file is copied beside the weights of saved EA checkpoints (``trust_remote_code``): it imports only torch,
transformers and sibling files (single-dot relative imports).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from typing import Any

from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

from .attach import (
    attach_evolution,
    detach_evolution,
    is_patched,
    plan_evolution,
    resolve_settings,
    set_attention_implementation,
)
from .config_classes import evolving_attention_config_class
from .evolution import AttentionMapEvolution
from .model_classes import auto_map_for, evolving_attention_model_class
from .settings import CONFIG_ATTRIBUTE, CONVOLUTION_METHODS, METHOD_DEPENDENT, EvolvingAttentionSettings, RoleSettings


@dataclasses.dataclass(frozen=True)
class PatchedModule:
    """One row of :func:`summary`."""

    name: str
    role: str
    layer: int
    previous_layer: int | None
    alpha: float
    beta: float
    kernel_size: int
    parameters: int
    method: str = "conv"
    #: Serves several layers (ALBERT): each call mixes in the previous call's logits ("call" under prev).
    shared_across_layers: bool = False
    #: ``learned``: alpha and beta are the layer's gates, at their current values; ``fixed``: its settings.
    gates: str = "fixed"


@dataclasses.dataclass(frozen=True)
class PatchSummary:
    """What :func:`summary` reports: the evolving attention modules and the parameters they add.

    Attributes:
        modules: one entry per evolving attention module, in the model's module order.
        added_parameters: the parameters the evolving attention modules add.
        total_parameters: the parameters of the whole model, the added ones included.
    """

    modules: tuple[PatchedModule, ...]
    added_parameters: int
    total_parameters: int

    def __str__(self) -> str:
        header = f"{'module':<52} {'role':<8} {'method':<8} {'layer':>5} {'prev':>5} {'alpha':>6} {'beta':>6} {'k':>3}"
        lines = [f"{header} {'params':>8}"]
        for m in self.modules:
            prev = "call" if m.shared_across_layers else "-" if m.previous_layer is None else str(m.previous_layer)
            kernel = str(m.kernel_size) if m.method in CONVOLUTION_METHODS else "-"
            lines.append(
                f"{m.name:<52} {m.role:<8} {m.method:<8} {m.layer:>5} {prev:>5} {m.alpha:>6g} {m.beta:>6g} "
                f"{kernel:>3} {m.parameters:>8,}"
            )
        if any(m.gates == "learned" for m in self.modules):
            lines.append("alpha and beta of the layers with learned gates: their current values")
        share = 100.0 * self.added_parameters / max(self.total_parameters, 1)
        lines.append(
            f"{len(self.modules)} evolving attention modules, {self.added_parameters:,} added parameters "
            f"({share:.3f} % of {self.total_parameters:,})"
        )
        return "\n".join(lines)


def _register_output_capture(model: PreTrainedModel) -> None:
    # transformers records `output_attentions` & co. per model class, registered in PreTrainedModel.__init__;
    # a class swapped in afterwards needs the same entry. The registry is keyed by the class's name: a plain
    # dict before transformers 5.23, a dict that derives the key from the model since.
    dict.__setitem__(_CAN_RECORD_REGISTRY, str(model.__class__), model._can_record_outputs)


def patch(
    model: PreTrainedModel,
    *args: Any,
    decoder: RoleSettings = None,
    cross: RoleSettings = None,
    **settings: Any,
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
        model: a loaded model of a supported architecture (see :data:`~.architectures.ARCHITECTURES`).
        *args: the encoder's settings by position: an :class:`~.settings.EvolvingAttentionSettings`, or its
            fields in order (``alpha, beta, kernel_size, layers, init``, ...).
        decoder: decoder self-attention settings: a mapping of fields that override the default (e.g.
            ``{"alpha": 0.1, "layers": [0, 1]}``), an :class:`~.settings.EvolvingAttentionSettings`, or
            ``False`` to leave it plain.
        cross: encoder-decoder attention settings, in the same forms as ``decoder``.
        **settings: the encoder's settings by name. ``alpha`` (default 0.2; 0 for ``echo``) weighs the previous
            layer's logits; ``beta`` (0.2; 0 for ``residual`` and ``echo``) the convolution branch;
            ``kernel_size`` (3) is odd; ``layers`` picks encoder layers (``None``: all); ``init`` is
            ``kaiming_uniform`` (default), ``xavier_uniform``, ``normal`` or ``dirac``. beta, kernel and init
            are also the defaults of the other chains.

    Returns:
        The same model object, patched.

    Raises:
        TypeError: ``model`` is not a transformers ``PreTrainedModel``, or the settings come both as an
            :class:`~.settings.EvolvingAttentionSettings` and as fields.
        ValueError: the settings are invalid, the architecture is not supported, the settings do not fit the
            model (every problem named at once), or the model is already patched.
        NotImplementedError: the installed transformers is older than the architecture's support needs.

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
        >>> {role: s["alpha"] for role, s in t5.config.evolving_attention.items()}
        {'encoder': 0.2, 'decoder': 0.1}
    """
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"ea_hf.patch expects a transformers PreTrainedModel, got {type(model).__name__}")
    if args and isinstance(args[0], EvolvingAttentionSettings):
        if len(args) > 1 or settings:
            raise TypeError("ea_hf.patch takes the settings as an EvolvingAttentionSettings or as fields, not both")
        encoder = args[0]
    else:
        encoder = EvolvingAttentionSettings.from_arguments(*args, **settings)
    if is_patched(model) or getattr(model.config, CONFIG_ATTRIBUTE, None) is not None:
        raise ValueError(f"{type(model).__name__} is already patched with evolving attention; call ea_hf.unpatch first")
    settings = resolve_settings(model, encoder, {"decoder": decoder, "cross": cross})
    plan = plan_evolution(model, settings)
    model_class = evolving_attention_model_class(type(model))
    config_class = evolving_attention_config_class(type(model.config))

    original_attention = model.config._attn_implementation
    _own_configs(model)
    attach_evolution(model, settings, plan)
    config = model.config
    config.__class__ = config_class
    setattr(config, CONFIG_ATTRIBUTE, {role: s.to_dict() for role, s in settings.items()})
    config.auto_map = auto_map_for(config_class)
    model.__class__ = model_class
    _register_output_capture(model)
    model._ea_original_attn_implementation = original_attention
    return model


def _own_configs(model: nn.Module) -> None:
    """Give the model copies of its config objects, so that patching changes nothing the caller holds.

    Models built from one config share that object (and its sub-configs) with the caller and with each other:
    patching it in place would make the next model built from it look patched. Every module that holds one of
    the configs (the model, its base model, attention modules, rotary embeddings...) gets the same copy.
    """
    copies: dict[int, Any] = {}
    copy.deepcopy(model.config, copies)
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, PreTrainedConfig) and id(value) in copies:
                module.__dict__[name] = copies[id(value)]


def unpatch(model: PreTrainedModel) -> PreTrainedModel:
    """Undo :func:`patch` in place: remove the evolution modules and restore the original classes.

    Works on models patched by :func:`patch` and on EA models loaded from a checkpoint; the result computes
    exactly what the original architecture computes.

    Args:
        model: a model patched by :func:`patch` or loaded as an EA model.

    Returns:
        The same model object, with its original classes and attention implementation.

    Raises:
        ValueError: ``model`` is not patched.

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

    Args:
        model: any torch module; one without evolving attention reports no modules.

    Returns:
        The modules (name, role, layer, previous layer, settings and parameters of each) and the parameter
        counts; ``str()`` of it is a table.

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
                    role=module.role,
                    layer=module.position,
                    previous_layer=module.previous,
                    alpha=module.alpha,
                    beta=module.beta,
                    kernel_size=module.kernel_size,
                    parameters=sum(p.numel() for p in module.parameters()),
                    method=module.method,
                    shared_across_layers=module.shared_across_layers,
                    gates=module.gates,
                )
            )
    return PatchSummary(
        modules=tuple(rows),
        added_parameters=sum(row.parameters for row in rows),
        total_parameters=sum(p.numel() for p in model.parameters()),
    )


def _settings_signature() -> inspect.Signature:
    """patch's signature as help() and editors show it: the model, then every field of
    :class:`EvolvingAttentionSettings` with its default (None where the method decides), then ``decoder`` and
    ``cross``. Derived from the dataclass, so a new setting appears here by itself."""
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    parameters = [inspect.Parameter("model", positional, annotation="PreTrainedModel")]
    for field in dataclasses.fields(EvolvingAttentionSettings):
        default = None if field.name in METHOD_DEPENDENT else field.default
        parameters.append(inspect.Parameter(field.name, positional, default=default, annotation=field.type))
    for role in ("decoder", "cross"):
        keyword = inspect.Parameter.KEYWORD_ONLY
        parameters.append(inspect.Parameter(role, keyword, default=None, annotation="RoleSettings"))
    return inspect.Signature(parameters, return_annotation="PreTrainedModel")


patch.__signature__ = _settings_signature()

"""EA model classes and their registration with the transformers Auto classes.

Every transformers model class of a supported architecture has an EA twin, made on demand:
``EABertForSequenceClassification`` is ``BertForSequenceClassification`` whose attention evolves as its
config's ``evolving_attention`` settings say. Weight names are the base model's plus one
``...evolving_attention.weight``/``.bias`` pair per patched layer, so a plain checkpoint loads into an EA
class (the new weights are initialised) and an EA checkpoint is an ordinary safetensors checkpoint.

This file, with the sibling files it imports, is copied beside the weights of saved EA checkpoints; the
config's ``auto_map`` points at it, so ``trust_remote_code=True`` loads them where ea_hf is not installed. It
imports only torch, transformers and sibling files (single-dot relative imports).
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from transformers import CONFIG_MAPPING, AutoConfig, PreTrainedConfig, PreTrainedModel
from transformers.dynamic_module_utils import custom_object_save

from .architectures import ARCHITECTURES
from .attach import attach_evolution, attention_roles
from .attention import ATTENTION_IMPLEMENTATION
from .config_classes import EA_PREFIX, _transformers_class, cached_ea_class, evolving_attention_config_class
from .evolution import AttentionMapEvolution
from .history import (
    output_cache,
    reorder_convolution_histories,
    split_convolution_histories,
    stack_convolution_histories,
)
from .settings import CONFIG_ATTRIBUTE, default_settings, settings_from_config

#: Uploads an EA model with its model card (``push_to_hub``); set by ``ea_hf.hub`` through
#: :func:`register_hub_publisher`. Remote-code copies of this file have none and use transformers' own.
_hub_publisher: list[Any] = []


def register_hub_publisher(publish: Any) -> None:
    """Make ``push_to_hub`` of every EA model call ``publish(model, repo_id, **kwargs)``."""
    _hub_publisher[:] = [publish]


def _auto_model_classes() -> dict[str, type]:
    """transformers' AutoModel* classes by name."""
    from transformers.models.auto import modeling_auto

    auto_base = modeling_auto._BaseAutoModelClass
    return {
        name: value
        for name, value in vars(modeling_auto).items()
        if name.startswith("AutoModel")
        and isinstance(value, type)
        and issubclass(value, auto_base)
        and getattr(value, "_model_mapping", None) is not None
    }


def auto_class_names(model_type: str) -> dict[str, str]:
    """For a transformers model_type, the transformers class behind each AutoModel* class that has one.

    Example:
        >>> auto_class_names("bert")["AutoModelForSequenceClassification"]
        'BertForSequenceClassification'
    """
    names = {}
    for auto_name, auto_class in sorted(_auto_model_classes().items()):
        class_name = auto_class._model_mapping._model_mapping.get(model_type)
        if isinstance(class_name, (list, tuple)):  # several candidates (e.g. DeiT with/without teacher)
            class_name = class_name[0] if class_name else None
        # Some Auto classes map a model_type to a class of another architecture built on its config
        # (AutoModelForDecision: qwen2 -> JevForDecision); only the architecture's own classes have EA twins.
        if isinstance(class_name, str) and getattr(transformers, class_name).config_class.model_type == model_type:
            names[auto_name] = class_name
    return names


class EvolvingAttentionModelMixin:
    """What every EA model class adds to its transformers base class."""

    evolving_attention_base: type[PreTrainedModel]

    def __init__(self, config: PreTrainedConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        settings = settings_from_config(config)
        if settings is None:
            settings = default_settings(attention_roles(self))
        setattr(config, CONFIG_ATTRIBUTE, {role: s.to_dict() for role, s in settings.items()})
        if not getattr(config, "auto_map", None):
            config.auto_map = auto_map_for(type(config))
        attach_evolution(self, settings)

    def _check_and_adjust_attn_implementation(
        self, attn_implementation: str | None, is_init_check: bool = False, allow_all_kernels: bool = False
    ) -> str:
        # The evolution needs the explicit logits of every layer, so no other kernel can stand in.
        if attn_implementation in (None, ATTENTION_IMPLEMENTATION):
            return ATTENTION_IMPLEMENTATION
        raise ValueError(
            f"{type(self).__name__} computes attention with {ATTENTION_IMPLEMENTATION!r}; "
            f"attn_implementation={attn_implementation!r} would drop the evolution. "
            "Use ea_hf.unpatch(model) for the plain architecture."
        )

    def initialize_weights(self) -> None:
        super().initialize_weights()
        # Sub-models (e.g. `model.bert`) initialise their modules with their own `_init_weights`, which does
        # not know the evolution; initialise it here. Weights loaded from a checkpoint are left alone.
        for module in self.modules():
            if isinstance(module, AttentionMapEvolution):
                module.reset_parameters()

    def _reorder_cache(self, past_key_values: Any, beam_idx: torch.LongTensor) -> Any:
        # Beam search reorders the KV cache; the convolution rows kept on it must follow the same beams.
        reorder = getattr(super(), "_reorder_cache", None)
        if reorder is not None:
            past_key_values = reorder(past_key_values, beam_idx)
        else:
            past_key_values.reorder_cache(beam_idx)
        reorder_convolution_histories(past_key_values, beam_idx)
        return past_key_values

    def _assisted_decoding(self, *args: Any, **kwargs: Any) -> Any:
        # Assisted (speculative) decoding crops the KV cache back to the accepted tokens; the convolution rows
        # kept on it would then belong to rejected tokens.
        raise ValueError(
            f"{type(self).__name__} does not support assisted decoding (assistant_model, prompt_lookup_num_tokens): "
            "it crops the KV cache, and evolving attention keeps convolution rows on the cache that cannot be "
            "cropped with it. Generate without an assistant."
        )

    @classmethod
    def is_remote_code(cls) -> bool:
        # Not for a subclass a wrapper makes at run time, such as FSDP2's FSDP<Name>: transformers would file
        # it in auto_map and copy its module, torch's source, as the checkpoint's code (see save_pretrained).
        return cls is _own_ea_class(cls) and super().is_remote_code()

    def save_pretrained(self, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        ea_class = _own_ea_class(type(self))
        if ea_class is not type(self) and kwargs.get("is_main_process", True):
            # Wrapped (FSDP2): the code and the auto_map entry are the EA class's, as if it were saved unwrapped.
            # transformers reads only the class of what it is given, so an instance that was never initialised
            # stands in.
            custom_object_save(object.__new__(ea_class), save_directory, config=self.config)
        return super().save_pretrained(save_directory, *args, **kwargs)

    def push_to_hub(self, repo_id: str, **kwargs: Any) -> Any:
        """Upload the model with its evolving attention model card, and the tokenizer or image processor of
        the checkpoint it was loaded from (see ``ea_hf.hub.push_model``); same arguments as transformers'.
        Loaded as remote code where ea_hf is not installed, this is transformers' own ``push_to_hub``."""
        if not _hub_publisher:
            return super().push_to_hub(repo_id, **kwargs)
        return _hub_publisher[0](self, repo_id, **kwargs)

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=None, **kwargs: Any):
        keywords = getattr(gradient_checkpointing_func, "keywords", None) or {}
        if enable and keywords.get("use_reentrant", False):
            raise ValueError(
                "Evolving attention passes each layer's logits to the next one outside the layer's arguments; "
                "reentrant checkpointing would cut their gradient. Use the default "
                "gradient_checkpointing_kwargs={'use_reentrant': False}."
            )
        if gradient_checkpointing_func is None:
            return super()._set_gradient_checkpointing(enable=enable, **kwargs)
        return super()._set_gradient_checkpointing(
            enable=enable, gradient_checkpointing_func=gradient_checkpointing_func, **kwargs
        )


class SplitGenerationOutputsMixin:
    """For the models whose ``generate`` splits its output by example and stacks it again (Whisper), rebuilding
    the returned cache from its keys and values alone: the convolution rows kept on the cache are split and
    stacked with them, so that decoding can continue from the cache ``generate`` returns."""

    def _postprocess_outputs(self, seek_outputs: Any, *args: Any, **kwargs: Any) -> Any:
        tokens, outputs = super()._postprocess_outputs(seek_outputs, *args, **kwargs)
        if isinstance(outputs, list):  # (a tensor where generate returned no dict)
            split_convolution_histories(output_cache(seek_outputs), [output_cache(output) for output in outputs])
        return tokens, outputs

    def _stack_split_outputs(self, seek_outputs: list[Any], *args: Any, **kwargs: Any) -> Any:
        outputs = super()._stack_split_outputs(seek_outputs, *args, **kwargs)
        parts = [output_cache(output) for output in seek_outputs]
        stack_convolution_histories(parts, output_cache(outputs), self.device)
        return outputs


_model_classes: dict[type, type] = {}


def _own_ea_class(cls: type) -> type:
    """The EA class that ``cls`` is or derives from (``cls`` itself unless a wrapper subclassed it)."""
    return next(c for c in cls.__mro__ if "evolving_attention_base" in c.__dict__)


def evolving_attention_model_class(base: type[PreTrainedModel]) -> type[PreTrainedModel]:
    """The EA class for a transformers model class (``BertModel`` -> ``EABertModel``).

    The subclass's config class is the EA config class (:func:`~.config_classes.evolving_attention_config_class`);
    its ``from_pretrained`` loads EA checkpoints and ``save_pretrained`` writes them.

    Args:
        base: a transformers model class; an EA model class is returned as it is.

    Returns:
        The EA model class, built once per base class and shared after that.

    Example:
        >>> from transformers import BertForMaskedLM
        >>> cls = evolving_attention_model_class(BertForMaskedLM)
        >>> cls.__name__, cls.config_class.model_type
        ('EABertForMaskedLM', 'ea-bert')
    """

    def build(name: str) -> type[PreTrainedModel]:
        auto_names = auto_class_names(base.config_class.model_type)
        splits_outputs = hasattr(base, "_postprocess_outputs") and hasattr(base, "_stack_split_outputs")
        return type(
            name,
            (EvolvingAttentionModelMixin, *([SplitGenerationOutputsMixin] if splits_outputs else []), base),
            {
                "__module__": __name__,
                "__qualname__": name,
                "__doc__": f"{base.__name__} with Evolving Attention (see ea_hf.patch).",
                "config_class": evolving_attention_config_class(base.config_class),
                "evolving_attention_base": base,
                # The Auto class under which save_pretrained files this class in `auto_map`.
                "_auto_class": next((auto for auto, cls in auto_names.items() if cls == base.__name__), None),
            },
        )

    return cached_ea_class(base, _model_classes, build)


def auto_map_for(config_class: type[PreTrainedConfig]) -> dict[str, str]:
    """The ``auto_map`` of an EA config: every Auto class the architecture has, pointing at this file."""
    base_type = config_class.evolving_attention_base.model_type
    config_file = config_class.__module__.rsplit(".", 1)[-1]
    model_file = __name__.rsplit(".", 1)[-1]
    auto_map = {"AutoConfig": f"{config_file}.{config_class.__name__}"}
    for auto_name, class_name in auto_class_names(base_type).items():
        auto_map[auto_name] = f"{model_file}.{EA_PREFIX}{class_name}"
    return auto_map


def register_auto_classes(model_types: list[str] | None = None) -> None:
    """Register EA configs and models with AutoConfig and every AutoModel* class (idempotent).

    ``import ea_hf`` calls it for every architecture, so ``AutoModel*.from_pretrained`` loads EA checkpoints
    without ``trust_remote_code``.

    Args:
        model_types: the transformers ``model_type``s to register (``None``: every supported one); those the
            installed transformers does not know are left out.

    Example:
        >>> from transformers import AutoConfig
        >>> register_auto_classes(["bert"])
        >>> type(AutoConfig.for_model("ea-bert")).__name__
        'EABertConfig'
    """
    auto_classes = _auto_model_classes()
    for model_type in model_types or sorted(ARCHITECTURES):
        if model_type not in CONFIG_MAPPING:  # an architecture newer than the installed transformers (its `since`)
            continue
        base_config = CONFIG_MAPPING[model_type]
        config_class = evolving_attention_config_class(base_config)
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        for auto_name, class_name in auto_class_names(model_type).items():
            model_class = evolving_attention_model_class(getattr(transformers, class_name))
            auto_classes[auto_name].register(config_class, model_class, exist_ok=True)


def __getattr__(name: str) -> Any:
    # Lets ``auto_map`` entries such as "modeling.EABertModel" resolve without building every class.
    base = _transformers_class(name, PreTrainedModel)
    if base is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return evolving_attention_model_class(base)

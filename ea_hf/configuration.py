"""Evolving-attention settings and the config classes of EA models.

This file is copied beside the weights of every saved EA checkpoint so that it loads with
``trust_remote_code=True`` where ea_hf is not installed: it imports only torch, transformers,
huggingface_hub and sibling files of this folder (relative imports).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Mapping
from typing import Any

import transformers
from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

#: The attention kinds that carry their own residual chain: encoder self-attention, decoder self-attention
#: and encoder-decoder (cross) attention. Encoder-only models have "encoder" alone.
ATTENTION_KINDS = ("encoder", "decoder", "cross")

#: Initialisation schemes for the convolution weights (the bias always starts at zero except for
#: ``kaiming_uniform``, which is torch's own ``Conv2d`` scheme, bias included).
INIT_SCHEMES = ("kaiming_uniform", "xavier_uniform", "normal", "dirac")

#: Name of the config attribute that holds the settings, one entry per attention kind.
CONFIG_ATTRIBUTE = "evolving_attention"

#: How attention maps evolve: ``conv`` is Evolving Attention (residual mix with the previous layer's logits,
#: then a convolution); ``residual`` keeps only the residual mix (RealFormer-style, no convolution);
#: ``echo`` is echo attention (per-head gated, stateful refinements of each layer's own logits).
METHODS = ("conv", "residual", "echo")
#: Echo attention's state transition U_k(X) = a_k * X: one scale per head and step (``scalar``), or one per
#: query position (``row``) or key position (``column``), which needs ``max_positions``.
ECHO_STATES = ("scalar", "row", "column")
#: alpha and beta when not given: the papers' 0.2 where the method uses them, 0 where it does not.
METHOD_DEFAULTS = {"conv": (0.2, 0.2), "residual": (0.2, 0.0), "echo": (0.0, 0.0)}
#: Settings only echo attention uses.
ECHO_FIELDS = ("echoes", "echo_state", "max_positions")


@dataclasses.dataclass(frozen=True)
class EvolvingAttentionSettings:
    """Hyper-parameters of one residual chain of evolving attention (TPAMI 2023, section 3.1).

    Args:
        alpha: weight of the previous layer's attention logits in the residual mix, in [0, 1].
        beta: weight of the convolution branch in the output logits, in [0, 1] (0 for ``residual``).
        kernel_size: odd, positive size of the square convolution kernel over the N x N map.
        layers: indices of the layers to patch (in the stack's own numbering); ``None`` patches all.
        init: initialisation of the convolution, one of :data:`INIT_SCHEMES`.
        method: one of :data:`METHODS`. ``residual`` has no convolution (beta must be 0); ``echo`` neither
            mixes layers nor convolves (alpha and beta must be 0).
        echoes: ``echo``: the number of echo steps S.
        echo_state: ``echo``: the state transition, one of :data:`ECHO_STATES`.
        max_positions: ``echo`` with a ``row`` or ``column`` state: the longest sequence it can take.

    Example:
        >>> EvolvingAttentionSettings(alpha=0.4, beta=0.1, layers=[0, 2]).layers
        (0, 2)
        >>> EvolvingAttentionSettings(method="residual")
        Traceback (most recent call last):
        ...
        ValueError: Invalid evolving-attention settings: method 'residual' has no convolution: beta must be 0, got 0.2
    """

    alpha: float = 0.2
    beta: float = 0.2
    kernel_size: int = 3
    layers: tuple[int, ...] | None = None
    init: str = "kaiming_uniform"
    method: str = "conv"
    echoes: int = 2
    echo_state: str = "scalar"
    max_positions: int | None = None

    @classmethod
    def for_method(
        cls, method: str = "conv", alpha: float | None = None, beta: float | None = None, **fields: Any
    ) -> EvolvingAttentionSettings:
        """Settings for ``method``, with its default alpha and beta where they are not given.

        Example:
            >>> s = EvolvingAttentionSettings.for_method("residual")
            >>> s.alpha, s.beta
            (0.2, 0.0)
        """
        default_alpha, default_beta = METHOD_DEFAULTS.get(method, (0.2, 0.2))
        alpha = default_alpha if alpha is None else alpha
        beta = default_beta if beta is None else beta
        return cls(alpha=alpha, beta=beta, method=method, **fields)

    def __post_init__(self) -> None:
        problems = []
        for name in ("alpha", "beta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                problems.append(f"{name} must be a number in [0, 1], got {value!r}")
            elif not (math.isfinite(value) and 0.0 <= value <= 1.0):
                problems.append(f"{name} must be in [0, 1], got {value!r}")
        k = self.kernel_size
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0 or k % 2 == 0:
            problems.append(f"kernel_size must be a positive odd integer, got {k!r}")
        if self.layers is not None:
            layers = self.layers
            if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
                problems.append(f"layers must be a list of layer indices or None, got {layers!r}")
            else:
                layers = tuple(layers)
                bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int) or i < 0]
                if bad:
                    problems.append(f"layers must hold non-negative integers, got {bad!r}")
                elif not layers:
                    problems.append("layers must name at least one layer (use None for all layers)")
                elif len(set(layers)) != len(layers):
                    problems.append(f"layers must not repeat an index, got {list(layers)}")
                else:
                    object.__setattr__(self, "layers", tuple(sorted(layers)))
        if self.init not in INIT_SCHEMES:
            problems.append(f"init must be one of {', '.join(INIT_SCHEMES)}, got {self.init!r}")
        problems += self._method_problems()
        if problems:
            raise ValueError("Invalid evolving-attention settings: " + "; ".join(problems))
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "beta", float(self.beta))

    def _method_problems(self) -> list[str]:
        if self.method not in METHODS:
            return [f"method must be one of {', '.join(METHODS)}, got {self.method!r}"]
        problems = []
        if self.method == "residual" and self.beta != 0:
            problems.append(f"method 'residual' has no convolution: beta must be 0, got {self.beta!r}")
        if self.method == "echo":
            if self.alpha != 0 or self.beta != 0:
                problems.append(
                    f"method 'echo' refines each layer's own logits, so alpha and beta must be 0, "
                    f"got alpha={self.alpha!r}, beta={self.beta!r}"
                )
            if isinstance(self.echoes, bool) or not isinstance(self.echoes, int) or self.echoes < 1:
                problems.append(f"echoes must be a positive integer, got {self.echoes!r}")
            if self.echo_state not in ECHO_STATES:
                problems.append(f"echo_state must be one of {', '.join(ECHO_STATES)}, got {self.echo_state!r}")
            elif self.echo_state != "scalar" and not (isinstance(self.max_positions, int) and self.max_positions > 0):
                problems.append(f"echo_state {self.echo_state!r} needs max_positions, got {self.max_positions!r}")
        return problems

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, as stored in ``config.json``."""
        data = dataclasses.asdict(self)
        data["layers"] = None if self.layers is None else list(self.layers)
        if self.method != "echo":  # the echo fields mean nothing to the other methods
            for name in ECHO_FIELDS:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EvolvingAttentionSettings:
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Unknown evolving-attention setting(s) {unknown}; expected a subset of {sorted(known)}")
        return cls(**data)


def default_settings(
    kinds: list[str] | tuple[str, ...], encoder: EvolvingAttentionSettings | None = None
) -> dict[str, EvolvingAttentionSettings]:
    """The papers' defaults for the attention ``kinds`` of a model, derived from the encoder's settings.

    On machine translation the papers use the residual (skip) connection only in the encoder, so the decoder
    and cross chains start with alpha = 0 and otherwise share the encoder's beta, kernel and init (all layers).

    Example:
        >>> default_settings(["encoder", "cross"])["cross"].alpha
        0.0
    """
    encoder = encoder or EvolvingAttentionSettings()
    return {
        kind: encoder if kind == "encoder" else dataclasses.replace(encoder, alpha=0.0, layers=None)
        for kind in ATTENTION_KINDS
        if kind in kinds
    }


def settings_from_config(config: PreTrainedConfig) -> dict[str, EvolvingAttentionSettings] | None:
    """Read the per-kind settings stored in an EA config (``config.evolving_attention``); None if unset."""
    stored = getattr(config, CONFIG_ATTRIBUTE, None)
    if stored is None:
        return None
    if not isinstance(stored, Mapping):
        raise ValueError(f"config.{CONFIG_ATTRIBUTE} must be a mapping of attention kind to settings")
    unknown = sorted(set(stored) - set(ATTENTION_KINDS))
    if unknown:
        raise ValueError(
            f"config.{CONFIG_ATTRIBUTE} names unknown attention kind(s) {unknown}; known: {list(ATTENTION_KINDS)}"
        )
    return {kind: EvolvingAttentionSettings.from_dict(value) for kind, value in stored.items()}


# --------------------------------------------------------------------------------------------------
# EA config classes: one subclass per supported transformers config class, made on demand.
# --------------------------------------------------------------------------------------------------

EA_PREFIX = "EA"
_class_lock = threading.RLock()
_config_classes: dict[type, type] = {}


def ea_model_type(base_model_type: str) -> str:
    return f"ea-{base_model_type}"


def cached_ea_class(base: type, cache: dict[type, type], build: Callable[[str], type]) -> type:
    """Return ``cache[base]``, building the EA class ``EA<base>`` once (thread-safe); EA classes map to themselves."""
    if getattr(base, "evolving_attention_base", None) is not None:
        return base
    with _class_lock:
        if base not in cache:
            cache[base] = build(EA_PREFIX + base.__name__)
        return cache[base]


def evolving_attention_config_class(base: type[PreTrainedConfig]) -> type[PreTrainedConfig]:
    """The EA config class for a transformers config class (``BertConfig`` -> ``EABertConfig``).

    The subclass adds the ``evolving_attention`` field and a distinct ``model_type`` (``ea-bert``);
    everything else is the base config.

    Example:
        >>> from transformers import BertConfig
        >>> evolving_attention_config_class(BertConfig).model_type
        'ea-bert'
    """

    def build(name: str) -> type[PreTrainedConfig]:
        namespace = {
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"{base.__name__} with Evolving Attention settings (``{CONFIG_ATTRIBUTE}``).",
            "__annotations__": {CONFIG_ATTRIBUTE: dict | None},
            CONFIG_ATTRIBUTE: None,
            "model_type": ea_model_type(base.model_type),
            "evolving_attention_base": base,
        }
        cls = strict(type(name, (base,), namespace))
        cls._auto_class = "AutoConfig"
        return cls

    return cached_ea_class(base, _config_classes, build)


def _transformers_class(ea_name: str, kind: type) -> type | None:
    """Resolve ``EA<Name>`` to the transformers class ``<Name>`` if it is a subclass of ``kind``."""
    if not ea_name.startswith(EA_PREFIX):
        return None
    try:
        base = getattr(transformers, ea_name[len(EA_PREFIX) :])
    except (AttributeError, ImportError):
        return None
    return base if isinstance(base, type) and issubclass(base, kind) else None


def __getattr__(name: str) -> Any:
    # Lets ``auto_map`` entries such as "configuration.EABertConfig" resolve without building every class.
    base = _transformers_class(name, PreTrainedConfig)
    if base is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return evolving_attention_config_class(base)

"""Evolving-attention settings: the one definition of every setting, its default, its validation and the
per-role defaults. ``ea_hf.patch``, recipes (``ea:``), the ``ea-hf patch`` flags and model cards derive from
:class:`EvolvingAttentionSettings`; a field added here appears in all of them.

This file is copied beside the weights of saved EA checkpoints (``trust_remote_code``): it imports only torch,
transformers and sibling files (single-dot relative imports).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the ea-hf command builds its options from this file without transformers
    from transformers import PreTrainedConfig

#: The roles attention plays in a model, each with its own residual chain of logits and its own settings:
#: encoder self-attention, decoder self-attention and encoder-decoder (cross) attention. Encoder-only models
#: have "encoder" alone.
ATTENTION_ROLES = ("encoder", "decoder", "cross")
#: Roles whose convolution is causal: decoder self-attention and encoder-decoder (cross) attention.
CAUSAL_ROLES = ("decoder", "cross")
#: Settings whose default depends on the method (see :data:`METHOD_DEFAULTS`): ``None`` asks for it.
METHOD_DEPENDENT = ("alpha", "beta")

#: Initialisation schemes for the convolution weights (the bias always starts at zero except for
#: ``kaiming_uniform``, which is torch's own ``Conv2d`` scheme, bias included).
INIT_SCHEMES = ("kaiming_uniform", "xavier_uniform", "normal", "dirac")

#: Name of the config attribute that holds the settings, one entry per attention role.
CONFIG_ATTRIBUTE = "evolving_attention"

#: How attention maps evolve: ``conv`` is Evolving Attention (residual mix with the previous layer's logits,
#: then a convolution); ``linear`` is the same with a linear convolution branch (no ReLU), started by default as
#: the identity (``dirac``), so that it changes nothing at its start for any alpha and beta; ``residual`` keeps
#: only the residual mix (RealFormer-style, no convolution); ``echo`` is echo attention (per-head gated,
#: stateful refinements of each layer's own logits).
METHODS = ("conv", "residual", "echo", "linear")
#: Methods with a convolution branch (weights, ``kernel_size`` and ``init``).
CONVOLUTION_METHODS = ("conv", "linear")
#: How alpha and beta are set: ``fixed`` (plain numbers, the papers' way) or ``learned`` (one parameter each per
#: layer, started at the settings' alpha and beta, which default to 0 then: the checkpoint exactly).
GATES = ("fixed", "learned")
#: Echo attention's state transition U_k(X) = a_k * X: one scale per head and step (``scalar``), or one per
#: query position (``row``) or key position (``column``), which needs ``max_positions``.
ECHO_STATES = ("scalar", "row", "column")
#: alpha and beta when not given: the papers' 0.2 where the method uses them, 0 where it does not; ``linear``
#: mixes in no previous layer by default (alpha 0), so that with its identity start it changes nothing at first.
METHOD_DEFAULTS = {"conv": (0.2, 0.2), "residual": (0.2, 0.0), "echo": (0.0, 0.0), "linear": (0.0, 0.2)}
#: Settings only echo attention uses.
ECHO_FIELDS = ("echoes", "echo_state", "max_positions")
#: Settings of the convolution, which residual and echo attention do not have.
CONVOLUTION_FIELDS = ("kernel_size", "init")


def unused_fields(method: str) -> tuple[str, ...]:
    """The settings that mean nothing to ``method`` (stored or not, they change nothing).

    Example:
        >>> unused_fields("residual")
        ('kernel_size', 'init', 'echoes', 'echo_state', 'max_positions')
    """
    return (() if method in CONVOLUTION_METHODS else CONVOLUTION_FIELDS) + (() if method == "echo" else ECHO_FIELDS)


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
            mixes layers nor convolves (alpha and beta must be 0); ``linear`` drops the ReLU of ``conv``'s branch.
        gates: one of :data:`GATES`. ``learned`` makes alpha and beta parameters of each layer, started at the
            values given here (``for_method``'s default for them is then 0: step 0 is the checkpoint exactly;
            beta keeps the linear method's 0.2 with its identity start, which is exact for any beta).
        echoes: ``echo``: the number of echo steps S.
        echo_state: ``echo``: the state transition, one of :data:`ECHO_STATES`.
        max_positions: ``echo`` with a ``row`` or ``column`` state: the longest sequence it can take.

    Raises:
        ValueError: a setting out of range or not allowed by the method, every problem named at once.

    Example:
        >>> EvolvingAttentionSettings(alpha=0.4, beta=0.1, layers=[0, 2]).layers
        (0, 2)
        >>> EvolvingAttentionSettings(method="residual")
        Traceback (most recent call last):
        ...
        ValueError: Invalid evolving-attention settings: method 'residual' has no convolution: beta must be 0, got 0.2
    """

    alpha: float = dataclasses.field(default=0.2, metadata={"help": "weight of the previous layer's logits, in [0, 1]"})
    beta: float = dataclasses.field(default=0.2, metadata={"help": "weight of the convolution branch, in [0, 1]"})
    kernel_size: int = dataclasses.field(default=3, metadata={"help": "odd convolution kernel size"})
    layers: tuple[int, ...] | None = dataclasses.field(
        default=None, metadata={"help": "indices of the layers to patch", "unset": "all"}
    )
    init: str = dataclasses.field(
        default="kaiming_uniform", metadata={"help": "convolution init scheme", "choices": INIT_SCHEMES}
    )
    method: str = dataclasses.field(
        default="conv",
        metadata={
            "help": "conv (Evolving Attention), residual (no convolution) or echo (echo attention)",
            "choices": METHODS,
        },
    )
    echoes: int = dataclasses.field(default=2, metadata={"help": "echo: number of echo steps"})
    echo_state: str = dataclasses.field(
        default="scalar", metadata={"help": "echo: state transition", "choices": ECHO_STATES}
    )
    max_positions: int | None = dataclasses.field(
        default=None, metadata={"help": "echo: longest sequence of a row or column state"}
    )
    gates: str = dataclasses.field(
        default="fixed", metadata={"help": "fixed alpha and beta, or learned per layer from them", "choices": GATES}
    )

    @classmethod
    def for_method(
        cls, method: str = "conv", alpha: float | None = None, beta: float | None = None, **fields: Any
    ) -> EvolvingAttentionSettings:
        """Settings for ``method``, with its default alpha and beta where they are not given.

        Args:
            method: one of :data:`METHODS`.
            alpha: the residual weight; None: the method's default (0.2; 0 for ``echo`` and ``linear``; 0 with learned
                gates).
            beta: the convolution's weight; None: the method's default (0.2; 0 for ``residual`` and ``echo``; 0
                with learned gates).
            **fields: the other fields, by name (``init``, where not given, is ``dirac`` for ``linear``).

        Returns:
            The settings.

        Raises:
            ValueError: a setting out of range or not allowed by the method.

        Example:
            >>> s = EvolvingAttentionSettings.for_method("residual")
            >>> s.alpha, s.beta
            (0.2, 0.0)
            >>> s = EvolvingAttentionSettings.for_method("linear", gates="learned")
            >>> s.alpha, s.beta, s.init
            (0.0, 0.2, 'dirac')
        """
        default_alpha, default_beta = METHOD_DEFAULTS.get(method, (0.2, 0.2))
        if method == "linear" and "init" not in fields:  # the identity start
            fields["init"] = "dirac"
        if fields.get("gates") == "learned":
            # Started where the layer computes the checkpoint: alpha 0, and beta 0 unless the convolution branch
            # starts as the identity (the linear method's dirac start, exact for any beta). There beta keeps the
            # method's default: at 0 neither beta (its gradient reads Conv(A_in) - A_in = 0) nor the kernel
            # (scaled by beta) would ever move.
            default_alpha = 0.0
            if not (method == "linear" and fields["init"] == "dirac"):
                default_beta = 0.0
        alpha = default_alpha if alpha is None else alpha
        beta = default_beta if beta is None else beta
        return cls(alpha=alpha, beta=beta, method=method, **fields)

    @classmethod
    def from_authors_code(cls, alpha: float, beta: float, **fields: Any) -> EvolvingAttentionSettings:
        """Settings from the ``alpha`` and ``beta`` of the authors' released code (pkuyym/EvolvingAttention: the
        TF EA-ResNet and the PyTorch EA-DC-Transformer), which names them the other way round from the TPAMI
        paper's equations that ea_hf follows: there ``beta`` mixes in the previous layer's map
        (``(1 - beta) * logits + beta * prev``) and ``alpha`` weighs the convolution branch
        (``alpha * conv + (1 - alpha) * mixed``). So their ``beta`` is ea_hf's ``alpha`` and their ``alpha`` is
        ea_hf's ``beta``.

        Args:
            alpha: the authors' ``alpha``: the convolution branch's weight (ea_hf's ``beta``).
            beta: the authors' ``beta``: the previous layer's weight (ea_hf's ``alpha``).
            **fields: the other fields, by name.

        Returns:
            The settings, in ea_hf's naming.

        Example:
            >>> s = EvolvingAttentionSettings.from_authors_code(alpha=0.9, beta=0.1)  # their naming
            >>> s.alpha, s.beta  # the paper's (and ea_hf's) naming
            (0.1, 0.9)
        """
        return cls.for_method("conv", alpha=beta, beta=alpha, **fields)

    @classmethod
    def from_arguments(cls, *args: Any, **fields: Any) -> EvolvingAttentionSettings:
        """Settings from arguments in field order (``alpha, beta, kernel_size, layers, init, ...``) and by
        name, as :func:`ea_hf.patch` takes them; ``None`` for a method-dependent field means its default.

        Args:
            *args: fields in order.
            **fields: fields by name.

        Returns:
            The settings.

        Raises:
            TypeError: more arguments than fields, a field given twice, or an unknown field.
            ValueError: a setting out of range or not allowed by the method.

        Example:
            >>> EvolvingAttentionSettings.from_arguments(0.4, None, 5, method="conv").kernel_size
            5
        """
        names = [field.name for field in dataclasses.fields(cls)]
        if len(args) > len(names):
            raise TypeError(f"at most {len(names)} settings by position ({', '.join(names)}), got {len(args)}")
        given = dict(zip(names, args, strict=False))
        twice = sorted(set(given) & set(fields))
        unknown = sorted(set(fields) - set(names))
        if twice or unknown:
            raise TypeError(
                f"evolving-attention settings given twice: {twice}"
                if twice
                else f"unknown evolving-attention setting(s) {unknown}; expected a subset of {names}"
            )
        given |= fields
        method = given.pop("method", cls.__dataclass_fields__["method"].default)
        return cls.for_method(method, given.pop("alpha", None), given.pop("beta", None), **given)

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
        if self.gates == "learned" and self.method == "linear" and self.init == "dirac" and self.beta == 0:
            warnings.warn(
                "learned gates with the linear method's identity start and beta = 0 never move beta or the kernel "
                "(neither has a gradient there); start beta above 0, which the identity start keeps exact",
                stacklevel=3,
            )
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "beta", float(self.beta))

    def _method_problems(self) -> list[str]:
        if self.method not in METHODS:
            return [f"method must be one of {', '.join(METHODS)}, got {self.method!r}"]
        problems = []
        if self.gates not in GATES:
            problems.append(f"gates must be one of {', '.join(GATES)}, got {self.gates!r}")
        elif self.gates == "learned" and self.method == "echo":
            problems.append("method 'echo' has no alpha and beta to learn: gates must be 'fixed'")
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
        """JSON-ready form, as stored in ``config.json``.

        Returns:
            The fields by name (``layers`` a list; the echo fields only for ``echo``; ``gates`` only where
            learned, so that fixed settings read as before).
        """
        data = dataclasses.asdict(self)
        data["layers"] = None if self.layers is None else list(self.layers)
        if self.method != "echo":  # the echo fields mean nothing to the other methods
            for name in ECHO_FIELDS:
                del data[name]
        if self.gates == "fixed":
            del data["gates"]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EvolvingAttentionSettings:
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Unknown evolving-attention setting(s) {unknown}; expected a subset of {sorted(known)}")
        return cls(**data)


def default_settings(
    roles: list[str] | tuple[str, ...], encoder: EvolvingAttentionSettings | None = None
) -> dict[str, EvolvingAttentionSettings]:
    """The papers' defaults for the attention ``roles`` of a model, derived from the settings of its first chain
    (``encoder``: patch's own arguments).

    The first chain is the encoder's, or in a decoder-only model (no encoder role) the decoder's, and takes the
    settings as given. On machine translation the papers use the residual (skip) connection only in the
    encoder, so the decoder and cross chains of an encoder-decoder model start with alpha = 0 and otherwise
    share the encoder's beta, kernel and init (all layers).

    Example:
        >>> default_settings(["encoder", "cross"])["cross"].alpha
        0.0
        >>> default_settings(["decoder"], EvolvingAttentionSettings(alpha=0.3))["decoder"].alpha
        0.3
    """
    encoder = encoder or EvolvingAttentionSettings()
    first = next((role for role in ATTENTION_ROLES if role in roles), None)
    return {
        role: encoder if role == first else dataclasses.replace(encoder, alpha=0.0, layers=None)
        for role in ATTENTION_ROLES
        if role in roles
    }


#: How ``patch`` (and a recipe's ``ea.decoder``/``ea.cross``) configures one role: settings, a mapping of fields
#: that change the role's default, ``False`` to leave it plain, or ``None``/``True`` for the default.
RoleSettings = EvolvingAttentionSettings | Mapping[str, Any] | bool | None


def role_settings(
    roles: list[str] | tuple[str, ...], encoder: EvolvingAttentionSettings, overrides: Mapping[str, RoleSettings]
) -> tuple[dict[str, EvolvingAttentionSettings], list[tuple[str, str]]]:
    """The settings of each of ``roles``: the papers' defaults derived from the encoder's (see
    :func:`default_settings`) with ``overrides`` applied, and the (role, problem) pairs found. An override for a
    role outside ``roles`` is a problem unless it is ``False``, ``None`` or ``True``.

    The one place where per-role settings are merged: ``patch`` uses it with the roles of a model, recipe
    checks with every role.

    Example:
        >>> overrides = {"decoder": {"beta": 0.5}}
        >>> merged, problems = role_settings(["encoder", "decoder"], EvolvingAttentionSettings(), overrides)
        >>> merged["decoder"].alpha, merged["decoder"].beta, problems
        (0.0, 0.5, [])
    """
    settings = default_settings(roles, encoder)
    problems = []
    for role, override in overrides.items():
        if override is None or override is True:
            continue
        if role not in roles:
            if override is not False:
                problems.append((role, f"no {role} attention to configure"))
            continue
        if override is False:
            settings.pop(role)
        elif isinstance(override, EvolvingAttentionSettings):
            settings[role] = override
        elif isinstance(override, Mapping):
            try:
                settings[role] = EvolvingAttentionSettings.from_dict({**settings[role].to_dict(), **override})
            except ValueError as error:
                problems.append((role, str(error)))
        else:
            problems.append(
                (role, f"must be a mapping of settings, EvolvingAttentionSettings, True or False; got {override!r}")
            )
    return settings, problems


def resolve_role_settings(
    roles: list[str] | tuple[str, ...],
    encoder: EvolvingAttentionSettings,
    overrides: Mapping[str, RoleSettings],
    owner: str,
) -> dict[str, EvolvingAttentionSettings]:
    """:func:`role_settings` for a model (``owner``: its class name, for the message) that has ``roles``;
    ValueError naming every problem."""
    settings, problems = role_settings(roles, encoder, overrides)
    problems = [
        f"{owner} has no {role} attention to configure" if role not in roles else f"{role}: {text}"
        for role, text in problems
    ]
    if problems:
        raise ValueError("Cannot patch the model: " + "; ".join(problems))
    return settings


def settings_from_config(config: PreTrainedConfig) -> dict[str, EvolvingAttentionSettings] | None:
    """Read the per-role settings stored in an EA config (``config.evolving_attention``); None if unset."""
    stored = getattr(config, CONFIG_ATTRIBUTE, None)
    if stored is None:
        return None
    if not isinstance(stored, Mapping):
        raise ValueError(f"config.{CONFIG_ATTRIBUTE} must be a mapping of attention role to settings")
    unknown = sorted(set(stored) - set(ATTENTION_ROLES))
    if unknown:
        raise ValueError(
            f"config.{CONFIG_ATTRIBUTE} names unknown attention role(s) {unknown}; known: {list(ATTENTION_ROLES)}"
        )
    return {role: EvolvingAttentionSettings.from_dict(value) for role, value in stored.items()}

"""The attention-map evolution of one layer: Evolving Attention (``conv``) and its residual-only variant.

For attention layer i with H heads and pre-softmax logits S_i of shape [B, H, N, N] (scaled QK^T plus any
positional bias, no padding or causal mask), Evolving Attention (TPAMI 2023, section 3.1) computes

    A_in_i    = alpha * A_logit_(i-1) + (1 - alpha) * S_i        (A_in = S for the first layer of a chain)
    A_logit_i = beta * ReLU(Conv_i(A_in_i)) + (1 - beta) * A_in_i
    P_i       = softmax(A_logit_i + mask);   output = dropout(P_i) @ V

Conv_i is a 2-D convolution over the N x N map with the heads as channels. Entries that the mask removes,
and the rows of padded queries, are zeroed before the convolution (see ``masks.py``), so padding never
reaches a valid entry: a padded sequence sees exactly the zero border it would see alone.

Sequence-to-sequence models have three chains (TPAMI section 3.1, "Convolution Masks for Seq2Seq Models"):
encoder self-attention, decoder self-attention and encoder-decoder (cross) attention. The last two convolve
causally: their kernels keep only the rows at and above the centre, so query row i reads rows i - k//2 .. i
and nothing from a later target position. ``residual`` (RealFormer-style) keeps the first line only: no
convolution, beta = 0 and no weights.

This file is copied beside the weights of saved EA checkpoints (``trust_remote_code``): it imports only torch,
transformers and sibling files (single-dot relative imports).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn
from transformers import initialization as hf_init

from .attention_core import CoreConstants, CoreInputs, CoreMasks
from .call_state import BACKWARD_SPARES_KEY, REPLAYS_KEY, SHARED_LAYERS, SPARE_KEY
from .compiled import evolving_attention_core
from .convolution import begin_history, evolve_convolution
from .gates import GatedEvolveConvolution, convolution_branch, evolve_with_autograd, gate_value
from .history import ConvolutionHistory
from .masks import AttentionMask
from .scores import attention_scores, evolution_maps
from .settings import ATTENTION_ROLES, CAUSAL_ROLES, CONVOLUTION_METHODS, EvolvingAttentionSettings
from .step import EvolutionStep, StepMaps


class AttentionMapEvolution(nn.Module):
    """Evolves one layer's attention logits from those of the previous layer in its chain.

    The convolution weight is stored directly (not as an ``nn.Conv2d``) so that transformers' per-architecture
    weight initialisation leaves it to :meth:`reset_parameters`. It has shape [H, H, k, k]; a causal
    convolution (decoder self-attention and cross attention) only has the kernel rows at and above the centre,
    [H, H, k // 2 + 1, k], so a query row reads rows at or above it and never a later one.

    Args:
        num_heads: number of attention heads H (the convolution's channels).
        alpha: weight of the previous layer's logits (see :class:`~.settings.EvolvingAttentionSettings`).
        beta: weight of the convolution branch.
        kernel_size: size of the square convolution kernel (odd).
        init: initialisation scheme of the convolution, one of :data:`~.settings.INIT_SCHEMES`.
        role: what attention this layer is: ``"encoder"`` (self-attention), ``"decoder"`` (causal
            self-attention) or ``"cross"`` (encoder-decoder attention). The last two convolve causally.
        position: this layer's index in its stack.
        previous: index of the previous evolving layer of the same chain, ``None`` for the first one.
        method: ``"conv"``, ``"linear"`` (no ReLU in the convolution branch; it runs as torch operations, see
            :mod:`~.gates`) or ``"residual"`` (no convolution weights; :class:`~.echo.EchoAttention` is the
            ``"echo"`` method's module).
        gates: ``"fixed"`` (alpha and beta are numbers) or ``"learned"``: parameters ``alpha_gate`` and (with a
            convolution) ``beta_gate``, started at ``alpha`` and ``beta`` and clamped into [0, 1] with a
            straight-through gradient (:func:`~.gates.gate_value`); :attr:`alpha` and :attr:`beta` then read their
            current values.
        device: where the convolution weights are made.
        dtype: the convolution weights' dtype.

    Example:
        >>> evolution = AttentionMapEvolution(4, alpha=0.2, beta=0.2, kernel_size=3, position=0)
        >>> chain = {}
        >>> evolution(torch.zeros(1, 4, 5, 5), None, chain).shape
        torch.Size([1, 4, 5, 5])
        >>> AttentionMapEvolution(4, alpha=0.0, beta=0.2, kernel_size=3, role="decoder").weight.shape
        torch.Size([4, 4, 2, 3])
    """

    #: Whether a fused kernel may leave out each row's masked tail (the entries right of its last kept column):
    #: true where every layer of the chain has the same mask, so that every layer's softmax masks the entries
    #: this layer leaves out (set by :func:`~.attach.attach_evolution`). Not where local and global layers share a
    #: chain (ModernBERT): a global layer reads a local layer's logits right of its window.
    skip_masked_tails: bool = False
    #: Whether this module serves several layers of its stack (ALBERT; set by :func:`~.attach.attach_evolution`):
    #: each call then mixes in the logits of the call before it in this forward, whichever module made it.
    shared_across_layers: bool = False

    def __init__(
        self,
        num_heads: int,
        *,
        alpha: float,
        beta: float,
        kernel_size: int,
        init: str = "kaiming_uniform",
        role: str = "encoder",
        position: int = 0,
        previous: int | None = None,
        method: str = "conv",
        gates: str = "fixed",
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if role not in ATTENTION_ROLES:
            raise ValueError(f"Unknown attention role {role!r}; expected 'encoder', 'decoder' or 'cross'")
        self.num_heads = num_heads
        self.gates = gates
        self._alpha, self._beta = float(alpha), float(beta)
        self.kernel_size = kernel_size
        self.init = init
        self.role = role
        #: Whether the convolution is causal (its kernel has only the rows at and above the centre).
        self.causal = role in CAUSAL_ROLES
        self.position = position
        self.previous = previous
        self.method = method
        factory = {"device": device, "dtype": dtype}
        if gates == "learned":
            self.alpha_gate = nn.Parameter(torch.tensor(self._alpha, **factory))
            has_beta = method in CONVOLUTION_METHODS
            self.beta_gate = nn.Parameter(torch.tensor(self._beta, **factory)) if has_beta else None
        elif gates != "fixed":
            raise ValueError(f"Unknown gates {gates!r}; expected 'fixed' or 'learned'")
        if method in CONVOLUTION_METHODS:
            rows = kernel_size // 2 + 1 if self.causal else kernel_size
            self.weight = nn.Parameter(torch.empty(num_heads, num_heads, rows, kernel_size, **factory))
            self.bias = nn.Parameter(torch.empty(num_heads, **factory))
        else:  # residual attention (and echo, a subclass): no convolution
            if self.beta != 0.0:
                raise ValueError(f"method {method!r} has no convolution; beta must be 0, got {beta}")
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    @classmethod
    def from_settings(cls, settings: EvolvingAttentionSettings, num_heads: int, head_dim: int, **where: Any):
        """The module for one layer with ``settings`` (the constructor every method's module has).

        Args:
            settings: the chain's settings.
            num_heads: the layer's number of attention heads.
            head_dim: the size of a head (echo attention's states read it; this module does not).
            **where: ``role``, ``position``, ``previous``, ``device``, ``dtype``, as the constructor takes them.

        Returns:
            module (AttentionMapEvolution): its convolution initialised with ``settings.init``.
        """
        return cls(
            num_heads,
            alpha=settings.alpha,
            beta=settings.beta,
            kernel_size=settings.kernel_size,
            init=settings.init,
            method=settings.method,
            gates=settings.gates,
            **where,
        )

    @property
    def learned_gates(self) -> bool:
        """Whether alpha and beta are parameters (``gates: learned``)."""
        return self.gates == "learned"

    @property
    def alpha(self) -> float:
        """The weight of the previous layer's logits: the setting, or the learned gate's current value."""
        return self._alpha if self.gates == "fixed" else self._gate_number(self.alpha_gate, self._alpha)

    @alpha.setter
    def alpha(self, value: float) -> None:
        self._set_gate_number("alpha", value)

    @property
    def beta(self) -> float:
        """The weight of the convolution branch: the setting, or the learned gate's current value."""
        return self._beta if self.gates == "fixed" else self._gate_number(self.beta_gate, self._beta)

    @beta.setter
    def beta(self, value: float) -> None:
        self._set_gate_number("beta", value)

    def _gate_number(self, gate: torch.Tensor | None, setting: float) -> float:
        if gate is None or gate.device.type == "meta":  # no beta gate (residual), or not loaded yet
            return setting
        return float(gate.detach().clamp(0.0, 1.0))

    def _set_gate_number(self, name: str, value: float) -> None:
        if self.learned_gates:
            raise AttributeError(f"{name} is a learned gate here ({name}_gate): training sets it, not assignment")
        setattr(self, f"_{name}", float(value))

    def gate_tensors(self) -> tuple[torch.Tensor | float, torch.Tensor | float]:
        """(alpha, beta) as autograd takes them: the learned gates' clamped values (:func:`~.gates.gate_value`) as
        0-dim tensors, or the fixed numbers."""
        if not self.learned_gates:
            return self._alpha, self._beta
        beta = self._beta if self.beta_gate is None else gate_value(self.beta_gate)
        return gate_value(self.alpha_gate), beta

    @property
    def context_rows(self) -> int:
        """How many earlier rows of its input the convolution reads for one output row."""
        return self.kernel_size // 2

    @property
    def step(self) -> EvolutionStep:
        """This layer's evolution step, as the step's paths take it (built anew: alpha, beta and
        :attr:`skip_masked_tails` are plain attributes that may change)."""
        return EvolutionStep(self.alpha, self.beta, self.context_rows, self.causal, self.skip_masked_tails)

    def extra_repr(self) -> str:
        return (
            f"method={self.method!r}, heads={self.num_heads}, kernel_size={self.kernel_size}, alpha={self.alpha}, "
            f"beta={self.beta}, role={self.role!r}, position={self.position}, previous={self.previous}"
            + (", gates='learned'" if self.learned_gates else "")
        )

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise the convolution with the configured scheme from torch's RNG.

        ``kaiming_uniform`` is torch's ``nn.Conv2d`` default (weight and bias); ``xavier_uniform`` and
        ``normal`` (std 0.02) draw the weight and zero the bias; ``dirac`` starts as the identity map per head
        with a zero bias (for a causal kernel the centre is its last row). Parameters already loaded from a
        checkpoint are left alone. Learned gates start at the settings' alpha and beta.
        """
        if self.learned_gates:
            hf_init.constant_(self.alpha_gate, self._alpha)
            if self.beta_gate is not None:
                hf_init.constant_(self.beta_gate, self._beta)
        if self.weight is None:
            return
        if self.init == "kaiming_uniform":
            hf_init.kaiming_uniform_(self.weight, a=math.sqrt(5))
            bound = 1.0 / math.sqrt(self.weight[0].numel())
            hf_init.uniform_(self.bias, -bound, bound)
            return
        if self.init == "xavier_uniform":
            hf_init.xavier_uniform_(self.weight)
        elif self.init == "normal":
            hf_init.normal_(self.weight, mean=0.0, std=0.02)
        elif self.init == "dirac":
            if getattr(self.weight, "_is_hf_initialized", False):
                return
            self.weight.zero_()
            heads = torch.arange(self.num_heads)
            self.weight[heads, heads, self.context_rows, self.kernel_size // 2] = 1.0
        else:
            raise ValueError(f"Unknown init scheme {self.init!r}")
        hf_init.zeros_(self.bias)

    @property
    def key(self) -> tuple[str, int | str]:
        """Where this layer's logits wait in the chain for the next layer. Modules shared across layers use one
        entry per role, which each call reads and replaces."""
        return (self.role, SHARED_LAYERS if self.shared_across_layers else self.position)

    def convolve(self, conv_input: torch.Tensor, rows_before: int = 0, columns_before: int = 0) -> torch.Tensor:
        """ReLU(Conv(A_in)) (``linear``: Conv(A_in)) for the rows of ``conv_input`` after its first ``rows_before``
        (earlier, cached) rows and the columns after its first ``columns_before`` (keys that a sliding window's
        cache has dropped).

        ``conv_input`` must already have its masked entries zeroed; outside the map the convolution sees zeros.
        This is the plain formulation; :meth:`forward` computes the same through
        :func:`~.convolution.evolve_convolution`.
        """
        return convolution_branch(
            conv_input, self.weight, self.bias, self.context_rows, self.causal, rows_before=rows_before,
            columns_before=columns_before, relu=self.method != "linear",
        )  # fmt: skip

    def previous_logits(self, chain: dict[Any, Any] | None) -> torch.Tensor | None:
        """A_logit of the previous layer of this chain (``None`` for the first layer or when alpha is 0)."""
        if chain is None:
            raise RuntimeError(
                "Evolving attention ran outside a patched layer stack: no per-call chain was passed. "
                "Call the model (or its encoder) rather than an attention layer on its own."
            )
        # Nothing else reads an entry once its successor has (autograd keeps what it needs), so it is dropped:
        # one map per chain stays alive instead of one per layer. Gradient checkpointing replays layers, which
        # read their entries again; chains not started by `start_chain` keep them too.
        replays = torch.is_grad_enabled() and chain.get(REPLAYS_KEY, True)
        if self.shared_across_layers:
            return self.previous_call_logits(chain, replays)
        if self.previous is None:
            return None
        key = (self.role, self.previous)
        previous = chain.get(key) if replays else chain.pop(key, None)
        if previous is None:
            raise RuntimeError(
                f"Evolving attention layer {self.position} ({self.role}) expected the logits of layer "
                f"{self.previous}, which did not run in this forward call (layers skipped or reordered?)."
            )
        return previous if self.mixes_previous() else None

    def mixes_previous(self) -> bool:
        """Whether the step takes A_prev: alpha is not 0, or alpha is learned and A_prev is needed at 0 too, for
        alpha's gradient or while a graph is traced, where its value is not read (:meth:`gates_are_traced`)."""
        if self.learned_gates and (
            self.gates_are_traced() or (torch.is_grad_enabled() and self.alpha_gate.requires_grad)
        ):
            return True
        return self.alpha != 0.0

    def gates_are_traced(self) -> bool:
        """Whether learned gates are tensors of a graph being traced (``torch.compile``, ``torch.export``), whose
        values must not be read as numbers: the graph would depend on them (a data-dependent guard, which
        ``fullgraph=True`` and export refuse), and a trained gate changes every step. The step then runs as torch
        operations that take the gates as tensors (:func:`~.gates.evolve_with_autograd`)."""
        return self.learned_gates and torch.compiler.is_compiling()

    def may_convolve(self) -> bool:
        """Whether the convolution branch may change A_logit: beta is not 0, or is a learned gate being traced
        (its value not read, :meth:`gates_are_traced`)."""
        if self.gates_are_traced():
            return self.beta_gate is not None
        return self.beta != 0.0

    def record_logits(self, chain: dict[Any, Any], logits: torch.Tensor) -> None:
        """Put this layer's A_logit in ``chain`` for the next layer; in a replay, drop the entry instead.

        Gradient checkpointing replays a layer in backward, after the later layers' backward (and replays), so
        nothing reads its entry again. Recording the recomputed logits would keep the replay's graph alive
        through them, and with it the maps its core saved (A_logit and the gate), until the step ends: one map
        and a gate more per layer at the end of backward. Dropping the entry frees the original logits too.
        A replay is the second recording of a layer's logits in a chain that replays (one chain per call).
        """
        if chain.get(REPLAYS_KEY) is True and self.key in chain and not self.shared_across_layers:
            del chain[self.key]
            return
        chain[self.key] = logits

    def previous_call_logits(self, chain: dict[Any, Any], replays: bool) -> torch.Tensor | None:
        """A_logit of the previous call of a module shared across layers (``None`` for the first call)."""
        if replays:
            # A replayed call would find the logits of the stack's last call, not of the call before it.
            raise RuntimeError(
                "Evolving attention modules shared across layers cannot be replayed (gradient checkpointing): "
                "each call reads the logits of the call before it."
            )
        previous = chain.pop(self.key, None)
        return previous if self.mixes_previous() else None

    def reference(
        self,
        scores: torch.Tensor,
        conv_mask: torch.Tensor | None,
        chain: dict[Any, Any] | None,
        history: ConvolutionHistory | None = None,
    ) -> torch.Tensor:
        """The evolution written as the paper's equations, one tensor operation each (what :meth:`forward`
        must reproduce; tests and benchmarks compare against it)."""
        previous = self.previous_logits(chain)
        attention_in = scores if previous is None else self.alpha * previous + (1.0 - self.alpha) * scores
        logits = attention_in
        if self.beta != 0.0:
            conv_input = attention_in if conv_mask is None else attention_in.masked_fill(~conv_mask, 0.0)
            rows_before = columns_before = 0
            if history is not None:
                conv_input, rows_before, columns_before = history.extend(conv_input, self.context_rows)
            convolved = self.convolve(conv_input, rows_before, columns_before)
            logits = self.beta * convolved + (1.0 - self.beta) * attention_in
        self.record_logits(chain, logits)
        return logits

    def fuses_attention(self, history: ConvolutionHistory | None) -> bool:
        """Whether :meth:`attend` should run this layer's whole attention core: with autograd, a convolution and
        no earlier decoding rows (a forward pass with a fresh cache, as training with ``use_cache`` makes, has
        none). While torch.compile traces, the core is :func:`~.compiled.compiled_core`."""
        if self.method == "linear" or self.gates_are_traced():  # they run in :meth:`forward` (see :mod:`~.gates`)
            return False
        # Learned gates take the core at any value: a beta of 0 (their exact start) gets its gradient there.
        convolves = self.beta_gate is not None if self.learned_gates else self.beta != 0.0
        return convolves and (history is None or history.rows is None) and torch.is_grad_enabled()

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        conv_mask: torch.Tensor | None,
        mask: AttentionMask,
        chain: dict[Any, Any] | None,
        history: ConvolutionHistory | None = None,
        *,
        scaling: float,
        dropout: float = 0.0,
        position_bias: torch.Tensor | None = None,
        softcap: float | None = None,
        weights_read: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(output [B, H, Q, D], attention weights) of the layer from its queries, keys and values, through
        :class:`~.attention_core.EvolvingAttentionCore`, which keeps one map for backward instead of three (while
        torch.compile traces, :func:`~.compiled.compiled_core`, which keeps what the core keeps, less P on
        small maps); records A_logit in ``chain`` as :meth:`forward` does, and a fresh ``history`` its last rows.
        ``mask``: the attention mask of the softmax; ``conv_mask``: where entries may enter the convolution.
        ``dropout``: the probability (0 in eval). ``weights_read``: False where nobody reads the attention weights,
        so that a fused attention tail may take the softmax without forming them (the weights are then None)."""
        previous = self.previous_logits(chain)
        if history is not None:
            self.begin_history(history, query, key, previous, conv_mask, scaling, position_bias, softcap)
        spare_maps = chain.setdefault(BACKWARD_SPARES_KEY, {})
        step = self.step
        if self.learned_gates:  # the gates' gradients read every entry (masked tails included)
            step = dataclasses.replace(step, skip_masked_tails=False)
        constants = CoreConstants(step, scaling, softcap, dropout, spare_maps, weights_read)
        alpha, beta = self.gate_tensors() if self.learned_gates else (None, None)
        inputs = CoreInputs(query, key, value, previous, position_bias, self.weight, self.bias, alpha, beta)
        output, logits, probabilities = evolving_attention_core(constants, CoreMasks(conv_mask, mask), inputs)
        self.record_logits(chain, logits)
        return output, probabilities

    @torch.no_grad()
    def begin_history(
        self,
        history: ConvolutionHistory,
        query: torch.Tensor,
        key: torch.Tensor,
        previous: torch.Tensor | None,
        conv_mask: torch.Tensor | None,
        scaling: float,
        position_bias: torch.Tensor | None,
        softcap: float | None,
    ) -> None:
        """Record the last convolution-input rows of a first decoding step in ``history``, from the S of those
        rows alone (the whole step runs in the attention core)."""
        last = slice(max(0, query.shape[-2] - self.context_rows), None)
        if position_bias is not None and position_bias.shape[-2] > 1:
            position_bias = position_bias[..., last, :]
        scores = attention_scores(query[..., last, :], key, scaling, position_bias, softcap)
        scores = evolution_maps(scores, self.weight)
        keep = None if conv_mask is None else conv_mask.to(scores.dtype)
        if keep is not None and keep.shape[-2] > 1:
            keep = keep[..., last, :]
        previous = None if previous is None else previous[..., last, :]
        begin_history(self.step, StepMaps(scores, previous, keep), history, query.shape[-2])

    def forward(
        self,
        scores: torch.Tensor,
        conv_mask: torch.Tensor | None,
        chain: dict[Any, Any] | None,
        history: ConvolutionHistory | None = None,
        query: torch.Tensor | None = None,
        past: int = 0,
    ) -> torch.Tensor:
        """Return A_logit for this layer and record it in ``chain`` for the next layer.

        Computes :meth:`reference` with fewer passes over the [B, H, Q, K] maps: the residual mix, convolution,
        ReLU and blend run as one step (:func:`~.convolution.evolve_convolution`; beta = 0: the residual mix alone),
        which may write over ``scores`` (this function then owns it); where autograd records the step, it runs in
        :class:`~.convolution.EvolveConvolution`, which keeps only S, A_prev and the ReLU gate for backward.

        Args:
            scores: S, the layer's logits [B, H, Q, K] (positional bias included, no padding or causal mask).
                Overwritten when it does not require grad or is a non-leaf autograd result.
            conv_mask: boolean [B, 1 or H, Q, K], True where an entry may enter the convolution; None if all may.
            chain: the per-call dict of previous layers' logits.
            history: for incremental decoding, the earlier rows of this layer's convolution input.
            query: the layer's queries [B, H, Q, D]; only echo attention reads them.
            past: the number of earlier (cached) query positions; only echo attention reads them.

        Returns:
            A_logit, the evolved logits [B, H, Q, K].
        """
        if self.method == "linear" or (self.learned_gates and (torch.is_grad_enabled() or self.gates_are_traced())):
            return self.gated_forward(scores, conv_mask, chain, history)
        if history is not None and history.rows is not None and torch.is_grad_enabled():
            # Later decoding steps with autograd on (not what generate does): the plain formulation carries
            # gradients through the kept rows of earlier steps.
            return self.reference(scores, conv_mask, chain, history)
        previous = self.previous_logits(chain)
        if self.beta == 0.0:
            logits = scores if previous is None else scores.lerp_(previous, self.alpha)
        else:
            keep = None if conv_mask is None else conv_mask.to(scores.dtype)
            logits = evolve_convolution(self.step, StepMaps(scores, previous, keep), self.weight, self.bias, history)
        if previous is not None and not torch.is_grad_enabled():
            chain[SPARE_KEY] = previous
        self.record_logits(chain, logits)
        return logits

    def gated_forward(
        self,
        scores: torch.Tensor,
        conv_mask: torch.Tensor | None,
        chain: dict[Any, Any] | None,
        history: ConvolutionHistory | None = None,
    ) -> torch.Tensor:
        """:meth:`forward` of the ``linear`` method and of learned gates with autograd: A_logit from the gates'
        tensors (see :mod:`~.gates`). Learned gates on ``conv`` run the step's kernels
        (:class:`~.gates.GatedEvolveConvolution`) where no earlier decoding rows are kept and the gates are not
        traced (:meth:`gates_are_traced`); the rest runs as torch operations (:func:`~.gates.evolve_with_autograd`)."""
        previous = self.previous_logits(chain)
        keep = None if conv_mask is None else conv_mask.to(scores.dtype)
        maps = StepMaps(scores, previous, keep)
        alpha, beta = self.gate_tensors()
        if self.gates_are_traced():
            # The step's alpha and beta are not read here (the gates' tensors are): the settings stand in.
            step = EvolutionStep(self._alpha, self._beta, self.context_rows, self.causal)
            logits = evolve_with_autograd(
                alpha, beta, maps, self.weight, self.bias, step, linear=self.method == "linear", history=history
            )
            self.record_logits(chain, logits)
            return logits
        numbers = [float(g.detach()) if isinstance(g, torch.Tensor) else g for g in (alpha, beta)]
        step = EvolutionStep(*numbers, self.context_rows, self.causal)
        if history is not None and history.rows is None and self.weight is not None:
            begin_history(step, maps, history)  # a first decoding step: like an uncached forward
            history = None
        if self.method == "conv" and history is None:
            logits = GatedEvolveConvolution.apply(step, scores, previous, keep, self.weight, self.bias, alpha, beta)
        else:
            logits = evolve_with_autograd(
                alpha, beta, maps, self.weight, self.bias, step, linear=self.method == "linear", history=history
            )
        self.record_logits(chain, logits)
        return logits

"""The evolving attention function, its mask function and the per-layer attention-map evolution.

For attention layer i with H heads and pre-softmax logits S_i of shape [B, H, N, N] (scaled QK^T plus any
positional bias, no padding or causal mask), Evolving Attention (TPAMI 2023, section 3.1) computes

    A_in_i    = alpha * A_logit_(i-1) + (1 - alpha) * S_i        (A_in = S for the first layer of a chain)
    A_logit_i = beta * ReLU(Conv_i(A_in_i)) + (1 - beta) * A_in_i
    P_i       = softmax(A_logit_i + mask);   output = dropout(P_i) @ V

Conv_i is a 2-D convolution over the N x N map with the heads as channels. Entries that the mask removes,
and the rows of padded queries, are zeroed before the convolution, so padding never reaches a valid entry:
a padded sequence sees exactly the zero border it would see alone.

Sequence-to-sequence models have three chains (TPAMI section 3.1, "Convolution Masks for Seq2Seq Models"):
encoder self-attention, decoder self-attention and encoder-decoder (cross) attention. The last two convolve
causally: their kernels keep only the rows at and above the centre, so query row i reads rows i - k//2 .. i
and nothing from a later target position; in decoder self-attention the future (masked) entries are zero
anyway, and cross attention reads every (non-padding) source column. When ``generate`` decodes step by step
with a KV cache, the earlier rows each causal convolution needs are kept on the cache object
(:class:`ConvolutionHistory`) and reordered with it in beam search.

A_logit_i reaches layer i+1 through a dict that lives for one forward call of the layer stack: a forward
pre-hook on the stack puts a fresh dict into the keyword arguments that transformers hands down to every
attention call. Nothing is kept on the modules, so concurrent calls are independent, and gradient
checkpointing (non-reentrant) replays a layer against the very tensors of the original call.

Variants (``method`` in the settings): ``residual`` keeps the first line only (no convolution: beta = 0 and
no weights, RealFormer-style); ``echo`` is echo attention (Tay et al., "Echo-Attention: Attend Once and Get N
Attentions for Free", section 2.2), which refines each layer's own logits E_0 = S_i in S steps

    P_k = sigmoid(Q_i w_k + b_k)                       (one gate per head and query token)
    E_k = P_k * U_k((1 - P_(k-1)) * E_(k-1)),  U_k(X) = a_k * X,  P_0 = 0
    A_logit_i = E_0 + E_1 + ... + E_S

with a_k one scale per head (``scalar``) or per query/key position (``row``/``column``); a_k starts at 0,
so a freshly patched echo model computes what the original does.

This file is copied beside the weights of saved EA checkpoints (see ``configuration.py``).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers import initialization as hf_init
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

try:  # absolute, so that the copy saved beside remote-code checkpoints works without ea_hf (torch operations)
    from ea_hf import kernels
except ImportError:
    kernels = None

#: Name under which the attention function and its mask function are registered in transformers.
ATTENTION_IMPLEMENTATION = "evolving_attention"
#: Keyword argument that carries the per-call chain of attention logits down to the attention calls.
CHAIN_KWARG = "evolving_attention_chain"
#: Attribute of a patched attention module that holds its :class:`AttentionMapEvolution`.
MODULE_ATTRIBUTE = "evolving_attention"
#: Keyword argument that carries the KV cache (if any) down to the attention calls of causal layers.
CACHE_KWARG = "evolving_attention_cache"
#: Attribute of a transformers ``Cache`` object under which the convolution histories of its model are kept.
CACHE_ATTRIBUTE = "evolving_attention_histories"
#: Attention kinds whose convolution is causal: decoder self-attention and encoder-decoder (cross) attention.
CAUSAL_KINDS = ("decoder", "cross")
#: Chain entry with the decoder's real (non-padding) query rows, for the cross-attention convolution.
DECODER_ROWS_KEY = "decoder_rows"
#: Chain entry that says whether layers of the stack may be replayed (gradient checkpointing).
REPLAYS_KEY = "replays"
#: Chain entry with the previous layer's logits once consumed without autograd: the attention function may
#: write this layer's probabilities into them instead of allocating a new map.
SPARE_KEY = "spare"
#: Additive float masks at or below this value count as "masked" when deciding what the convolution sees.
MASKED_LOGIT_THRESHOLD = -1e4


class AttentionMapEvolution(nn.Module):
    """Evolves one layer's attention logits from those of the previous layer in its chain.

    The convolution weight is stored directly (not as an ``nn.Conv2d``) so that transformers' per-architecture
    weight initialisation leaves it to :meth:`reset_parameters`. It has shape [H, H, k, k]; a causal
    convolution (decoder self-attention and cross attention) only has the kernel rows at and above the centre,
    [H, H, k // 2 + 1, k], so a query row reads rows at or above it and never a later one.

    Args:
        num_heads: number of attention heads H (the convolution's channels).
        alpha, beta, kernel_size, init: see :class:`~ea_hf.configuration.EvolvingAttentionSettings`.
        kind: the chain this layer belongs to: ``"encoder"`` (self-attention), ``"decoder"`` (causal
            self-attention) or ``"cross"`` (encoder-decoder attention). The last two convolve causally.
        position: this layer's index in its stack.
        previous: index of the previous evolving layer of the same chain, ``None`` for the first one.

    Example:
        >>> evolution = AttentionMapEvolution(4, alpha=0.2, beta=0.2, kernel_size=3, position=0)
        >>> chain = {}
        >>> evolution(torch.zeros(1, 4, 5, 5), None, chain).shape
        torch.Size([1, 4, 5, 5])
        >>> AttentionMapEvolution(4, alpha=0.0, beta=0.2, kernel_size=3, kind="decoder").weight.shape
        torch.Size([4, 4, 2, 3])
    """

    def __init__(
        self,
        num_heads: int,
        *,
        alpha: float,
        beta: float,
        kernel_size: int,
        init: str = "kaiming_uniform",
        kind: str = "encoder",
        position: int = 0,
        previous: int | None = None,
        method: str = "conv",
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if kind not in CAUSAL_KINDS and kind != "encoder":
            raise ValueError(f"Unknown attention kind {kind!r}; expected 'encoder', 'decoder' or 'cross'")
        self.num_heads = num_heads
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.kernel_size = kernel_size
        self.init = init
        self.kind = kind
        #: Whether the convolution is causal (its kernel has only the rows at and above the centre).
        self.causal = kind in CAUSAL_KINDS
        self.position = position
        self.previous = previous
        self.method = method
        if method == "conv":
            rows = kernel_size // 2 + 1 if self.causal else kernel_size
            factory = {"device": device, "dtype": dtype}
            self.weight = nn.Parameter(torch.empty(num_heads, num_heads, rows, kernel_size, **factory))
            self.bias = nn.Parameter(torch.empty(num_heads, **factory))
        else:  # residual attention (and echo, a subclass): no convolution
            if self.beta != 0.0:
                raise ValueError(f"method {method!r} has no convolution; beta must be 0, got {beta}")
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    @property
    def context_rows(self) -> int:
        """How many earlier rows of its input the convolution reads for one output row."""
        return self.kernel_size // 2

    def extra_repr(self) -> str:
        return (
            f"method={self.method!r}, heads={self.num_heads}, kernel_size={self.kernel_size}, alpha={self.alpha}, "
            f"beta={self.beta}, kind={self.kind!r}, position={self.position}, previous={self.previous}"
        )

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise the convolution with the configured scheme from torch's RNG.

        ``kaiming_uniform`` is torch's ``nn.Conv2d`` default (weight and bias); ``xavier_uniform`` and
        ``normal`` (std 0.02) draw the weight and zero the bias; ``dirac`` starts as the identity map per head
        with a zero bias (for a causal kernel the centre is its last row). Parameters already loaded from a
        checkpoint are left alone.
        """
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
    def key(self) -> tuple[str, int]:
        return (self.kind, self.position)

    def convolve(self, conv_input: torch.Tensor, rows_before: int = 0) -> torch.Tensor:
        """ReLU(Conv(A_in)) for the rows of ``conv_input`` after its first ``rows_before`` (earlier, cached) rows.

        ``conv_input`` must already have its masked entries zeroed; outside the map the convolution sees zeros.
        This is the plain formulation; :meth:`forward` computes the same through :class:`EvolveConvolution`.
        """
        c = self.context_rows
        if not self.causal:
            return F.relu(F.conv2d(conv_input, self.weight, self.bias, padding=c))
        # Zero rows above the first one stand for the rows that do not exist yet (or are not cached);
        # with the kernel's bottom row at the centre, output row i reads input rows i - c .. i.
        padded = F.pad(conv_input, (c, c, c - rows_before, 0))
        return F.relu(F.conv2d(padded, self.weight, self.bias))

    def previous_logits(self, chain: dict[Any, Any] | None) -> torch.Tensor | None:
        """A_logit of the previous layer of this chain (``None`` for the first layer or when alpha is 0)."""
        if chain is None:
            raise RuntimeError(
                "Evolving attention ran outside a patched layer stack: no per-call chain was passed. "
                "Call the model (or its encoder) rather than an attention layer on its own."
            )
        if self.previous is None:
            return None
        # Nothing else reads an entry once its successor has (autograd keeps what it needs), so it is dropped:
        # one map per chain stays alive instead of one per layer. Gradient checkpointing replays layers, which
        # read their entries again; chains not started by `start_chain` keep them too.
        replays = torch.is_grad_enabled() and chain.get(REPLAYS_KEY, True)
        key = (self.kind, self.previous)
        previous = chain.get(key) if replays else chain.pop(key, None)
        if previous is None:
            raise RuntimeError(
                f"Evolving attention layer {self.position} ({self.kind}) expected the logits of layer "
                f"{self.previous}, which did not run in this forward call (layers skipped or reordered?)."
            )
        return previous if self.alpha != 0.0 else None

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
            rows_before = 0
            if history is not None:
                conv_input, rows_before = history.extend(conv_input, self.context_rows)
            convolved = self.convolve(conv_input, rows_before)
            logits = self.beta * convolved + (1.0 - self.beta) * attention_in
        chain[self.key] = logits
        return logits

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

        Computes :meth:`reference` with fewer passes over the [B, H, Q, K] maps: the residual mix is done
        in place on ``scores`` (which this function then owns), and the convolution, ReLU and blend run in
        :class:`EvolveConvolution`, which keeps only its input and the ReLU output for backward.

        Args:
            scores: S, the layer's logits [B, H, Q, K] (positional bias included, no padding or causal mask).
                Overwritten when it does not require grad or is a non-leaf autograd result.
            conv_mask: boolean [B, 1 or H, Q, K], True where an entry may enter the convolution; None if all may.
            chain: the per-call dict of previous layers' logits.
            history: for incremental decoding, the earlier rows of this layer's convolution input.
            query, past: the layer's queries [B, H, Q, D] and the number of earlier (cached) query positions;
                only echo attention reads them.
        """
        if history is not None and history.rows is not None and torch.is_grad_enabled():
            # Later decoding steps with autograd on (not what generate does): the plain formulation carries
            # gradients through the kept rows of earlier steps.
            return self.reference(scores, conv_mask, chain, history)
        previous = self.previous_logits(chain)
        if self.beta == 0.0:
            logits = scores if previous is None else scores.lerp_(previous, self.alpha)
        else:
            keep = None if conv_mask is None else conv_mask.to(scores.dtype)
            logits = evolve_convolution(
                scores,
                keep,
                self.weight,
                self.bias,
                self.beta,
                self.causal,
                history,
                self.context_rows,
                previous=previous,
                alpha=self.alpha,
            )
        if previous is not None and not torch.is_grad_enabled():
            chain[SPARE_KEY] = previous
        chain[self.key] = logits
        return logits


class EvolveConvolution(torch.autograd.Function):
    """A_logit = beta * ReLU(Conv(A_in * keep)) + (1 - beta) * A_in with A_in = lerp(S, A_prev, alpha), as one
    autograd node.

    Autograd through the plain formulation keeps four [B, H, Q, K] maps per layer for backward (the masked
    input, the convolution output, the ReLU output and a blend product), runs each blend as its own pass and
    allocates a map for every partial gradient. This function scales the (tiny) weights by beta instead of the
    map and keeps only S, A_prev (alive anyway as the previous layer's output) and the ReLU gate. On CPU the
    kernels of :mod:`ea_hf.kernels` run the residual mix, mask, convolution, ReLU and blend as one pass
    forward; backward, one pass gives the gradients of S and A_prev (transposed convolution of the gated
    gradient, mask, blend, split by the residual weights) and one the weight and bias gradients, without
    materialising A_in, the gated gradient or the masked input. Elsewhere (GPU, float64, no compiler) the
    same steps run as torch operations.

    ``previous`` is A_prev (``None``: A_in = S); ``keep`` is a float 0/1 mask broadcastable to S (``None``:
    every entry enters the convolution); ``causal`` marks a kernel that has only the rows at and above its
    centre.
    """

    @staticmethod
    def forward(ctx, scores, previous, keep, weight, bias, alpha, beta, causal, context_rows):
        scaled_weight, scaled_bias = scale_kernel(weight, bias, beta, scores.dtype)
        logits, gate = evolve_step(
            scores,
            keep,
            scaled_weight,
            scaled_bias,
            beta,
            causal,
            None,
            context_rows,
            previous=previous,
            alpha=alpha,
            for_backward=True,
        )
        ctx.save_for_backward(scores, previous, gate, scaled_weight, keep)
        ctx.alpha, ctx.beta, ctx.context_rows = alpha, beta, context_rows
        return logits

    @staticmethod
    @torch.autocast("cpu", enabled=False)
    @torch.autocast("cuda", enabled=False)
    def backward(ctx, grad_logits):
        scores, previous, gate, scaled_weight, keep = ctx.saved_tensors
        alpha, beta, c = ctx.alpha, ctx.beta, ctx.context_rows
        kernel_rows, kernel_columns = scaled_weight.shape[-2:]
        # Gradients of A_in go to S and A_prev in the proportions of the residual mix.
        scales = (1.0, None) if previous is None else (1.0 - alpha, alpha)
        grad_scores = grad_previous = grad_weight = grad_bias = None
        needs_input = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        needs_kernel = ctx.needs_input_grad[3] or ctx.needs_input_grad[4]
        if kernels is not None and kernels.applicable(scores, previous, grad_logits, keep=keep, weight=scaled_weight):
            # One pass: the kernel applies the ReLU gate and the residual mix as it reads, nothing is
            # materialised but the gradients.
            grad_scores, grad_previous, grad_weight, grad_bias = kernels.backward(
                scores, previous, alpha, keep, grad_logits, gate, scaled_weight, c, beta
            )
        else:
            grad_convolved = relu_gate(grad_logits, gate)
            if needs_input:
                grad_scores, grad_previous = convolution_input_grad(
                    grad_convolved, scaled_weight, keep, grad_logits, beta, c, scales=scales
                )
            if needs_kernel:
                attention_in = scores if previous is None else torch.lerp(scores, previous, alpha)
                conv_input = attention_in if keep is None else attention_in * keep
                grad_weight = convolution_weight_grad(conv_input, grad_convolved, kernel_rows, kernel_columns, c)
                grad_bias = grad_convolved.sum((0, 2, 3))
        if grad_weight is not None:  # gradients of the beta-scaled kernel, brought back to the parameters
            grad_weight, grad_bias = beta * grad_weight, beta * grad_bias
        return grad_scores, grad_previous, None, grad_weight, grad_bias, None, None, None, None


def scale_kernel(
    weight: torch.Tensor, bias: torch.Tensor, beta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """beta * weight and beta * bias in the map's dtype: ReLU(beta * x) = beta * ReLU(x) for beta > 0, so
    the weights are scaled instead of the map (fp32 for half-precision models, see evolving_attention_forward)."""
    return weight.to(dtype) * beta, bias.to(dtype) * beta


def evolve_step(
    scores: torch.Tensor,
    keep: torch.Tensor | None,
    scaled_weight: torch.Tensor,
    scaled_bias: torch.Tensor,
    beta: float,
    causal: bool,
    history: ConvolutionHistory | None,
    context_rows: int,
    *,
    previous: torch.Tensor | None = None,
    alpha: float = 0.0,
    for_backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(A_logit, the ReLU gate for backward if ``for_backward``) for the rows of S, with beta-scaled kernel
    weights.

    A_in is S, or with ``previous`` the residual mix lerp(S, previous, alpha): the CPU kernel mixes as it
    reads; elsewhere it is computed in S's storage, or in a new tensor ``for_backward`` (which keeps S). The
    gate is the ReLU output, or for the kernel a bool map of where it is positive. Row i of a causal
    convolution reads input rows i - c .. i (c = ``context_rows``); ``history`` supplies the earlier rows of
    step-by-step decoding.
    """
    blend = 1.0 - beta
    usable = kernels is not None and kernels.applicable(scores, previous, keep=keep, weight=scaled_weight)
    if history is None and usable:
        gate = torch.empty_like(scores, dtype=torch.bool) if for_backward else None
        logits = kernels.correlate(
            scores,
            scaled_weight,
            scaled_bias,
            row_shift=-context_rows,
            lerp_end=previous,
            lerp_weight=alpha,
            in_keep=keep,
            relu=True,
            saved=gate,
            blend=scores,
            blend_coef=blend,
            in_place=not for_backward,  # without autograd S is not needed afterwards
        )
        return logits, gate
    attention_in = scores
    if previous is not None:
        attention_in = torch.lerp(scores, previous, alpha) if for_backward else scores.lerp_(previous, alpha)
    conv_input = attention_in if keep is None else attention_in * keep
    rows_before = 0
    if history is not None:
        conv_input, rows_before = history.extend(conv_input, context_rows)
    # Padding `context_rows` on both sides: a causal kernel (its last row at the centre) then produces
    # `context_rows` extra rows at the bottom, and output row i reads input rows i - c .. i. Autocast off:
    # it would convolve in half precision.
    with torch.autocast(conv_input.device.type, enabled=False):
        padding = (context_rows, scaled_weight.shape[-1] // 2)
        convolved = F.conv2d(conv_input, scaled_weight, scaled_bias, padding=padding)
    if causal:
        convolved = convolved[..., rows_before : rows_before + scores.shape[-2], :]
    convolved = convolved.relu_()
    if for_backward:
        return torch.add(convolved, attention_in, alpha=blend), convolved
    return convolved.add_(attention_in, alpha=blend), None


def convolution_input_grad(
    grad_convolved: torch.Tensor,
    scaled_weight: torch.Tensor,
    keep: torch.Tensor | None,
    grad_logits: torch.Tensor,
    beta: float,
    context_rows: int,
    scales: tuple[float, float | None] = (1.0, None),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradient of A_logit with respect to A_in: the transposed convolution of the ReLU-gated gradient
    ``grad_convolved``, masked like the forward input, plus (1 - beta) times the incoming gradient; returned
    times each of ``scales`` (the second ``None``: not needed). The CPU kernel computes the same in
    :func:`ea_hf.kernels.backward`.

    The transposed convolution is a convolution with the kernel flipped in both directions and its channels
    swapped; a causal kernel then reads rows i .. i + c (the rows whose outputs read row i).
    """
    transposed = scaled_weight.flip(-2, -1).transpose(0, 1)
    shift = scaled_weight.shape[-2] - 1 - context_rows  # c for a centred kernel, 0 for a causal one
    grad_in = F.conv2d(grad_convolved, transposed, padding=(context_rows, scaled_weight.shape[-1] // 2))
    offset = context_rows - shift
    grad_in = grad_in[..., offset : offset + grad_logits.shape[-2], :]
    if keep is not None:
        grad_in = grad_in.mul_(keep)
    grad_in = grad_in.add_(grad_logits, alpha=1.0 - beta)
    second = None if scales[1] is None else grad_in * scales[1]
    return (grad_in if scales[0] == 1.0 else grad_in.mul_(scales[0])), second


def relu_gate(grad: torch.Tensor, relu: torch.Tensor) -> torch.Tensor:
    """The gradient through the ReLU, given its output or the bool map of where that is positive."""
    if relu.dtype == torch.bool:
        return grad * relu
    return torch.ops.aten.threshold_backward(grad, relu, 0)


def evolve_convolution(
    scores: torch.Tensor,
    keep: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    beta: float,
    causal: bool = False,
    history: ConvolutionHistory | None = None,
    context_rows: int | None = None,
    *,
    previous: torch.Tensor | None = None,
    alpha: float = 0.0,
) -> torch.Tensor:
    """beta * ReLU(Conv(A_in * keep)) + (1 - beta) * A_in (see :class:`EvolveConvolution`).

    A_in is ``scores``, or with ``previous`` (the previous layer's A_logit) the residual mix
    (1 - alpha) * scores + alpha * previous; where it is materialised without autograd, it overwrites
    ``scores``. Without autograd (inference, ``generate``) nothing is kept for backward; with it, the step
    runs through :class:`EvolveConvolution`. ``context_rows`` defaults to the kernel's half width.

    Example:
        >>> a_in, weight, bias = torch.randn(1, 2, 4, 4), torch.randn(2, 2, 3, 3), torch.zeros(2)
        >>> plain = 0.5 * torch.relu(F.conv2d(a_in, weight, bias, padding=1)) + 0.5 * a_in
        >>> torch.allclose(evolve_convolution(a_in.clone(), None, weight, bias, 0.5), plain, atol=1e-6)
        True
    """
    if context_rows is None:
        context_rows = weight.shape[-1] // 2
    tensors = (scores, weight, bias, previous)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        if history is not None:  # a first decoding step with autograd on: record its rows for the next steps
            if history.rows is not None:
                raise ValueError("evolve_convolution back-propagates only through a first decoding step")
            attention_in = scores if previous is None else torch.lerp(scores, previous, alpha)
            history.extend(attention_in if keep is None else attention_in * keep, context_rows)
        return EvolveConvolution.apply(scores, previous, keep, weight, bias, alpha, beta, causal, context_rows)
    scaled_weight, scaled_bias = scale_kernel(weight, bias, beta, scores.dtype)
    logits, _ = evolve_step(
        scores, keep, scaled_weight, scaled_bias, beta, causal, history, context_rows, previous=previous, alpha=alpha
    )
    return logits


def convolution_weight_grad(
    conv_input: torch.Tensor, grad_output: torch.Tensor, kernel_rows: int, kernel_columns: int, context_rows: int
) -> torch.Tensor:
    """Weight gradient [H_out, H_in, kh, kw] of a stride-1 convolution with ``context_rows`` rows and
    kw // 2 columns of zero padding, as one batched matrix product per kernel tap over the map's rows.

    Each tap pairs the output gradient with the input shifted by the tap's offset, both cropped to where
    the shifted input exists (the zero padding contributes nothing), so no padded copy is made.
    """
    batch, heads_out, rows, width = grad_output.shape
    columns = kernel_columns // 2
    grad_weight = grad_output.new_zeros(heads_out, conv_input.shape[1], kernel_rows, kernel_columns)
    for dy in range(kernel_rows):
        shift_y = dy - context_rows  # output row i reads input row i + shift_y
        out_rows = slice(max(0, -shift_y), min(rows, conv_input.shape[-2] - shift_y))
        in_rows = slice(out_rows.start + shift_y, out_rows.stop + shift_y)
        for dx in range(kernel_columns):
            shift_x = dx - columns
            out_cols = slice(max(0, -shift_x), min(width, width - shift_x))
            in_cols = slice(out_cols.start + shift_x, out_cols.stop + shift_x)
            for b in range(batch):
                grad_rows = grad_output[b, :, out_rows, out_cols].transpose(0, 1)  # [rows, H_out, cols], a view
                input_rows = conv_input[b, :, in_rows, in_cols].transpose(0, 1)  # [rows, H_in, cols], a view
                grad_weight[:, :, dy, dx] += torch.bmm(grad_rows, input_rows.transpose(1, 2)).sum(0)
    return grad_weight


class EchoAttention(AttentionMapEvolution):
    """Echo attention (method ``echo``): S gated, stateful refinements of a layer's own logits (see the module
    docstring). Each step has a gate projection per head (``head_dim`` weights and a bias) and a state scale
    per head (``scalar``) or per head and position (``row``: query positions, ``column``: key positions, up to
    ``max_positions``). The gates depend on one query token each and the scales on one position, so nothing
    crosses from padding or future tokens into valid entries.

    Example:
        >>> echo = EchoAttention(4, head_dim=8, echoes=2, position=0)
        >>> scores, query = torch.randn(1, 4, 5, 5), torch.randn(1, 4, 5, 8)
        >>> torch.equal(echo(scores, None, {}, query=query), scores)  # the state starts at zero
        True
        >>> sum(p.numel() for p in echo.parameters())  # 2 steps x 4 heads x (8 gate weights + bias + scale)
        80
    """

    def __init__(
        self,
        num_heads: int,
        *,
        head_dim: int,
        echoes: int = 2,
        state: str = "scalar",
        max_positions: int | None = None,
        kind: str = "encoder",
        position: int = 0,
        previous: int | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            num_heads,
            alpha=0.0,
            beta=0.0,
            kernel_size=1,
            kind=kind,
            position=position,
            previous=previous,
            method="echo",
            device=device,
            dtype=dtype,
        )
        if state not in ("scalar", "row", "column"):
            raise ValueError(f"Unknown echo state {state!r}; expected 'scalar', 'row' or 'column'")
        if state != "scalar" and not max_positions:
            raise ValueError(f"echo state {state!r} needs max_positions")
        self.echoes, self.state, self.max_positions = echoes, state, max_positions
        factory = {"device": device, "dtype": dtype}
        self.gate_weight = nn.Parameter(torch.empty(echoes, num_heads, head_dim, **factory))
        self.gate_bias = nn.Parameter(torch.empty(echoes, num_heads, **factory))
        scale_shape = (echoes, num_heads) if state == "scalar" else (echoes, num_heads, max_positions)
        self.state_scale = nn.Parameter(torch.empty(scale_shape, **factory))
        self.reset_parameters()

    def extra_repr(self) -> str:
        return (
            f"method='echo', heads={self.num_heads}, echoes={self.echoes}, state={self.state!r}, "
            f"kind={self.kind!r}, position={self.position}"
        )

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Gate weights ~ N(0, 0.02), gate bias 0, state scales 0 (so the layer starts as the plain one)."""
        if not hasattr(self, "state_scale"):  # called by the base class before the echo weights exist
            return
        hf_init.normal_(self.gate_weight, mean=0.0, std=0.02)
        hf_init.zeros_(self.gate_bias)
        hf_init.zeros_(self.state_scale)

    def _scale(self, step: int, query_length: int, key_length: int, past: int) -> torch.Tensor:
        """a_k, broadcastable to [B, H, Q, K]."""
        scale = self.state_scale[step]
        if self.state == "scalar":
            return scale[:, None, None]
        positions = past + query_length if self.state == "row" else key_length
        if positions > self.max_positions:
            raise ValueError(
                f"echo attention with a {self.state} state takes at most {self.max_positions} positions, "
                f"got {positions}"
            )
        if self.state == "row":
            return scale[:, past : past + query_length, None]
        return scale[:, None, :key_length]

    def forward(
        self,
        scores: torch.Tensor,
        conv_mask: torch.Tensor | None,
        chain: dict[Any, Any] | None,
        history: ConvolutionHistory | None = None,
        query: torch.Tensor | None = None,
        past: int = 0,
    ) -> torch.Tensor:
        if query is None:
            raise RuntimeError("echo attention needs the layer's queries")
        query_length, key_length = scores.shape[-2:]
        # [S, B, H, Q, 1]: one gate per step, head and query token, shared by the whole row.
        gates = torch.sigmoid(
            torch.einsum("bhqd,shd->sbhq", query.to(scores.dtype), self.gate_weight.to(scores.dtype))
            + self.gate_bias.to(scores.dtype)[:, None, :, None]
        ).unsqueeze(-1)
        logits, echo, previous_gate = scores, scores, None
        for step in range(self.echoes):
            carried = echo if previous_gate is None else (1.0 - previous_gate) * echo
            echo = gates[step] * (self._scale(step, query_length, key_length, past) * carried)
            logits = logits + echo
            previous_gate = gates[step]
        return logits


@dataclasses.dataclass
class ConvolutionHistory:
    """The last input rows of one causal convolution, kept with a KV cache between decoding steps.

    A decoding step computes only the new query rows of the attention map, but the causal convolution of row i
    reads rows i - k // 2 .. i of its input. Those earlier rows are kept here, on the cache object that
    ``generate`` passes from step to step (see :func:`convolution_history`), and reordered with it in beam
    search (see :func:`reorder_convolution_histories`).
    """

    rows: torch.Tensor | None = None
    seen: int = 0

    def extend(self, new_rows: torch.Tensor, keep: int) -> tuple[torch.Tensor, int]:
        """Return (earlier rows + ``new_rows``, number of earlier rows) and remember the last ``keep`` rows."""
        earlier = self.rows
        if earlier is None:
            full = new_rows
        else:
            if earlier.shape[0] != new_rows.shape[0]:
                raise RuntimeError(
                    f"Evolving attention cache holds rows for batch size {earlier.shape[0]}, but the step has "
                    f"batch size {new_rows.shape[0]}; the KV cache was resized outside generate()."
                )
            # Keys added since then are later tokens, masked (zero) in the earlier rows.
            earlier = F.pad(earlier, (0, new_rows.shape[-1] - earlier.shape[-1]))
            full = torch.cat([earlier, new_rows], dim=-2)
        self.rows = full[..., full.shape[-2] - min(keep, full.shape[-2]) :, :]
        self.seen += new_rows.shape[-2]
        return full, 0 if earlier is None else earlier.shape[-2]


def convolution_history(cache: Any, key: tuple[str, int], past: int) -> ConvolutionHistory:
    """The :class:`ConvolutionHistory` of one layer, stored on the transformers ``Cache`` object itself.

    ``past`` is the number of tokens the cache held before this step; a step with no past starts afresh.
    """
    histories = cache.__dict__.setdefault(CACHE_ATTRIBUTE, {})
    history = histories.get(key)
    if past <= 0:
        history = histories[key] = ConvolutionHistory()
    elif history is None or history.seen != past:
        seen = 0 if history is None else history.seen
        raise RuntimeError(
            f"The KV cache holds {past} earlier tokens but evolving attention ({key[0]} layer {key[1]}) kept "
            f"convolution rows for {seen}. The cache was filled, cropped or reordered outside this model's "
            "forward/generate (assisted decoding and cache cropping are not supported)."
        )
    return history


def reorder_convolution_histories(cache: Any, beam_idx: torch.LongTensor) -> None:
    """Reorder the kept convolution rows along the batch like the KV cache (beam search)."""
    for history in cache.__dict__.get(CACHE_ATTRIBUTE, {}).values():
        if history.rows is not None:
            history.rows = history.rows.index_select(0, beam_idx.to(history.rows.device))


def split_attention_mask(
    attention_mask: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Return (allowed, additive): a boolean "may attend" mask and, for float masks, the values to add."""
    if attention_mask is None:
        return None, None
    if attention_mask.dtype == torch.bool:
        return attention_mask, None
    return attention_mask > MASKED_LOGIT_THRESHOLD, attention_mask


def real_query_rows(allowed: torch.Tensor, query_length: int, past: int = 0) -> torch.Tensor:
    """[B, 1 or H, Q, 1]: True for query rows of real (non-padding) tokens in self-attention.

    Queries and keys are the same tokens, query row i being key ``past + i``; a token is real exactly when it
    may attend to itself.
    """
    allowed = allowed.expand(*allowed.shape[:-2], query_length, allowed.shape[-1])
    if allowed.shape[-1] < past + query_length:
        raise NotImplementedError(
            "Evolving self-attention needs every query among the keys; "
            f"got {query_length} queries after {past} cached tokens over {allowed.shape[-1]} keys."
        )
    return torch.diagonal(allowed, offset=past, dim1=-2, dim2=-1).unsqueeze(-1)


def self_attention_conv_mask(allowed: torch.Tensor | None, query_length: int, past: int = 0) -> torch.Tensor | None:
    """Entries that may enter the convolution in self-attention: allowed ones in rows of real tokens."""
    return convolution_mask("encoder", allowed, query_length, past, {})


def convolution_mask(
    kind: str, allowed: torch.Tensor | None, query_length: int, past: int, chain: dict[Any, Any]
) -> torch.Tensor | None:
    """Which entries of the [B, H, Q, K] map the convolution of an attention ``kind`` may read.

    Self-attention zeroes masked entries and the rows of padding queries (and records the decoder's real rows
    in the chain); cross attention zeroes padded source columns and the decoder's padding rows.
    """
    if kind == "cross":
        rows = chain.get(DECODER_ROWS_KEY)
        if allowed is None:
            return rows
        return allowed if rows is None else allowed & rows
    if allowed is None:
        return None
    rows = real_query_rows(allowed, query_length, past)
    if kind == "decoder":
        chain[DECODER_ROWS_KEY] = rows
    return allowed & rows


def evolving_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    position_bias: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers attention function (``attn_implementation="evolving_attention"``).

    Attention modules without an :class:`AttentionMapEvolution` (layers or kinds left out of the patch) get
    plain eager attention, so a whole model can use this one implementation. ``position_bias`` (T5's relative
    position bias) is part of the logits S that evolve. Returns the output [B, Q, H, D] and the (evolved)
    attention probabilities [B, H, Q, K].
    """
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    if math.frexp(scaling)[0] == 0.5:
        # A power of two (1/8 for 64-dimensional heads) scales exactly: scaling the queries instead of the
        # [B, H, Q, K] product gives eager attention's numbers with one pass less over the map.
        scores = torch.matmul(query * scaling if scaling != 1.0 else query, key.transpose(-1, -2))
    else:  # in place: the product is a fresh tensor that autograd does not keep
        scores = torch.matmul(query, key.transpose(-1, -2)).mul_(scaling)
    if position_bias is not None:
        scores = scores + position_bias
    allowed, additive = split_attention_mask(attention_mask)
    evolution = getattr(module, MODULE_ATTRIBUTE, None)
    if evolution is not None:
        if scores.dtype in (torch.float16, torch.bfloat16):
            # Blends, convolution, mask and softmax in fp32: a half-precision map rounds away the small
            # residual terms, and fp16's mask value plus a negative logit overflows to -inf.
            scores = scores.float()
        chain = kwargs.get(CHAIN_KWARG)
        cache = kwargs.get(CACHE_KWARG)
        query_length = scores.shape[-2]
        past = 0 if cache is None else cache.get_seq_length() - query_length
        history = None
        if cache is not None and evolution.causal and evolution.beta != 0.0:
            history = convolution_history(cache, evolution.key, past)
        conv_mask = convolution_mask(evolution.kind, allowed, query_length, past, chain if chain is not None else {})
        scores = evolution(scores, conv_mask, chain, history, query=query, past=past)
    if additive is not None:
        scores = scores + additive
    elif allowed is not None:
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    # The spare map is passed on without a local name here: attention_probabilities counts its references.
    probs = attention_probabilities(
        scores, chain.pop(SPARE_KEY, None) if evolution is not None and chain is not None else None
    ).to(value.dtype)
    probs = F.dropout(probs, p=dropout, training=module.training)
    output = torch.matmul(probs, value).transpose(1, 2).contiguous()
    return output, probs


def attention_probabilities(scores: torch.Tensor, spare: torch.Tensor | None = None) -> torch.Tensor:
    """softmax over the keys, written into ``spare`` (a map nothing reads any more) where it fits.

    Without autograd the previous layer's logits are dead once this layer has mixed them in; reusing their
    storage spares the allocator a fresh [B, H, Q, K] map per layer, whose first touch costs page faults that
    weigh as much as the convolution on long sequences. Nothing else may hold the map: not the tensor object
    (a forward hook on the evolution module may have kept it; callers pass ``spare`` without keeping a
    reference) and not a view of its storage.
    """
    if (
        spare is not None
        and sys.getrefcount(spare) == ARGUMENT_REFERENCES
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and spare.shape == scores.shape
        and spare.dtype == scores.dtype
        and spare.device == scores.device
        and spare.is_contiguous()
        and sole_storage_user(spare)
    ):
        return torch.ops.aten._softmax.out(scores, -1, False, out=spare)
    return F.softmax(scores, dim=-1)


def argument_references(argument: Any) -> int:
    return sys.getrefcount(argument)


#: References to an argument that the caller passed without keeping it (interpreter-dependent, so measured).
ARGUMENT_REFERENCES = argument_references(object())


def sole_storage_user(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is the only tensor using its storage (no views or aliases of it exist)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    # untyped_storage() holds one more reference while it is being counted.
    return use_count is not None and tensor._base is None and use_count(tensor.untyped_storage()._cdata) == 2


def evolving_attention_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """Mask function for ``evolving_attention``: sdpa's boolean mask, never skipped for causal models.

    sdpa may drop a causal mask and rely on ``is_causal``; the convolution needs the mask to know which
    entries are future ones, so it must always be materialised. Only a full mask without any padding is
    returned as ``None``.
    """
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def start_chain(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """Forward pre-hook for a layer stack: give this call its own, empty chain of attention logits.

    The chain records whether layers of the stack may be replayed (gradient checkpointing): only then must it
    keep every layer's logits until backward.
    """
    replays = module.training and any(getattr(m, "gradient_checkpointing", False) for m in module.modules())
    kwargs[CHAIN_KWARG] = {REPLAYS_KEY: replays}
    return args, kwargs


def pass_cache(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """Forward pre-hook for a causal attention module: hand its KV cache on to the attention function.

    Attention modules consume ``past_key_values`` themselves; the convolution needs it too, to keep the
    earlier rows of its input between decoding steps.
    """
    cache = kwargs.get("past_key_values")
    if cache is not None:
        kwargs[CACHE_KWARG] = cache
    return args, kwargs


def register_attention() -> None:
    """Register the attention and mask functions with transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_IMPLEMENTATION, evolving_attention_forward)
    AttentionMaskInterface.register(ATTENTION_IMPLEMENTATION, evolving_attention_mask)


register_attention()

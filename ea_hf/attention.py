"""The evolving attention function, its mask function and the per-layer attention-map evolution.

For attention layer i with H heads and pre-softmax logits S_i of shape [B, H, N, N] (scaled QK^T plus any
positional bias, no padding or causal mask), Evolving Attention (TPAMI 2023, section 3.1) computes

    A_in_i    = alpha * A_logit_(i-1) + (1 - alpha) * S_i        (A_in = S for the first layer of a chain)
    A_logit_i = beta * ReLU(Conv_i(A_in_i)) + (1 - beta) * A_in_i
    P_i       = softmax(A_logit_i + mask);   output = dropout(P_i) @ V

Conv_i is a 2-D convolution over the N x N map with the heads as channels. Entries that the mask removes,
and the rows of padded queries, are zeroed before the convolution, so padding never reaches a valid entry:
a padded sequence sees exactly the zero border it would see alone. A causal convolution additionally drops
the kernel rows below its centre, so a query row only reads rows at or above it.

A_logit_i reaches layer i+1 through a dict that lives for one forward call of the layer stack: a forward
pre-hook on the stack puts a fresh dict into the keyword arguments that transformers hands down to every
attention call. Nothing is kept on the modules, so concurrent calls are independent, and gradient
checkpointing (non-reentrant) replays a layer against the very tensors of the original call.

This file is copied beside the weights of saved EA checkpoints (see ``configuration.py``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers import initialization as hf_init
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

#: Name under which the attention function and its mask function are registered in transformers.
ATTENTION_IMPLEMENTATION = "evolving_attention"
#: Keyword argument that carries the per-call chain of attention logits down to the attention calls.
CHAIN_KWARG = "evolving_attention_chain"
#: Attribute of a patched attention module that holds its :class:`AttentionMapEvolution`.
MODULE_ATTRIBUTE = "evolving_attention"
#: Additive float masks at or below this value count as "masked" when deciding what the convolution sees.
MASKED_LOGIT_THRESHOLD = -1e4


class AttentionMapEvolution(nn.Module):
    """Evolves one layer's attention logits from those of the previous layer in its chain.

    The convolution weight has shape [H, H, k, k] and is stored directly (not as an ``nn.Conv2d``) so that
    transformers' per-architecture weight initialisation leaves it to :meth:`reset_parameters`.

    Args:
        num_heads: number of attention heads H (the convolution's channels).
        alpha, beta, kernel_size, init: see :class:`~ea_hf.configuration.EvolvingAttentionSettings`.
        causal: mask the kernel so a query row only reads rows at or above it (decoder self-attention).
        kind: the chain this layer belongs to (``"encoder"`` for encoder self-attention).
        position: this layer's index in its stack.
        previous: index of the previous evolving layer of the same chain, ``None`` for the first one.

    Example:
        >>> evolution = AttentionMapEvolution(4, alpha=0.2, beta=0.2, kernel_size=3, position=0)
        >>> chain = {}
        >>> evolution(torch.zeros(1, 4, 5, 5), None, chain).shape
        torch.Size([1, 4, 5, 5])
    """

    def __init__(
        self,
        num_heads: int,
        *,
        alpha: float,
        beta: float,
        kernel_size: int,
        init: str = "kaiming_uniform",
        causal: bool = False,
        kind: str = "encoder",
        position: int = 0,
        previous: int | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.kernel_size = kernel_size
        self.init = init
        self.causal = causal
        self.kind = kind
        self.position = position
        self.previous = previous
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(num_heads, num_heads, kernel_size, kernel_size, **factory))
        self.bias = nn.Parameter(torch.empty(num_heads, **factory))
        if causal:
            rows = torch.arange(kernel_size, device=device).unsqueeze(1).expand(kernel_size, kernel_size)
            self.register_buffer("kernel_mask", (rows <= kernel_size // 2).to(self.weight.dtype), persistent=False)
        else:
            self.kernel_mask = None
        self.reset_parameters()

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kernel_size={self.kernel_size}, alpha={self.alpha}, beta={self.beta}, "
            f"kind={self.kind!r}, position={self.position}, previous={self.previous}, causal={self.causal}"
        )

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise the convolution with the configured scheme from torch's RNG.

        ``kaiming_uniform`` is torch's ``nn.Conv2d`` default (weight and bias); ``xavier_uniform`` and
        ``normal`` (std 0.02) draw the weight and zero the bias; ``dirac`` starts as the identity map per head
        with a zero bias. Parameters already loaded from a checkpoint are left alone.
        """
        if self.init == "kaiming_uniform":
            hf_init.kaiming_uniform_(self.weight, a=math.sqrt(5))
            bound = 1.0 / math.sqrt(self.num_heads * self.kernel_size**2)
            hf_init.uniform_(self.bias, -bound, bound)
            return
        if self.init == "xavier_uniform":
            hf_init.xavier_uniform_(self.weight)
        elif self.init == "normal":
            hf_init.normal_(self.weight, mean=0.0, std=0.02)
        elif self.init == "dirac":
            hf_init.dirac_(self.weight)
        else:
            raise ValueError(f"Unknown init scheme {self.init!r}")
        hf_init.zeros_(self.bias)

    @property
    def key(self) -> tuple[str, int]:
        return (self.kind, self.position)

    def convolve(self, attention_in: torch.Tensor, conv_mask: torch.Tensor | None) -> torch.Tensor:
        """ReLU(Conv(A_in)) with masked entries zeroed on the way in."""
        if conv_mask is not None:
            attention_in = attention_in.masked_fill(~conv_mask, 0.0)
        weight = self.weight if self.kernel_mask is None else self.weight * self.kernel_mask
        return F.relu(F.conv2d(attention_in, weight, self.bias, padding=self.kernel_size // 2))

    def forward(
        self, scores: torch.Tensor, conv_mask: torch.Tensor | None, chain: dict[Any, torch.Tensor] | None
    ) -> torch.Tensor:
        """Return A_logit for this layer and record it in ``chain`` for the next layer.

        Args:
            scores: S, the layer's logits [B, H, Q, K] without padding or causal masks.
            conv_mask: boolean [B, 1 or H, Q, K], True where an entry may enter the convolution; None if all may.
            chain: the per-call dict of previous layers' logits.
        """
        if chain is None:
            raise RuntimeError(
                "Evolving attention ran outside a patched layer stack: no per-call chain was passed. "
                "Call the model (or its encoder) rather than an attention layer on its own."
            )
        attention_in = scores
        if self.previous is not None:
            previous = chain.get((self.kind, self.previous))
            if previous is None:
                raise RuntimeError(
                    f"Evolving attention layer {self.position} ({self.kind}) expected the logits of layer "
                    f"{self.previous}, which did not run in this forward call (layers skipped or reordered?)."
                )
            if self.alpha != 0.0:
                attention_in = self.alpha * previous + (1.0 - self.alpha) * scores
        logits = attention_in
        if self.beta != 0.0:
            logits = self.beta * self.convolve(attention_in, conv_mask) + (1.0 - self.beta) * attention_in
        chain[self.key] = logits
        return logits


def split_attention_mask(
    attention_mask: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Return (allowed, additive): a boolean "may attend" mask and, for float masks, the values to add."""
    if attention_mask is None:
        return None, None
    if attention_mask.dtype == torch.bool:
        return attention_mask, None
    return attention_mask > MASKED_LOGIT_THRESHOLD, attention_mask


def self_attention_conv_mask(allowed: torch.Tensor | None, query_length: int) -> torch.Tensor | None:
    """Entries that may enter the convolution in self-attention: allowed ones in rows of real tokens.

    In self-attention queries and keys are the same tokens, so a query is a real (non-padding) token
    exactly when some query may attend to it as a key.
    """
    if allowed is None:
        return None
    if allowed.shape[-1] != query_length:
        raise NotImplementedError(
            "Evolving self-attention needs the full attention map (queries == keys); "
            f"got {query_length} queries over {allowed.shape[-1]} keys (a KV cache?)."
        )
    real_tokens = allowed.any(dim=-2, keepdim=True)
    return allowed & real_tokens.transpose(-1, -2)


def evolving_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers attention function (``attn_implementation="evolving_attention"``).

    Attention modules without an :class:`AttentionMapEvolution` (layers left out of the patch, cross
    attention) get plain eager attention, so a whole model can use this one implementation.
    Returns the output [B, N, H, D] and the (evolved) attention probabilities [B, H, N, N].
    """
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    allowed, additive = split_attention_mask(attention_mask)
    evolution = getattr(module, MODULE_ATTRIBUTE, None)
    if evolution is not None:
        conv_mask = self_attention_conv_mask(allowed, scores.shape[-2])
        scores = evolution(scores, conv_mask, kwargs.get(CHAIN_KWARG))
    if additive is not None:
        scores = scores + additive
    elif allowed is not None:
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = F.softmax(scores, dim=-1)
    probs = F.dropout(probs, p=dropout, training=module.training)
    output = torch.matmul(probs, value).transpose(1, 2).contiguous()
    return output, probs


def evolving_attention_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """Mask function for ``evolving_attention``: sdpa's boolean mask, never skipped for causal models.

    sdpa may drop a causal mask and rely on ``is_causal``; the convolution needs the mask to know which
    entries are future ones, so it must always be materialised. Only a full mask without any padding is
    returned as ``None``.
    """
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def start_chain(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """Forward pre-hook for a layer stack: give this call its own, empty chain of attention logits."""
    kwargs[CHAIN_KWARG] = {}
    return args, kwargs


def register_attention() -> None:
    """Register the attention and mask functions with transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_IMPLEMENTATION, evolving_attention_forward)
    AttentionMaskInterface.register(ATTENTION_IMPLEMENTATION, evolving_attention_mask)


register_attention()

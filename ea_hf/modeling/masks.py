"""Masks: which entries of an attention map the convolution may read, and the mask function of the attention
implementation.

This file is copied beside the weights of saved EA checkpoints (``trust_remote_code``): it imports only torch,
transformers and sibling files (single-dot relative imports).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from transformers.masking_utils import sdpa_mask

from .call_state import DECODER_ROWS_KEY

#: Additive float masks at or below this value count as "masked" when deciding what the convolution sees.
MASKED_LOGIT_THRESHOLD = -1e4


class AttentionMask(NamedTuple):
    """The attention mask as the attention paths apply it: ``allowed``, a bool "may attend" mask, and for float
    masks ``additive``, the values to add (which the softmax then reads instead). Both broadcast to the
    [B, H, Q, K] maps; both ``None``: no mask."""

    allowed: torch.Tensor | None = None
    additive: torch.Tensor | None = None


def split_attention_mask(attention_mask: torch.Tensor | None) -> AttentionMask:
    """The :class:`AttentionMask` of transformers' mask: a bool mask as it is, a float one as what it allows and
    the values it adds.

    Example:
        >>> split_attention_mask(torch.tensor([0.0, -1e9])).allowed
        tensor([ True, False])
    """
    if attention_mask is None:
        return AttentionMask()
    if attention_mask.dtype == torch.bool:
        return AttentionMask(attention_mask)
    return AttentionMask(attention_mask > MASKED_LOGIT_THRESHOLD, attention_mask)


def first_key_position(query_length: int, key_length: int, past: int | torch.Tensor) -> int | torch.Tensor:
    """The position in the sequence of the first key of a self-attention map (a tensor where ``past`` is one).

    Every KV cache hands attention the keys in order, ending with the newest query's: all of them (dynamic
    caches), a static buffer whose unfilled tail the mask removes (static caches, first key 0), or only the
    last ones (sliding-window layers once their window is full).

    Example:
        >>> first_key_position(1, 4, past=9)  # a 4-token window after 9 cached tokens: keys 6..9
        6
        >>> first_key_position(1, 4, past=torch.tensor(9))
        tensor(6)
    """
    if isinstance(past, torch.Tensor):
        return (past + (query_length - key_length)).clamp_min(0)
    return max(0, past + query_length - key_length)


def real_query_rows(allowed: torch.Tensor, query_length: int, past: int | torch.Tensor = 0) -> torch.Tensor:
    """[B, 1 or H, Q, 1]: True for query rows of real (non-padding) tokens in self-attention.

    Queries and keys are the same tokens, query row i being the key at sequence position ``past + i``; a token
    is real exactly when it may attend to itself. ``past`` may be a tensor (a static cache's count, see
    ``history.StaticConvolutionHistory``): the diagonal is then gathered by an index computed on the device.

    Example:
        >>> allowed = torch.tensor([[[True, True, False]], [[False, False, False]]])  # 2 sequences, 1 query
        >>> real_query_rows(allowed, 1, past=1).flatten().tolist()  # the query is key 1
        [True, False]
        >>> real_query_rows(allowed, 1, past=torch.tensor(1)).flatten().tolist()
        [True, False]
    """
    key_length = allowed.shape[-1]
    allowed = allowed.expand(*allowed.shape[:-2], query_length, key_length)
    if key_length < query_length:
        raise NotImplementedError(
            "Evolving self-attention needs every query among the keys; "
            f"got {query_length} queries after {past} cached tokens over {key_length} keys."
        )
    offset = past - first_key_position(query_length, key_length, past)
    if isinstance(offset, torch.Tensor) or torch.compiler.is_compiling():  # (diagonal would specialize a SymInt)
        index = (offset + torch.arange(query_length, device=allowed.device)).view(query_length, 1)
        return allowed.gather(-1, index.expand(*allowed.shape[:-1], 1))
    return torch.diagonal(allowed, offset=offset, dim1=-2, dim2=-1).unsqueeze(-1)


def self_attention_conv_mask(allowed: torch.Tensor | None, query_length: int, past: int = 0) -> torch.Tensor | None:
    """Entries that may enter the convolution in self-attention: allowed ones in rows of real tokens."""
    return convolution_mask("encoder", allowed, query_length, past, {})


def convolution_mask(
    role: str, allowed: torch.Tensor | None, query_length: int, past: int | torch.Tensor, chain: dict[Any, Any]
) -> torch.Tensor | None:
    """Which entries of the [B, H, Q, K] map the convolution of an attention ``role`` may read.

    Self-attention zeroes masked entries and the rows of padding queries (and records the decoder's real rows
    in the chain); cross attention zeroes padded source columns and the decoder's padding rows.
    """
    if role == "cross":
        rows = chain.get(DECODER_ROWS_KEY)
        if allowed is None:
            return rows
        return allowed if rows is None else allowed & rows
    if allowed is None:
        return None
    rows = real_query_rows(allowed, query_length, past)
    if role == "decoder":
        chain[DECODER_ROWS_KEY] = rows
    return allowed & rows


def evolving_attention_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """Mask function for ``evolving_attention``: sdpa's boolean mask, never skipped for causal models.

    sdpa may drop a causal mask and rely on ``is_causal``; the convolution needs the mask to know which
    entries are future ones, so it must always be materialised. Only a full mask without any padding is
    returned as ``None``.
    """
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)

"""Packed sequences: several documents in one row of a batch, kept apart by the convolution as by the mask.

Padding-free training (transformers' ``DataCollatorWithFlattening``, TRL's padding-free collator) concatenates
documents into one row. Their ``position_ids`` restart at each document, and transformers, given no attention
mask, masks attention block-diagonally (``masking_utils.find_packed_sequence_indices``); flash attention may be
handed the documents' boundaries instead (``cu_seq_lens_q`` / ``cu_seq_lens_k``). A block-diagonal mask does not
keep a convolution apart: the kernel at the first rows and columns of a document's block reads the last rows and
columns of the block before it, which are allowed there, and what it reads reaches later layers through A_logit.

So an evolving layer of a packed call attends to each document on its own: it gathers the documents' queries,
keys and values into a padded batch [documents, H, L, D] with their part of the mask (which keeps the causal or
sliding-window structure, and masks the padding of the shorter documents), runs the evolving attention of that
batch, and puts the outputs back in place. A padded example computes what it computes alone, so each document
gets exactly what it gets alone. Every evolving layer of one call finds the same layout (kept in the chain), so
the maps passed between layers have the unpacked layout from the first layer to the last.

Documents come from ``cu_seq_lens_q`` / ``cu_seq_lens_k`` where a call has them (flash attention's meaning: each
document attends to itself), else from the position ids of a stack called without an attention mask, by
transformers' own rule; these count only where transformers did mask the documents apart (every entry between
two documents masked): families whose masks ignore position ids attend across documents unpatched, and so do
they patched. transformers packs no call with a KV cache (it masks the whole row then), so decoding never
unpacks; flash-style boundaries are taken with an empty cache only (a training step with ``use_cache`` on), whose
convolution rows are then not kept: decoding on from that cache is refused.

Finding the documents reads them on the host (a device sync, as transformers' own detection and flash attention's
unpadding make); calls without position ids or boundaries cost two dictionary look-ups. Under torch.compile the
layout is found outside the graph (``torch.compiler.disable``): a graph break, which ``fullgraph=True`` refuses.

This file is copied beside the weights of saved EA checkpoints (``trust_remote_code``): it imports only torch,
transformers and sibling files (single-dot relative imports).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from transformers.masking_utils import find_packed_sequence_indices

from .call_state import PACKING_KEY, POSITIONS_KEY
from .masks import MASKED_LOGIT_THRESHOLD

#: The keyword arguments with the documents' boundaries (cumulative lengths over the flattened batch) that
#: transformers hands flash attention's variable-length kernels.
CU_SEQ_LENS_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k")


@dataclasses.dataclass(eq=False)
class Packing:
    """Where the D documents of a packed [B, N] call sit, and their padded batch [D, ..., L, ...] (L: the longest).

    Slot ``t`` of document ``d`` holds the token at ``positions[d, t]`` of row ``rows[d]``; the slots after a
    document's end repeat its last token and are masked (``valid`` is False there).

    Example:
        >>> packing = Packing.from_lengths([3, 2], batch=1, length=5, device=torch.device("cpu"))
        >>> packing.positions.tolist(), packing.valid.tolist()
        ([[0, 1, 2], [3, 4, 4]], [[True, True, True], [True, True, False]])
        >>> x = torch.arange(5.0).view(1, 1, 5, 1)  # [B, H, N, D]
        >>> packing.tokens(x).flatten(1).tolist()
        [[0.0, 1.0, 2.0], [3.0, 4.0, 4.0]]
        >>> packing.restore(packing.tokens(x).transpose(1, 2)).flatten().tolist()
        [0.0, 1.0, 2.0, 3.0, 4.0]
    """

    batch: int
    length: int
    rows: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    #: [B * N]: the slot (d * L + t) of each token of the flattened batch.
    scatter: torch.Tensor
    #: [B, N] document of each token where the documents came from position ids; their masks must keep them
    #: apart for the call to count as packed (None: boundaries given explicitly).
    document_ids: torch.Tensor | None = None
    #: (mask, whether it keeps the documents apart) of the masks checked in this call.
    checked: list[tuple[Any, bool]] = dataclasses.field(default_factory=list)

    @classmethod
    def from_lengths(
        cls,
        lengths: list[int],
        batch: int,
        length: int,
        device: torch.device,
        document_ids: torch.Tensor | None = None,
    ) -> Packing:
        """The layout of documents of ``lengths`` that fill a flattened [batch, length] call in order."""
        lengths = [n for n in lengths if n > 0]
        start = 0
        for n in lengths:
            if start // length != (start + n - 1) // length:
                raise ValueError(
                    f"A packed document (tokens {start} to {start + n - 1} of the flattened batch) spans rows "
                    f"{start // length} and {(start + n - 1) // length} of {length} tokens; each document must lie "
                    "in one row."
                )
            start += n
        if start != batch * length:
            raise ValueError(f"Packed documents of {start} tokens in all in a batch of {batch} x {length} tokens.")
        sizes = torch.tensor(lengths, device=device)
        flat_starts = sizes.cumsum(0) - sizes
        slots = torch.arange(max(lengths), device=device)
        documents = torch.arange(len(lengths), device=device)
        of_token = documents.repeat_interleave(sizes)
        offsets = torch.arange(batch * length, device=device) - flat_starts[of_token]
        return cls(
            batch=batch,
            length=length,
            rows=flat_starts // length,
            positions=(flat_starts % length)[:, None] + torch.minimum(slots, sizes[:, None] - 1),
            valid=slots < sizes[:, None],
            scatter=of_token * max(lengths) + offsets,
            document_ids=document_ids,
        )

    @property
    def documents(self) -> int:
        return self.positions.shape[0]

    @property
    def padded_length(self) -> int:
        return self.positions.shape[1]

    def tokens(self, states: torch.Tensor) -> torch.Tensor:
        """[B, H, N, D] queries, keys or values -> [documents, H, L, D]."""
        batch, heads, length, dim = states.shape
        flat = states.transpose(1, 2).reshape(batch * length, heads, dim)
        gather = (self.rows[:, None] * length + self.positions).flatten()
        return flat.index_select(0, gather).view(self.documents, self.padded_length, heads, dim).transpose(1, 2)

    def maps(self, maps: torch.Tensor) -> torch.Tensor:
        """[1 or B, h, 1 or N, N] maps (a mask, a positional bias) -> each document's block [documents, h, L, L]."""
        rows = self.rows if maps.shape[0] > 1 else torch.zeros_like(self.rows)
        maps = maps.expand(*maps.shape[:2], self.length, self.length)  # (older encoders' masks have one row)
        slots = self.positions
        blocks = maps[rows[:, None, None], :, slots[:, :, None], slots[:, None, :]]  # [D, L, L, h]
        return blocks.permute(0, 3, 1, 2).contiguous()

    def mask(self, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The documents' part of the call's mask, the padding of the shorter documents masked."""
        pairs = self.valid[:, None, :, None] & self.valid[:, None, None, :]
        if attention_mask is None:
            return pairs
        blocks = self.maps(attention_mask)
        if blocks.dtype == torch.bool:
            return blocks & pairs
        return blocks.masked_fill(~pairs, torch.finfo(blocks.dtype).min)

    def restore(self, output: torch.Tensor) -> torch.Tensor:
        """[documents, L, H, D] outputs -> [B, N, H, D]."""
        _, _, heads, dim = output.shape
        flat = output.reshape(self.documents * self.padded_length, heads, dim)
        return flat.index_select(0, self.scatter).view(self.batch, self.length, heads, dim)

    def applies_to(self, attention_mask: torch.Tensor | None) -> bool:
        """Whether a layer with ``attention_mask`` attends to the documents apart: always for explicit boundaries;
        for documents found in position ids, where the mask allows no entry between two of them. Every mask of
        the call must agree, as the chain passes maps of one layout between its layers."""
        if self.document_ids is None:
            return True
        for mask, verdict in self.checked:
            if mask is attention_mask:
                return verdict
        verdict = masks_apart(attention_mask, self.document_ids)
        if self.checked and verdict != self.checked[0][1]:
            raise RuntimeError(
                "The position ids of this call restart (packed sequences), and some of its attention masks keep the "
                "documents apart while others do not: evolving attention cannot pass one layer's map to the next."
            )
        self.checked.append((attention_mask, verdict))
        return verdict


def masks_apart(attention_mask: torch.Tensor | None, document_ids: torch.Tensor) -> bool:
    """Whether ``attention_mask`` [1 or B, h, N, N] masks every entry between two different documents."""
    if attention_mask is None or attention_mask.shape[-2:] != (document_ids.shape[-1],) * 2:
        return False
    allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask > MASKED_LOGIT_THRESHOLD
    ids = document_ids.to(allowed.device)
    across = ids[:, :, None] != ids[:, None, :]
    return not bool((allowed & across[:, None]).any())


def find_packing(
    role: str,
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    chain: dict[Any, Any] | None,
    cache: Any,
    kwargs: dict[str, Any],
) -> Packing | None:
    """The packed-sequence layout of a self-attention call of an evolving layer, or None where it is not packed.

    ``cache``: the call's KV cache, if any. Two dictionary look-ups where the call has neither boundaries nor
    position ids (see the module's docstring).
    """
    explicit = any(kwargs.get(name) is not None for name in CU_SEQ_LENS_KWARGS)
    if not explicit and (chain is None or POSITIONS_KEY not in chain):
        return None
    if role == "cross":
        return None
    if cache is not None:
        if not explicit:
            return None  # transformers masks a call with a cache over the whole row: nothing is packed
        if cache.get_seq_length() != query.shape[-2] or key.shape[-2] != query.shape[-2]:
            # A packed prefill into an empty cache (a training step with use_cache on, as transformers' default
            # config has it) is attended to as any packed call, without keeping convolution rows: decoding on
            # from it finds none, and refuses (history.convolution_history).
            raise NotImplementedError(
                "Evolving attention does not decode packed sequences (cu_seq_lens_q/cu_seq_lens_k with a KV cache "
                "that holds earlier tokens): its convolution keeps one map per sequence of the batch."
            )
    return _packing(query, key, attention_mask, chain, kwargs, explicit)


@torch.compiler.disable
def _packing(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    chain: dict[Any, Any] | None,
    kwargs: dict[str, Any],
    explicit: bool,
) -> Packing | None:
    """:func:`find_packing` once a call may be packed: the call's layout (found once, kept in the chain) where
    this layer's mask applies it. Reads the documents on the host."""
    batch, _, length, _ = query.shape
    if key.shape[-2] != length:
        raise NotImplementedError(
            f"Evolving attention of packed sequences needs as many keys as queries; got {key.shape[-2]} keys for "
            f"{length} queries."
        )
    packing = None if chain is None else chain.get(PACKING_KEY)
    if packing is None:
        packing = layout(batch, length, query.device, chain, kwargs, explicit)
        if chain is not None:
            chain[PACKING_KEY] = packing
    if packing is False:
        return None
    if (packing.batch, packing.length) != (batch, length):
        raise RuntimeError(
            f"A layer of a packed call attends over [{batch}, {length}] tokens, its first layer over "
            f"[{packing.batch}, {packing.length}]."
        )
    return packing if packing.applies_to(attention_mask) else None


def layout(
    batch: int, length: int, device: torch.device, chain: dict[Any, Any] | None, kwargs: dict[str, Any], explicit: bool
) -> Packing | bool:
    """The documents of a call of ``batch`` rows of ``length`` tokens, or False where it has one per row."""
    if explicit:
        query_bounds, key_bounds = (kwargs.get(name) for name in CU_SEQ_LENS_KWARGS)
        bounds = (query_bounds if query_bounds is not None else key_bounds).tolist()
        if query_bounds is not None and key_bounds is not None and key_bounds is not query_bounds:
            if key_bounds.tolist() != bounds:
                raise NotImplementedError(
                    "Evolving attention of packed sequences needs the same documents for queries and keys; got "
                    f"cu_seq_lens_q={bounds} and cu_seq_lens_k={key_bounds.tolist()}."
                )
        if bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:], strict=False)):
            raise ValueError(f"cu_seq_lens must rise from 0; got {bounds}.")
        lengths = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
        return Packing.from_lengths(lengths, batch, length, device)
    positions = chain[POSITIONS_KEY]
    if positions.ndim != 2 or positions.shape[-1] != length or positions.shape[0] not in (1, batch):
        return False  # not the row's positions (several position streams, say): transformers packs none either
    document_ids = find_packed_sequence_indices(positions.expand(batch, -1).to(device))
    if document_ids is None:
        return False
    counts = document_ids[:, -1] + 1
    global_ids = document_ids + (counts.cumsum(0) - counts)[:, None]
    lengths = torch.bincount(global_ids.flatten()).tolist()
    return Packing.from_lengths(lengths, batch, length, device, document_ids=document_ids)

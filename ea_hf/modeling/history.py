"""The decoding history: the earlier rows a causal convolution needs when ``generate`` decodes step by step.

When ``generate`` decodes with a KV cache, the earlier rows each causal convolution needs are kept on the cache
object and reordered with it in beam search: with a dynamic cache, whose keys grow by each step's, in a
:class:`ConvolutionHistory`; with a static cache (transformers' ``StaticCache``, whose keys have a fixed length:
``cache.is_compileable``), in a :class:`StaticConvolutionHistory`, whose buffers are sized once and whose
positions are tensors, so that ``torch.compile`` traces a decoding step once for all steps.

This file is copied beside the weights of saved EA checkpoints (``trust_remote_code``): it imports only torch,
transformers and sibling files (single-dot relative imports).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from .masks import first_key_position

#: Attribute of a transformers ``Cache`` object under which the convolution histories of its model are kept.
CACHE_ATTRIBUTE = "evolving_attention_histories"


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
    #: Sequence position of the first key (column) of ``rows``.
    first_key: int = 0
    #: Whether the keys are the decoded sequence itself (self-attention, whose sliding-window caches drop old
    #: keys) rather than a fixed source (cross attention).
    self_attention: bool = True

    def extend(self, new_rows: torch.Tensor, keep: int) -> tuple[torch.Tensor, int, int]:
        """Return (earlier rows + ``new_rows``, number of earlier rows, number of columns before the first key
        of ``new_rows``) and remember the last ``keep`` rows.

        Columns are aligned by sequence position: a sliding-window layer's cache drops its oldest keys, so the
        new rows may start at a later key than the kept ones. The earlier rows keep the columns a convolution
        of ``keep`` columns either side may still read; where one side has no entry the other's key is masked
        (a later key for an earlier row, a key outside the window for a new row), which the convolution reads
        as zero, as it would in one full pass.
        """
        query_length, key_length = new_rows.shape[-2:]
        first_key = first_key_position(query_length, key_length, self.seen) if self.self_attention else 0
        earlier = self.rows
        if earlier is None:
            full, left = new_rows, first_key
        else:
            if earlier.shape[0] != new_rows.shape[0]:
                raise RuntimeError(
                    f"Evolving attention cache holds rows for batch size {earlier.shape[0]}, but the step has "
                    f"batch size {new_rows.shape[0]}; the KV cache was resized outside generate()."
                )
            left = min(self.first_key, first_key)
            right = first_key + key_length - (self.first_key + earlier.shape[-1])
            earlier = F.pad(earlier, (self.first_key - left, right))
            full = torch.cat([earlier, F.pad(new_rows, (first_key - left, 0))], dim=-2)
        kept_from = max(left, first_key - keep)
        # A copy: a view would keep the whole [B, H, Q, K] map of this step alive until the next one.
        self.rows = full[..., full.shape[-2] - min(keep, full.shape[-2]) :, kept_from - left :].clone()
        self.first_key = kept_from
        self.seen += query_length
        return full, 0 if earlier is None else earlier.shape[-2], first_key - left

    def begin(self, last_rows: torch.Tensor, query_length: int) -> None:
        """Start the history with the first step's last convolution-input rows (``last_rows``, the last ``keep``
        of its ``query_length`` rows), so that the step itself can run without it (on a fused kernel)."""
        if self.rows is not None:
            raise RuntimeError("the convolution history has already begun")
        self.rows = last_rows.clone()
        self.first_key = 0  # nothing was cached before the first step: its keys start at the sequence's start
        self.seen = query_length


@dataclasses.dataclass
class StaticConvolutionHistory:
    """The last ``keep`` input rows of one causal convolution, kept with a static KV cache between decoding steps.

    What :class:`ConvolutionHistory` keeps, in buffers of a fixed shape allocated once, at the first step, and
    updated in place: ``rows`` [B, H, keep, W] and ``seen_tokens``, the number of tokens seen, a tensor. The
    columns of ``rows`` are aligned to the right at the tokens seen: column j holds the key at sequence position
    ``seen_tokens - W + j`` (in cross attention, whose keys are the source, source position ``j - keep``). W is
    the first step's key length plus ``keep``: a static cache hands attention its whole buffer (first key 0) or,
    in a sliding-window layer, the last keys of the window, and a decoding step's earlier rows need the ``keep``
    columns left of its first key (see :meth:`ConvolutionHistory.extend`). Nothing here depends on the tokens on
    the host: the rows are moved to the step's columns by an index computed from ``seen_tokens``
    (:func:`realigned`), so ``torch.compile`` traces one decoding step for all.
    """

    #: Rows kept: the convolution's ``context_rows`` (kernel_size // 2), also the columns it reads either side.
    keep: int
    rows: torch.Tensor | None = None
    #: The number of tokens seen, a 0-d int64 tensor on the rows' device (None until the first step).
    seen_tokens: torch.Tensor | None = None
    #: Whether the keys are the decoded sequence itself (see :class:`ConvolutionHistory`).
    self_attention: bool = True

    @property
    def seen(self) -> int:
        """The number of tokens seen, on the host (not while torch.compile traces: it reads the tensor)."""
        return 0 if self.seen_tokens is None else int(self.seen_tokens)

    def first_key(self, query_length: int, key_length: int) -> torch.Tensor | int:
        """The sequence position of the first key of a step with ``query_length`` queries over ``key_length``
        keys (a tensor once the history has begun)."""
        if not self.self_attention:
            return 0
        return first_key_position(query_length, key_length, 0 if self.seen_tokens is None else self.seen_tokens)

    def extend(self, new_rows: torch.Tensor, keep: int) -> tuple[torch.Tensor, int, int]:
        """:meth:`ConvolutionHistory.extend` in the static layout: (the ``keep`` earlier rows + ``new_rows``, on the
        columns of ``new_rows`` and ``keep`` columns left of them; ``keep``; ``keep``), always of the same shape for
        the same step shape, and the last ``keep`` rows kept in place. The earlier rows are zeros where no token
        was seen, as the convolution's padding would be."""
        if keep != self.keep:
            raise ValueError(f"this history keeps {self.keep} rows, not {keep}")
        batch, heads, query_length, key_length = new_rows.shape
        if self.rows is None:
            self.allocate(new_rows, key_length)
        elif self.rows.shape[0] != batch:
            raise RuntimeError(
                f"Evolving attention cache holds rows for batch size {self.rows.shape[0]}, but the step has "
                f"batch size {batch}; the KV cache was resized outside generate()."
            )
        first = self.first_key(query_length, key_length)
        earlier = realigned(self.rows, self.first_column(self.seen_tokens), first - keep, key_length + keep)
        full = torch.cat([earlier, F.pad(new_rows, (keep, 0))], dim=-2)
        self.store(full[..., full.shape[-2] - keep :, :], first - keep, query_length, self.seen_tokens)
        return full, keep, keep

    def begin(self, last_rows: torch.Tensor, query_length: int) -> None:
        """:meth:`ConvolutionHistory.begin`: the first step's last convolution-input rows (its keys start at the
        sequence's start), with zero rows above them where the step had fewer than ``keep``."""
        if self.rows is not None:
            raise RuntimeError("the convolution history has already begun")
        self.allocate(last_rows, last_rows.shape[-1])
        self.store(F.pad(last_rows, (0, 0, self.keep - last_rows.shape[-2], 0)), 0, query_length, seen=0)

    def allocate(self, like: torch.Tensor, key_length: int) -> None:
        """The buffers, zeros (no token seen), for steps like ``like`` [B, H, ., K] over ``key_length`` keys."""
        batch, heads = like.shape[:2]
        self.rows = like.new_zeros(batch, heads, self.keep, key_length + self.keep)
        self.seen_tokens = torch.zeros((), dtype=torch.long, device=like.device)
        if not torch.compiler.is_compiling():  # as transformers' static cache does for its keys and values
            torch._dynamo.mark_static_address(self.rows)
            torch._dynamo.mark_static_address(self.seen_tokens)

    def store(
        self, last_rows: torch.Tensor, first: torch.Tensor | int, query_length: int, seen: torch.Tensor | int
    ) -> None:
        """Keep ``last_rows`` (the last ``keep`` rows, column j at position ``first + j``) after a step of
        ``query_length`` tokens that follow ``seen`` tokens (``seen_tokens``, or 0 at the first step, where the
        columns are then moved by a constant), in place."""
        self.rows.copy_(realigned(last_rows, first, self.first_column(seen, query_length), self.rows.shape[-1]))
        self.seen_tokens.add_(query_length)

    def first_column(self, seen: torch.Tensor | int, query_length: int = 0) -> torch.Tensor | int:
        """The position of the first column of ``rows`` once ``query_length`` tokens follow ``seen`` tokens: the
        columns end at the tokens seen in self-attention; cross attention's keys (the source) do not move."""
        if not self.self_attention:
            return -self.keep
        return seen + (query_length - self.rows.shape[-1])

    def select_batch(self, index: torch.Tensor) -> None:
        """The rows of the batch entries ``index`` (beam search), in place."""
        if self.rows is not None:
            self.rows.copy_(self.rows.index_select(0, index.to(self.rows.device)))


def realigned(rows: torch.Tensor, first: torch.Tensor | int, new_first: torch.Tensor | int, width: int) -> torch.Tensor:
    """``rows`` [..., K], whose column j holds the key at position ``first + j``, on ``width`` columns from position
    ``new_first`` on, zero where ``rows`` has no column; the positions may be tensors (the index is computed on the
    device).

    Example:
        >>> realigned(torch.tensor([[1.0, 2.0, 3.0]]), 4, torch.tensor(5), 4)
        tensor([[2., 3., 0., 0.]])
    """
    columns, shift = rows.shape[-1], new_first - first
    if not isinstance(shift, torch.Tensor):  # a constant shift: a slice and zero padding
        start = min(columns, max(0, shift))
        stop = min(columns, max(start, shift + width))
        left = min(width, max(0, -shift))
        return F.pad(rows[..., start:stop], (left, width - left - (stop - start)))
    index = torch.arange(width, device=rows.device) + shift
    taken = rows.index_select(-1, index.clamp(0, columns - 1))
    return torch.where((index >= 0) & (index < columns), taken, taken.new_zeros(()))


def static_layout(cache: Any) -> bool:
    """Whether a transformers KV cache hands attention keys of a fixed length, as ``StaticCache`` does (the caches
    that ``torch.compile`` takes: ``is_compileable``)."""
    return bool(getattr(cache, "is_compileable", False))


def _histories(cache: Any) -> dict:
    """The dict of convolution histories kept on ``cache`` (made empty where it has none)."""
    # getattr and setattr, not cache.__dict__.setdefault: torch 2.10's dynamo cannot trace that (a graph break).
    histories = getattr(cache, CACHE_ATTRIBUTE, None)
    if histories is None:
        histories = {}
        setattr(cache, CACHE_ATTRIBUTE, histories)
    return histories


def convolution_history(cache: Any, key: tuple[str, int], past: int) -> ConvolutionHistory:
    """The :class:`ConvolutionHistory` of one layer, stored on the transformers ``Cache`` object itself.

    ``past`` is the number of tokens the cache held before this step; a step with no past starts afresh.
    """
    histories = _histories(cache)
    history = histories.get(key)
    if past <= 0:
        history = histories[key] = ConvolutionHistory(self_attention=key[0] != "cross")
    elif history is None or history.seen != past:
        raise _lost_rows(key, past, history)
    return history


def static_convolution_history(
    cache: Any, key: tuple[str, int], query_length: int, keep: int
) -> StaticConvolutionHistory:
    """The :class:`StaticConvolutionHistory` of one layer on a static ``cache``, for a step of ``query_length``
    tokens; ``keep``: the rows it keeps.

    Outside torch.compile the history is checked against the cache as :func:`convolution_history` checks it (the
    cache's length is then read on the host), and a step with no past starts afresh. While torch.compile traces,
    nothing is read on the host: a history starts with the first step on this cache and follows every step after
    it (a cache emptied with ``reset()`` is then not noticed: start a compiled generation on a new cache).
    """
    histories = _histories(cache)
    history = histories.get(key)
    if not torch.compiler.is_compiling():
        past = int(cache.get_seq_length()) - query_length
        if past <= 0:
            history = None
        elif history is None or history.seen != past:
            raise _lost_rows(key, past, history)
    if history is None:
        history = histories[key] = StaticConvolutionHistory(keep, self_attention=key[0] != "cross")
    return history


def _lost_rows(
    key: tuple[str, int], past: int, history: ConvolutionHistory | StaticConvolutionHistory | None
) -> RuntimeError:
    """The error of a cache that holds ``past`` earlier tokens where the history of layer ``key`` saw others."""
    seen = 0 if history is None else history.seen
    return RuntimeError(
        f"The KV cache holds {past} earlier tokens but evolving attention ({key[0]} layer {key[1]}) kept "
        f"convolution rows for {seen}. The cache was filled, cropped or reordered outside this model's "
        "forward/generate (assisted decoding and cache cropping are not supported)."
    )


def reorder_convolution_histories(cache: Any, beam_idx: torch.LongTensor) -> None:
    """Reorder the kept convolution rows along the batch like the KV cache (beam search); a static history's in
    place, as the static cache reorders its keys and values."""
    for history in getattr(cache, CACHE_ATTRIBUTE, {}).values():
        if isinstance(history, StaticConvolutionHistory):
            history.select_batch(beam_idx)
        elif history.rows is not None:
            history.rows = history.rows.index_select(0, beam_idx.to(history.rows.device))


#: Where generate's output holds the KV cache: ``cache`` in newer transformers releases (5.24), ``past_key_values``
#: in older ones (5.15 to 5.20).
OUTPUT_CACHE_KEYS = ("cache", "past_key_values")


def output_cache(output: Any) -> Any:
    """The KV cache a ``generate`` output (a ModelOutput or dict) holds, or ``None``."""
    return next((output[key] for key in OUTPUT_CACHE_KEYS if output.get(key) is not None), None)


def split_convolution_histories(cache: Any, parts: list[Any]) -> None:
    """Give each example's cache in ``parts`` (example ``i``'s at index ``i``; ``None`` where it has none) its
    rows of the convolution histories kept on ``cache``, on the CPU, as Whisper's ``generate`` splits its output
    by example and rebuilds each example's cache from its keys and values alone (moved to the CPU)."""
    histories = getattr(cache, CACHE_ATTRIBUTE, None)
    if not histories:
        return
    for index, part in enumerate(parts):
        if part is not None:
            setattr(part, CACHE_ATTRIBUTE, {key: split_history(h, index) for key, h in histories.items()})


def split_history(history: ConvolutionHistory | StaticConvolutionHistory, index: int) -> Any:
    """Example ``index`` of a history's batch, on the CPU."""
    rows = None if history.rows is None else history.rows[index : index + 1].cpu()
    return with_rows(history, rows, torch.device("cpu"))


def with_rows(history: ConvolutionHistory | StaticConvolutionHistory, rows: torch.Tensor | None, device: Any) -> Any:
    """A copy of ``history`` holding ``rows``, a static history's count of tokens seen copied to ``device`` (a
    buffer of its own, as the rows are)."""
    if isinstance(history, StaticConvolutionHistory) and history.seen_tokens is not None:
        return dataclasses.replace(history, rows=rows, seen_tokens=history.seen_tokens.to(device).clone())
    return dataclasses.replace(history, rows=rows)


def stack_convolution_histories(parts: list[Any], cache: Any, device: torch.device | str) -> None:
    """The converse of :func:`split_convolution_histories`: the histories of the examples' caches ``parts``
    stacked again onto ``cache`` (on ``device``), as Whisper's ``generate`` stacks the keys and values."""
    kept = [getattr(part, CACHE_ATTRIBUTE, None) for part in parts]
    if cache is None or not kept or any(not histories for histories in kept):
        return
    stacked = {}
    for key, history in kept[0].items():
        rows = [histories[key].rows for histories in kept]
        joined = None if rows[0] is None else torch.cat(rows).to(device)
        stacked[key] = with_rows(history, joined, device)
    setattr(cache, CACHE_ATTRIBUTE, stacked)

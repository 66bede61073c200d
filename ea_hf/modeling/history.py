"""The decoding history: the earlier rows a causal convolution needs when ``generate`` decodes step by step.

When ``generate`` decodes with a KV cache, the earlier rows each causal convolution needs are kept on the cache
object (:class:`ConvolutionHistory`) and reordered with it in beam search.

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


def convolution_history(cache: Any, key: tuple[str, int], past: int) -> ConvolutionHistory:
    """The :class:`ConvolutionHistory` of one layer, stored on the transformers ``Cache`` object itself.

    ``past`` is the number of tokens the cache held before this step; a step with no past starts afresh.
    """
    # getattr and setattr, not cache.__dict__.setdefault: torch 2.10's dynamo cannot trace that (a graph break).
    histories = getattr(cache, CACHE_ATTRIBUTE, None)
    if histories is None:
        histories = {}
        setattr(cache, CACHE_ATTRIBUTE, histories)
    history = histories.get(key)
    if past <= 0:
        history = histories[key] = ConvolutionHistory(self_attention=key[0] != "cross")
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
    for history in getattr(cache, CACHE_ATTRIBUTE, {}).values():
        if history.rows is not None:
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


def split_history(history: ConvolutionHistory, index: int) -> ConvolutionHistory:
    """Example ``index`` of a history's batch, on the CPU."""
    rows = None if history.rows is None else history.rows[index : index + 1].cpu()
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
        stacked[key] = dataclasses.replace(history, rows=joined)
    setattr(cache, CACHE_ATTRIBUTE, stacked)

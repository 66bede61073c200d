"""The evolution step's forward in terms of a kernel's general fused correlation, shared by the kernels."""

from __future__ import annotations

from collections.abc import Callable

import torch


def bool_gate(scores: torch.Tensor) -> torch.Tensor:
    """An unwritten bool ReLU gate for maps like ``scores``, one byte a value (the Triton kernels' form)."""
    return scores.new_empty(scores.shape, dtype=torch.bool)


def evolve_by_correlation(
    correlate: Callable[..., torch.Tensor],
    scores: torch.Tensor,
    previous: torch.Tensor | None,
    keep: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    alpha: float,
    blend: float,
    context_rows: int,
    *,
    in_place: bool,
    gate: bool | None = None,
    new_gate: Callable[[torch.Tensor], torch.Tensor] = bool_gate,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(ReLU(Conv(A_in * keep)) + blend * A_in, the gate where the ReLU output is positive) with
    A_in = lerp(S, A_prev, alpha), in one pass of ``correlate`` (``ea_hf.ops.cpu.correlate`` or the Triton one);
    ``in_place`` writes the result over ``scores``. The gate is kept if ``gate`` (default: unless in place, i.e.
    inference), in the map ``new_gate(scores)`` gives (the form ``correlate`` writes). Row i reads input rows
    ``i - context_rows ..``."""
    keep_gate = not in_place if gate is None else gate
    saved = new_gate(scores) if keep_gate else None
    logits = correlate(
        scores,
        weight,
        bias,
        row_shift=-context_rows,
        lerp_end=previous,
        lerp_weight=alpha,
        in_keep=keep,
        relu=True,
        saved=saved,
        blend=scores,
        blend_coef=blend,
        in_place=in_place,
    )
    return logits, saved

"""The evolution step's forward in terms of a kernel's general fused correlation, shared by the kernels: where an
:class:`~ea_hf.modeling.step.EvolutionStep` is unpacked into a correlation's arguments."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..modeling.step import EvolutionStep, StepMaps


def bool_gate(scores: torch.Tensor) -> torch.Tensor:
    """An unwritten bool ReLU gate for maps like ``scores``, one byte a value (the Triton kernels' form)."""
    return scores.new_empty(scores.shape, dtype=torch.bool)


def evolve_by_correlation(
    correlate: Callable[..., torch.Tensor],
    step: EvolutionStep,
    maps: StepMaps,
    weight: torch.Tensor,
    bias: torch.Tensor,
    *,
    in_place: bool,
    gate: bool | None = None,
    new_gate: Callable[[torch.Tensor], torch.Tensor] = bool_gate,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(ReLU(Conv(A_in * keep)) + (1 - beta) * A_in, the gate where the ReLU output is positive) with
    A_in = lerp(S, A_prev, alpha) and the beta-scaled ``weight`` and ``bias``, in one pass of ``correlate``
    (``ea_hf.ops.cpu_binding.correlate`` or the Triton one); ``in_place`` writes the result over ``maps.scores``.
    The gate is kept if ``gate`` (default: unless in place, i.e. inference), in the map ``new_gate(scores)`` gives
    (the form ``correlate`` writes). Row i reads input rows ``i - step.context_rows ..``."""
    scores, previous, keep = maps
    keep_gate = not in_place if gate is None else gate
    saved = new_gate(scores) if keep_gate else None
    # A_in is the correlation's input mixed with lerp_end; the blend adds the same mix of its map, S.
    logits = correlate(
        scores,
        weight,
        bias,
        row_shift=-step.context_rows,
        lerp_end=previous,
        lerp_weight=step.alpha,
        in_keep=keep,
        relu=True,
        saved=saved,
        blend=scores,
        blend_coef=1.0 - step.beta,
        in_place=in_place,
    )
    return logits, saved

"""What the kernels share: the options of a kernel's general fused correlation (:class:`CorrelationOptions`), the
evolution step's forward in terms of such a correlation (where an :class:`~ea_hf.modeling.step.EvolutionStep` is
unpacked into a correlation's arguments), and the primitive arguments and schemas of their torch operators
(``torch.compile`` and ``torch.export`` see each as one node).

The schemas' ``blend`` is 1 - beta: torch.compile's caches key a graph by its operators' names, so an operator
keeps the arguments that graphs cached with its name pass."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..modeling.step import EvolutionStep, StepMaps, packed_gate


@dataclass(frozen=True)
class CorrelationOptions:
    """What a kernel's general fused correlation (``correlate`` of :mod:`ea_hf.ops.cpu.binding` and of
    :mod:`ea_hf.ops.triton.evolution`, which take these as keyword arguments) does around the correlation itself.

    Output row i of ``correlate(x, weight, bias, row_shift=...)`` reads rows ``i + row_shift .. i + row_shift +
    kh - 1`` of ``x`` (zeros outside) and columns ``j - kw // 2 .. j + kw // 2``. With ``lerp_end``, ``x`` and
    ``blend`` are first mixed with it: ``x + lerp_weight * (lerp_end - x)``; ``in_keep`` masks that input. Then
    ``relu`` applies ReLU, ``saved`` (a :func:`~ea_hf.modeling.step.packed_gate` for ``x``) receives where the
    output is positive, one bit a value (the gate of backward), ``out_keep`` masks the output and ``blend_coef *
    blend`` is added. Masks broadcast to [B, 1, Q, K] (shared by the heads). ``in_place`` writes the result over
    ``x`` and returns it (``x`` may also be ``blend``).
    """

    lerp_end: torch.Tensor | None = None
    lerp_weight: float = 0.0
    in_keep: torch.Tensor | None = None
    relu: bool = False
    saved: torch.Tensor | None = None
    out_keep: torch.Tensor | None = None
    blend: torch.Tensor | None = None
    blend_coef: float = 0.0
    in_place: bool = False


def evolve_by_correlation(
    correlate: Callable[..., torch.Tensor],
    step: EvolutionStep,
    maps: StepMaps,
    weight: torch.Tensor,
    bias: torch.Tensor,
    *,
    in_place: bool,
    gate: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(ReLU(Conv(A_in * keep)) + (1 - beta) * A_in, the gate where the ReLU output is positive) with
    A_in = lerp(S, A_prev, alpha) and the beta-scaled ``weight`` and ``bias``, in one pass of ``correlate``
    (``ea_hf.ops.cpu.binding.correlate`` or the Triton one); ``in_place`` writes the result over ``maps.scores``.
    The gate is kept if ``gate`` (default: unless in place, i.e. inference), bit-packed
    (:func:`~ea_hf.modeling.step.packed_gate`, the form both kernels' ``correlate`` writes). Row i reads input
    rows ``i - step.context_rows ..``."""
    scores, previous, keep = maps
    keep_gate = not in_place if gate is None else gate
    saved = packed_gate(scores) if keep_gate else None
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


def tracing_without_kernels() -> bool:
    """Whether a trace that cannot record the fused kernels runs now: ``torch.onnx.export`` (either exporter: ONNX has
    no translation of the kernels' torch operators) or ``torch.jit.trace`` (its tracer does not see the ctypes calls
    and Triton launches of the operators' bodies). The kernels then decline every step, so that the trace records the
    evolution's torch operations (``ea_hf.modeling.convolution``), which compute the same to float rounding. Plain
    ``torch.export`` and ``torch.compile`` keep the operators. Checked by each kernel's ``applicable``: two flag
    reads outside a trace.

    Example:
        >>> tracing_without_kernels()
        False
    """
    if torch.jit.is_tracing():
        return True
    return torch.compiler.is_exporting() and torch.onnx.is_in_onnx_export()


def schema_arguments(step: EvolutionStep) -> tuple[float, float, int]:
    """The operators' primitive arguments for ``step``: (alpha, blend = 1 - beta, context_rows). The operators
    correlate masked tails (``step.skip_masked_tails`` is left out) and take the kernel's shape from its weight
    (``step.causal``)."""
    return step.alpha, 1.0 - step.beta, step.context_rows


def schema_step(alpha: float, blend: float, context_rows: int) -> EvolutionStep:
    """The step that :func:`schema_arguments` unpacked. beta = 1 - blend gives 1 - beta = blend again to the bit
    for every beta in [0, 2] (Sterbenz's lemma: one of the two subtractions is exact, and so is the result where
    the other rounded), so an operator computes what the direct call computes."""
    return EvolutionStep(alpha, 1.0 - blend, context_rows)


#: The forward operators' schema: maps [B, H, Q, K]; ``keep`` a float mask broadcastable to [B, 1, Q, K];
#: ``weight`` and ``bias`` the beta-scaled kernel; ``blend`` 1 - beta (see :func:`schema_arguments`). Returns
#: (A_logit, the ReLU gate in the kernel's form).
EVOLVE_SCHEMA = (
    "(Tensor scores, Tensor? previous, Tensor? keep, Tensor weight, Tensor bias, float alpha, float blend, "
    "int context_rows) -> (Tensor, Tensor)"
)
CONVOLVE_SCHEMA = "(Tensor x, Tensor weight, Tensor bias, int row_shift) -> Tensor"


def register_step_autograd(operator, backward: Callable[..., tuple]) -> None:
    """Register the autograd formula of a kernel's forward operator (of :data:`EVOLVE_SCHEMA`): it keeps S, A_prev,
    the mask, the gate and the beta-scaled weight, and its backward is ``backward(step, maps, grad, gate, weight)``,
    which returns the gradients of S, A_prev (or None), the weight and the bias (in the weight's dtype here)."""

    def setup_context(ctx, inputs, output):
        scores, previous, keep, weight, _, alpha, blend, context_rows = inputs
        ctx.save_for_backward(scores, previous, keep, output[1], weight)
        ctx.step = schema_step(alpha, blend, context_rows)

    def formula(ctx, grad_logits, _grad_gate):
        scores, previous, keep, gate, weight = ctx.saved_tensors
        grad_scores, grad_previous, grad_weight, grad_bias = backward(
            ctx.step, StepMaps(scores, previous, keep), grad_logits, gate, weight
        )
        kernel_grads = grad_weight.to(weight.dtype), grad_bias.to(weight.dtype)
        return grad_scores, grad_previous, None, *kernel_grads, None, None, None

    operator.register_autograd(formula, setup_context=setup_context)

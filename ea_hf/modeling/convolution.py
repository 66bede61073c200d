"""The evolution step as tensor operations and one autograd node: mix, mask, convolve, ReLU, blend.

:class:`EvolveConvolution` computes A_logit = beta * ReLU(Conv(A_in * keep)) + (1 - beta) * A_in with
A_in = lerp(S, A_prev, alpha) and keeps only S, A_prev and the ReLU gate for backward. Fused kernels (the CPU
and Triton kernels of ``ea_hf.ops``) plug in through :func:`~.kernels.register_fused_kernel`; where none is
registered or applicable, the same steps run as torch operations.

This file is copied beside the weights of saved EA checkpoints (``trust_remote_code``): it imports only torch,
transformers and sibling files (single-dot relative imports).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from .history import ConvolutionHistory
from .kernels import fused_kernel, fused_select_kept
from .step import EvolutionStep, GradientIn, ScaledMap, StepMaps, unpacked_gate


def select_kept(
    x: torch.Tensor, keep: torch.Tensor, scale: float = 1.0, fill: float = 0.0, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``keep ? scale * x : fill`` for a bool ``keep`` that broadcasts to ``x``, into ``out`` where given (which
    may be ``x``): the attention core's masked passes over its maps (dropout's gradient and dropout(P) with
    dropout's mask; a bool attention mask's zeros in a gradient, or its masked logits). Outside autograd and
    compilation the first registered kernel that takes these tensors runs it in one pass (``select_kept`` of
    :class:`~.kernels.FusedKernel`); elsewhere torch operations give the same numbers (dropout's gradient by torch's
    ``native_dropout_backward``, whose zeros keep the sign of ``x``).

    Example:
        >>> x, keep = torch.tensor([[1.0, -2.0, 3.0]]), torch.tensor([[True, False, True]])
        >>> select_kept(x, keep, 2.0).tolist()
        [[2.0, -0.0, 6.0]]
    """
    if not torch.compiler.is_compiling() and not (torch.is_grad_enabled() and x.requires_grad):
        result = fused_select_kept(x, keep, scale, fill, out)
        if result is not None:
            return result
    if fill == 0.0 and scale != 1.0:  # dropout's gradient: one kernel on GPUs, the numbers the CPU kernel gives
        result = torch.ops.aten.native_dropout_backward(x, keep, scale)
        return result if out is None else out.copy_(result)
    return torch.where(keep, x if scale == 1.0 else scale * x, x.new_full((), fill), out=out)


class EvolveConvolution(torch.autograd.Function):
    """A_logit = beta * ReLU(Conv(A_in * keep)) + (1 - beta) * A_in with A_in = lerp(S, A_prev, alpha), as one
    autograd node.

    Autograd through the plain formulation keeps four [B, H, Q, K] maps per layer for backward (the masked
    input, the convolution output, the ReLU output and a blend product), runs each blend as its own pass and
    allocates a map for every partial gradient. This function scales the (tiny) weights by beta instead of the
    map and keeps only S, A_prev (alive anyway as the previous layer's output) and the ReLU gate. A registered
    fused kernel (see :func:`~.kernels.register_fused_kernel`; the CPU one) runs the residual mix, mask,
    convolution, ReLU and blend as one pass forward; backward, one pass gives the gradients of S and A_prev
    (transposed convolution of the gated gradient, mask, blend, split by the residual weights) and one the weight
    and bias gradients, without materialising A_in, the gated gradient or the masked input. Elsewhere (GPU,
    float64, no compiler) the same steps run as torch operations.

    The maps are those of :class:`~.step.StepMaps`, one argument each (autograd differentiates arguments).
    """

    @staticmethod
    def forward(ctx, step: EvolutionStep, scores, previous, keep, weight, bias):
        maps = StepMaps(scores, previous, keep)
        logits, gate, scaled_weight = evolve_step(step, maps, weight, bias, for_backward=True)
        ctx.save_for_backward(scores, previous, gate, scaled_weight, keep)
        ctx.step = step
        return logits

    @staticmethod
    @torch.autocast("cpu", enabled=False)
    @torch.autocast("cuda", enabled=False)
    def backward(ctx, grad_logits):
        scores, previous, gate, scaled_weight, keep = ctx.saved_tensors
        grad_scores, grad_previous, grad_weight, grad_bias = evolve_backward(
            ctx.step,
            StepMaps(scores, previous, keep),
            GradientIn(grad_logits),
            gate,
            scaled_weight,
            needs_input=ctx.needs_input_grad[1] or ctx.needs_input_grad[2],
            needs_kernel=ctx.needs_input_grad[4] or ctx.needs_input_grad[5],
        )
        return None, grad_scores, grad_previous, None, grad_weight, grad_bias


def evolve_backward(
    step: EvolutionStep,
    maps: StepMaps,
    grad: GradientIn,
    gate: torch.Tensor,
    scaled_weight: torch.Tensor,
    *,
    needs_input: bool = True,
    needs_kernel: bool = True,
    scaled_scores: bool = False,
) -> tuple[torch.Tensor | ScaledMap | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of S, A_prev, the weight and the bias (of the parameters, not the beta-scaled kernel) of
    A_logit = beta * ReLU(Conv(A_in * keep)) + (1 - beta) * A_in, A_in = lerp(S, A_prev, alpha), given the
    ReLU gate of the forward step, its beta-scaled kernel weight and the gradient of A_logit.

    On a fused kernel one pass gives all four (it applies the ReLU gate and the residual mix as it reads;
    nothing is materialised but the gradients); elsewhere torch operations compute what is asked for. With
    ``grad.spent``, the gradients of S and of A_prev may be written over ``grad.grad``; ``grad.addend`` is added
    to it (by the kernel as it reads them, where one runs).
    ``scaled_scores``: S's gradient is returned as a :class:`ScaledMap`, which a fused kernel may share with
    A_prev's (one map written instead of two); A_prev's is then ``None`` where alpha is 0 (no gradient flows).
    """
    scores, previous, keep = maps
    kernel_rows, kernel_columns = scaled_weight.shape[-2:]
    grad_scores = grad_previous = grad_weight = grad_bias = None
    kernel = fused_kernel(scores, previous, grad.grad, keep=keep, weight=scaled_weight)
    if kernel is not None:
        grad_scores, grad_previous, grad_weight, grad_bias = kernel.backward(
            step, maps, grad, gate, scaled_weight, shared_map=scaled_scores
        )
    elif channels_last_enabled():
        grad_scores, grad_previous, grad_weight, grad_bias = backward_channels_last(
            step, maps, grad, gate, scaled_weight, needs_input=needs_input, needs_kernel=needs_kernel
        )
    else:
        grad_logits = plus_addend(grad.grad, grad.addend, owned=grad.spent)
        # Gradients of A_in go to S and A_prev in the proportions of the residual mix.
        scales = (1.0, None) if previous is None else (1.0 - step.alpha, step.alpha)
        grad_convolved = relu_gate(grad_logits, gate)
        if needs_input and scaled_scores and previous is not None and step.alpha != 0.0:
            # One map, A_prev's gradient alpha * G_in (alpha folded into the transposed kernel and the blend's
            # term), and S's as that map times (1 - alpha) / alpha: two passes a layer fewer than writing both.
            grad_previous = convolution_input_grad(
                step, grad_convolved, scaled_weight, keep, grad_logits, factor=step.alpha
            )[0]
            grad_scores = ScaledMap(grad_previous, (1.0 - step.alpha) / step.alpha)
        elif needs_input:
            grad_scores, grad_previous = convolution_input_grad(
                step, grad_convolved, scaled_weight, keep, grad_logits, scales=scales
            )
        if needs_kernel:
            attention_in = scores if previous is None else torch.lerp(scores, previous, step.alpha)
            conv_input = attention_in if keep is None else attention_in * keep
            grad_weight, grad_bias = convolution_weight_grad(
                conv_input, grad_convolved, kernel_rows, kernel_columns, step.context_rows
            )
    if grad_weight is not None:  # gradients of the beta-scaled kernel, brought back to the parameters
        grad_weight, grad_bias = step.beta * grad_weight, step.beta * grad_bias
    if scaled_scores and isinstance(grad_scores, torch.Tensor):
        grad_scores = ScaledMap(grad_scores, 1.0)
    return grad_scores, grad_previous, grad_weight, grad_bias


def plus_addend(grad: torch.Tensor, addend: torch.Tensor | None, *, owned: bool) -> torch.Tensor:
    """``grad + addend`` (``grad`` without one), written over ``grad`` where the caller ``owned`` it as a spent
    map: the attention core's softmax gradient, so that adding the next layer's gradient costs no map, as when it
    added it itself.

    Example:
        >>> g = torch.ones(2)
        >>> plus_addend(g, torch.ones(2), owned=True) is g, g
        (True, tensor([2., 2.]))
    """
    if addend is None:
        return grad
    return grad.add_(addend) if owned else grad + addend


def scale_kernel(
    weight: torch.Tensor, bias: torch.Tensor, beta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """beta * weight and beta * bias in the map's dtype: ReLU(beta * x) = beta * ReLU(x) for beta > 0, so
    the weights are scaled instead of the map (see ``scores.evolution_dtype`` for the maps' dtype)."""
    return weight.to(dtype) * beta, bias.to(dtype) * beta


def evolve_step(
    step: EvolutionStep,
    maps: StepMaps,
    weight: torch.Tensor,
    bias: torch.Tensor,
    history: ConvolutionHistory | None = None,
    *,
    for_backward: bool = False,
    spend_scores: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(A_logit, the ReLU gate for backward if ``for_backward``, the beta-scaled weight) for the rows of S: the
    kernel is scaled by beta first (see :func:`scale_kernel`).

    A_in is S, or with A_prev the residual mix lerp(S, A_prev, alpha): the CPU kernel mixes as it reads;
    elsewhere it is computed in S's storage, or in a new tensor ``for_backward`` (which keeps S; the fused kernel
    writes A_logit over S all the same with ``spend_scores``: backward recomputes it). The gate says where the
    ReLU output is positive: a bool map (a quarter of a float map's memory), or on the CPU kernel
    :func:`~.step.packed_gate`'s form (an eighth of that). Row i of a causal convolution reads input rows
    i - c .. i (c = ``step.context_rows``); ``history`` supplies the earlier rows of step-by-step decoding.
    """
    scores, previous, keep = maps
    scaled_weight, scaled_bias = scale_kernel(weight, bias, step.beta, scores.dtype)
    if history is not None and history.rows is None:
        # The first step of cached decoding (a prefill) has no earlier rows: it only needs to leave its last
        # rows behind, and can otherwise run like an uncached forward, on the fused kernel.
        begin_history(step, maps, history)
        history = None
    kernel = None if history is not None else fused_kernel(scores, previous, keep=keep, weight=scaled_weight)
    if kernel is not None:
        # Without autograd, or with spend_scores (backward recomputes it), S is not needed afterwards: the
        # kernel writes A_logit over it.
        in_place = spend_scores or not for_backward
        logits, gate = kernel.evolve(step, maps, scaled_weight, scaled_bias, in_place=in_place, gate=for_backward)
        return logits, gate, scaled_weight
    if history is None and channels_last_enabled():
        in_place = spend_scores or not for_backward
        logits, gate = evolve_channels_last(
            step, maps, scaled_weight, scaled_bias, in_place=in_place, gate=for_backward
        )
        return logits, gate, scaled_weight
    attention_in = scores
    if previous is not None:
        attention_in = torch.lerp(scores, previous, step.alpha) if for_backward else scores.lerp_(previous, step.alpha)
    conv_input = attention_in if keep is None else attention_in * keep
    rows_before = columns_before = 0
    kernel = None
    if history is not None:
        conv_input, rows_before, columns_before = history.extend(conv_input, step.context_rows)
        # A decoding step with earlier rows: the fused kernel convolves the extended map (earlier rows + this
        # step's, already mixed and masked) like the padded convolution below; only this step's rows are kept,
        # and the ReLU below runs on them alone.
        kernel = fused_kernel(conv_input, weight=scaled_weight) if step.causal else None
    if kernel is not None:
        convolved = kernel.convolve(conv_input, scaled_weight, scaled_bias, row_shift=-step.context_rows)
    else:
        # Padding `context_rows` on both sides: a causal kernel (its last row at the centre) then produces
        # `context_rows` extra rows at the bottom, and output row i reads input rows i - c .. i. Autocast off:
        # it would convolve in half precision.
        with torch.autocast(conv_input.device.type, enabled=False):
            padding = (step.context_rows, scaled_weight.shape[-1] // 2)
            convolved = F.conv2d(conv_input, scaled_weight, scaled_bias, padding=padding)
    if step.causal:
        rows, columns = scores.shape[-2:]
        convolved = convolved[..., rows_before : rows_before + rows, columns_before : columns_before + columns]
    convolved = convolved.relu_()
    if for_backward:
        return torch.add(convolved, attention_in, alpha=1.0 - step.beta), convolved > 0, scaled_weight
    return convolved.add_(attention_in, alpha=1.0 - step.beta), None, scaled_weight


def begin_history(
    step: EvolutionStep, maps: StepMaps, history: ConvolutionHistory, query_length: int | None = None
) -> None:
    """Record the last ``step.context_rows`` rows of the convolution input (A_in, masked) of a first decoding
    step.

    The maps may hold only the step's last rows when ``query_length`` gives how many it has (``keep`` may also
    have a single, broadcast row)."""
    scores, previous, keep = maps
    rows = slice(scores.shape[-2] - min(step.context_rows, scores.shape[-2]), None)
    last = scores[..., rows, :]
    if previous is not None:
        last = torch.lerp(last, previous[..., rows, :], step.alpha)
    if keep is not None:
        last = last * keep[..., rows, :] if keep.shape[-2] > 1 else last * keep
    history.begin(last, scores.shape[-2] if query_length is None else query_length)


def convolution_input_grad(
    step: EvolutionStep,
    grad_convolved: torch.Tensor,
    scaled_weight: torch.Tensor,
    keep: torch.Tensor | None,
    grad_logits: torch.Tensor,
    scales: tuple[float, float | None] = (1.0, None),
    factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradient of A_logit with respect to A_in: the transposed convolution of the ReLU-gated gradient
    ``grad_convolved``, masked like the forward input, plus (1 - beta) times the incoming gradient; returned
    times each of ``scales`` (the second ``None``: not needed). ``factor`` multiplies the gradient as it is
    computed (folded into the transposed kernel and the blend's term: no pass of its own). The CPU kernel computes
    the same in ``ea_hf.ops.cpu.binding.backward_pass``.

    The transposed convolution is :func:`transposed_convolution`.
    """
    rows = grad_logits.shape[-2]
    grad_in = transposed_convolution(grad_convolved, scaled_weight, step.context_rows, rows, factor)
    if keep is not None:
        grad_in = grad_in.mul_(keep)
    return split_by_scales(grad_in.add_(grad_logits, alpha=(1.0 - step.beta) * factor), scales)


def split_by_scales(
    grad_in: torch.Tensor, scales: tuple[float, float | None]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``grad_in`` times each of ``scales`` (the residual mix's shares of A_in's gradient: S's, then A_prev's or
    ``None``), the first in place.

    Example:
        >>> split_by_scales(torch.ones(2), (0.75, 0.25))
        (tensor([0.7500, 0.7500]), tensor([0.2500, 0.2500]))
    """
    second = None if scales[1] is None else grad_in * scales[1]
    return (grad_in if scales[0] == 1.0 else grad_in.mul_(scales[0])), second


def transposed_convolution(
    grad_convolved: torch.Tensor, scaled_weight: torch.Tensor, context_rows: int, rows: int, factor: float = 1.0
) -> torch.Tensor:
    """The transposed convolution of :func:`evolve_step`'s convolution applied to ``grad_convolved`` (the gradient
    of its output), cropped to the map's ``rows``, times ``factor`` (folded into the kernel): a convolution with the
    kernel flipped in both directions and its channels swapped; a causal kernel then reads rows i .. i + c (the rows
    whose outputs read row i).

    Example:
        >>> x = torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True)
        >>> weight, g = torch.randn(2, 2, 3, 3, dtype=torch.float64), torch.randn(1, 2, 5, 4, dtype=torch.float64)
        >>> F.conv2d(x, weight, padding=1).mul(g).sum().backward()
        >>> torch.allclose(transposed_convolution(g, weight, 1, 5), x.grad)
        True
    """
    transposed = scaled_weight.flip(-2, -1).transpose(0, 1)
    if factor != 1.0:
        transposed = transposed * factor
    shift = scaled_weight.shape[-2] - 1 - context_rows  # c for a centred kernel, 0 for a causal one
    grad_in = F.conv2d(grad_convolved, transposed, padding=(context_rows, scaled_weight.shape[-1] // 2))
    offset = context_rows - shift
    return grad_in[..., offset : offset + rows, :]


def relu_gate(grad: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The gradient through the ReLU, given where its output is positive (a bool map, or
    :func:`~.step.packed_gate`'s form)."""
    return grad * unpacked_gate(gate, grad.shape[-1])


def evolve_convolution(
    step: EvolutionStep,
    maps: StepMaps,
    weight: torch.Tensor,
    bias: torch.Tensor,
    history: ConvolutionHistory | None = None,
) -> torch.Tensor:
    """beta * ReLU(Conv(A_in * keep)) + (1 - beta) * A_in (see :class:`EvolveConvolution`).

    A_in is ``maps.scores``, or with ``maps.previous`` (the previous layer's A_logit) the residual mix
    (1 - alpha) * scores + alpha * previous; where it is materialised without autograd, it overwrites
    ``scores``. Without autograd (inference, ``generate``) nothing is kept for backward; with it, the step
    runs through :class:`EvolveConvolution`.

    Example:
        >>> a_in, weight, bias = torch.randn(1, 2, 4, 4), torch.randn(2, 2, 3, 3), torch.zeros(2)
        >>> plain = 0.5 * torch.relu(F.conv2d(a_in, weight, bias, padding=1)) + 0.5 * a_in
        >>> step = EvolutionStep(alpha=0.0, beta=0.5, context_rows=1)
        >>> torch.allclose(evolve_convolution(step, StepMaps(a_in.clone(), None, None), weight, bias), plain, atol=1e-6)
        True
    """
    scores, previous, _ = maps
    tensors = (scores, weight, bias, previous)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        if history is not None:  # a first decoding step with autograd on: record its rows for the next steps
            if history.rows is not None:
                raise ValueError("evolve_convolution back-propagates only through a first decoding step")
            begin_history(step, maps, history)
        return EvolveConvolution.apply(step, *maps, weight, bias)
    return evolve_step(step, maps, weight, bias, history)[0]


def convolution_weight_grad(
    conv_input: torch.Tensor, grad_output: torch.Tensor, kernel_rows: int, kernel_columns: int, context_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight gradient [H_out, H_in, kh, kw], bias gradient [H_out]) of the stride-1 convolution with
    ``context_rows`` rows and kw // 2 columns of zero padding that :func:`evolve_step` runs, given the gradient of
    its output rows (as many as the map's; a causal kernel's convolution has ``context_rows`` more, which the step
    crops: their gradient is zero).

    On GPUs, through the convolution's own backward (:func:`weight_grad_by_convolution`: cuDNN's kernels, with
    tensor-core products over every pixel of the batch at once). On the CPU, whose own path is the fused kernel
    (this one serves float64, ``EA_HF_KERNELS=0`` and the tests), as one small product per kernel tap and batch
    element (:func:`weight_grad_by_taps`): on the small maps of tests and short inputs oneDNN's convolution
    backward takes many times the products' time, though not on large maps (see docs/performance.md, "Choices in
    the hot path").

    Example:
        >>> x, g = torch.randn(2, 3, 6, 5, dtype=torch.float64), torch.randn(2, 3, 6, 5, dtype=torch.float64)
        >>> weight = torch.zeros(3, 3, 3, 3, dtype=torch.float64, requires_grad=True)
        >>> F.conv2d(x, weight, padding=1).mul(g).sum().backward()
        >>> torch.allclose(convolution_weight_grad(x, g, 3, 3, 1)[0], weight.grad)
        True
    """
    by = weight_grad_by_taps if grad_output.device.type == "cpu" else weight_grad_by_convolution
    return by(conv_input, grad_output, kernel_rows, kernel_columns, context_rows)


def weight_grad_by_convolution(
    conv_input: torch.Tensor, grad_output: torch.Tensor, kernel_rows: int, kernel_columns: int, context_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`convolution_weight_grad` through ``aten.convolution_backward``: a few large products (cuDNN on GPUs)
    instead of one per kernel tap and batch element (72 a layer at 3x3, batch 8). The padding is the
    convolution's, not a padded copy of the map."""
    heads_out, heads_in = grad_output.shape[1], conv_input.shape[1]
    # A causal kernel (rows i - c .. i) is the top of a centred one (rows i - c .. i + c), whose convolution has
    # as many rows as the map: its gradient needs no padded copy of the incoming one, for 1.5x the products.
    centred_rows = 2 * context_rows + 1
    weight = grad_output.new_zeros(heads_out, heads_in, centred_rows, kernel_columns)  # only its shape is read
    padding = [context_rows, kernel_columns // 2]
    _, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
        grad_output, conv_input, weight, [heads_out], [1, 1], padding, [1, 1], False, [0, 0], 1, [False, True, True]
    )
    return grad_weight[:, :, :kernel_rows].contiguous(), grad_bias


def weight_grad_by_taps(
    conv_input: torch.Tensor, grad_output: torch.Tensor, kernel_rows: int, kernel_columns: int, context_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`convolution_weight_grad` as one batched matrix product per kernel tap over the map's rows: each tap
    pairs the output gradient with the input shifted by the tap's offset, both cropped to where the shifted input
    exists (the zero padding contributes nothing), so no padded copy is made. The sums over rows and batch
    elements accumulate in fp32 (or float64), also for half-precision maps."""
    batch, heads_out, rows, width = grad_output.shape
    columns = kernel_columns // 2
    accumulator = torch.float64 if grad_output.dtype == torch.float64 else torch.float32
    grad_weight = grad_output.new_zeros(heads_out, conv_input.shape[1], kernel_rows, kernel_columns, dtype=accumulator)
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
                grad_weight[:, :, dy, dx] += torch.bmm(grad_rows, input_rows.transpose(1, 2)).sum(0, dtype=accumulator)
    return grad_weight, grad_output.sum((0, 2, 3), dtype=accumulator)


# --------------------------------------------------------------------------------------------------------------
# The channels-last candidate of the torch path (EA_HF_CHANNELS_LAST=1): the convolution, its input gradient and
# its weight gradient on maps whose heads are padded to a multiple of 8 channels and stored channels-last (NHWC),
# the layout in which cuDNN's tensor-core convolutions read and write half-precision maps without transposing them.
# --------------------------------------------------------------------------------------------------------------

#: The environment variable that turns the channels-last candidate on (``1``), read at call time.
CHANNELS_LAST_VARIABLE = "EA_HF_CHANNELS_LAST"
#: The padded maps' channels (heads) are a multiple of this: cuDNN's tensor-core convolutions of half-precision
#: maps take channels-last maps with channels in multiples of 8.
CHANNEL_MULTIPLE = 8


def channels_last_enabled(environment: Mapping[str, str] = os.environ) -> bool:
    """Whether ``EA_HF_CHANNELS_LAST=1`` in ``environment`` (the process's, read at call time) asks the torch path of
    the evolution step for its channels-last candidate (:func:`evolve_channels_last`,
    :func:`backward_channels_last`); never while torch.compile traces, whose graphs keep the default layout. Off by
    default: it joins the default on CUDA only once the GPU's decision table shows it the fastest correct path
    (docs/performance.md). A fused kernel, where one applies, runs before either.

    Example:
        >>> channels_last_enabled({"EA_HF_CHANNELS_LAST": "1"}), channels_last_enabled({})
        (True, False)
    """
    return not torch.compiler.is_compiling() and environment.get(CHANNELS_LAST_VARIABLE, "0") == "1"


def padded_heads(heads: int) -> int:
    """``heads`` rounded up to a multiple of :data:`CHANNEL_MULTIPLE`: the channels of a padded map.

    Example:
        >>> padded_heads(12), padded_heads(16), padded_heads(3)
        (16, 16, 8)
    """
    return -(-heads // CHANNEL_MULTIPLE) * CHANNEL_MULTIPLE


def channels_last_map(like: torch.Tensor) -> torch.Tensor:
    """A map like ``like`` [B, H, Q, K] with its heads padded (:func:`padded_heads`) and stored channels-last: a
    [B, Q, K, H_pad] buffer seen as [B, H_pad, Q, K]. The padded channels are zeros (the kernel's zero weights
    then keep them out of the real channels; uninitialised memory could hold a NaN, and 0 * NaN is NaN); the
    first H channels are left for the caller to write.

    Example:
        >>> padded = channels_last_map(torch.ones(2, 3, 4, 5))
        >>> padded.shape, padded.is_contiguous(memory_format=torch.channels_last), padded[:, 3:].abs().sum().item()
        (torch.Size([2, 8, 4, 5]), True, 0.0)
    """
    batch, heads, rows, columns = like.shape
    padded = like.new_empty(batch, rows, columns, padded_heads(heads)).permute(0, 3, 1, 2)
    if padded.shape[1] > heads:
        padded[:, heads:].zero_()
    return padded


def padded_weight(weight: torch.Tensor, channels: int) -> torch.Tensor:
    """A kernel weight [H, H, kh, kw] with zeros for ``channels`` - H more input and output channels, channels-last.

    Example:
        >>> padded = padded_weight(torch.ones(3, 3, 3, 3), 8)
        >>> padded.shape, padded.sum().item(), padded[3:].abs().sum().item()
        (torch.Size([8, 8, 3, 3]), 81.0, 0.0)
    """
    extra = channels - weight.shape[0]
    return F.pad(weight, (0, 0, 0, 0, 0, extra, 0, extra)).contiguous(memory_format=torch.channels_last)


def channels_last_input(
    step: EvolutionStep, maps: StepMaps, *, in_place: bool, blend: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the convolution's input A_in * keep in a :func:`channels_last_map`, A_in as the blend reads it).

    The residual mix and the mask write the padded map's heads directly, in the passes the default path takes:
    where the blend does not need A_in unmasked (no ``keep``, or not ``blend``), the mix goes straight into the
    padded map (and the blend reads it there); else it is a map of its own (in S's storage with ``in_place``),
    masked into the padded map. Without A_prev, S is copied (or masked) into it: one pass the default path, which
    convolves S where it is, does not take.
    """
    scores, previous, keep = maps
    conv_input = channels_last_map(scores)
    heads = conv_input[:, : scores.shape[1]]
    if previous is not None and (keep is None or not blend):
        attention_in = torch.lerp(scores, previous, step.alpha, out=heads)
        if keep is not None:
            heads.mul_(keep)
        return conv_input, attention_in
    attention_in = scores
    if previous is not None:
        attention_in = scores.lerp_(previous, step.alpha) if in_place else torch.lerp(scores, previous, step.alpha)
    if keep is None:
        heads.copy_(attention_in)
    else:
        torch.mul(attention_in, keep, out=heads)
    return conv_input, attention_in


def evolve_channels_last(
    step: EvolutionStep, maps: StepMaps, weight: torch.Tensor, bias: torch.Tensor, *, in_place: bool, gate: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`evolve_step`'s torch operations (without a decoding history) with the convolution on channels-last
    maps whose heads are padded, given the beta-scaled kernel: (A_logit, the ReLU gate as a bool map if ``gate``).
    A_logit is a contiguous map like S, written over S with ``in_place`` (S is then spent, as the fused kernels
    spend it); the gate is in channels-last order, as its backward reads it.

    The mix and the mask write the padded map (:func:`channels_last_input`), cuDNN convolves it into a padded
    channels-last map, the ReLU runs over that map whole (the padded channels stay zero), and the blend reads its
    heads and A_in and writes A_logit: the default path's passes, each over padded maps where they touch the
    convolution, and the padded channels' zeros written once.

    Example:
        >>> step = EvolutionStep(alpha=0.3, beta=0.4, context_rows=1)
        >>> s, prev = torch.randn(2, 3, 5, 6, dtype=torch.float64), torch.randn(2, 3, 5, 6, dtype=torch.float64)
        >>> w, b = torch.randn(3, 3, 3, 3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
        >>> mixed = torch.lerp(s, prev, 0.3)
        >>> plain = 0.4 * torch.relu(F.conv2d(mixed, w, b, padding=1)) + 0.6 * mixed
        >>> maps = StepMaps(s, prev, None)
        >>> logits, gate = evolve_channels_last(step, maps, 0.4 * w, 0.4 * b, in_place=False, gate=True)
        >>> torch.allclose(logits, plain), logits.is_contiguous(), gate.shape
        (True, True, torch.Size([2, 3, 5, 6]))
    """
    scores = maps.scores
    heads, rows = scores.shape[1], scores.shape[-2]
    conv_input, attention_in = channels_last_input(step, maps, in_place=in_place, blend=True)
    channels = conv_input.shape[1]
    with torch.autocast(scores.device.type, enabled=False):  # as evolve_step: autocast would convolve in half
        padding = (step.context_rows, weight.shape[-1] // 2)
        convolved = F.conv2d(
            conv_input, padded_weight(weight, channels), F.pad(bias, (0, channels - heads)), padding=padding
        )
    # A causal kernel's convolution has context_rows more rows at the bottom (see evolve_step): cropped.
    convolved = convolved.relu_()[:, :heads, :rows]
    owned = in_place and scores.is_contiguous()
    out = scores if owned else torch.empty_like(scores, memory_format=torch.contiguous_format)
    logits = torch.add(convolved, attention_in, alpha=1.0 - step.beta, out=out)
    return logits, (convolved > 0 if gate else None)


def backward_channels_last(
    step: EvolutionStep,
    maps: StepMaps,
    grad: GradientIn,
    gate: torch.Tensor,
    scaled_weight: torch.Tensor,
    *,
    needs_input: bool = True,
    needs_kernel: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """:func:`evolve_backward`'s torch operations with the convolution's backward on channels-last maps whose heads
    are padded: the gradients of S, A_prev, the beta-scaled weight and bias (each ``None`` where not asked for).

    The ReLU-gated gradient is written once into a :func:`channels_last_map`; cuDNN's transposed convolution (A_in's
    gradient) and weight gradient both read it there, and the weight gradient reads the convolution's input
    recomputed into another (:func:`channels_last_input`). A_in's gradient is masked in the padded map and comes
    out of the blend's gradient as a contiguous map like S, written over the incoming gradient where the caller
    spent it (``grad.spent``) or where it was this function's own sum with ``grad.addend``.

    Example:
        >>> step = EvolutionStep(alpha=0.0, beta=0.5, context_rows=1)
        >>> x = torch.randn(1, 2, 4, 5, dtype=torch.float64, requires_grad=True)
        >>> w, g = torch.randn(2, 2, 3, 3, dtype=torch.float64), torch.randn(1, 2, 4, 5, dtype=torch.float64)
        >>> convolved = torch.relu(F.conv2d(x, 0.5 * w, padding=1))
        >>> (convolved + 0.5 * x).mul(g).sum().backward()
        >>> maps, gate = StepMaps(x.detach(), None, None), convolved > 0
        >>> grad_scores, _, _, _ = backward_channels_last(step, maps, GradientIn(g), gate, 0.5 * w)
        >>> torch.allclose(grad_scores, x.grad)
        True
    """
    scores, previous, keep = maps
    heads, rows = scores.shape[1], scores.shape[-2]
    grad_logits = plus_addend(grad.grad, grad.addend, owned=grad.spent)
    grad_convolved = channels_last_map(grad_logits)
    torch.mul(grad_logits, unpacked_gate(gate, grad_logits.shape[-1]), out=grad_convolved[:, :heads])
    grad_scores = grad_previous = grad_weight = grad_bias = None
    if needs_input:
        weight = padded_weight(scaled_weight, grad_convolved.shape[1])
        grad_in = transposed_convolution(grad_convolved, weight, step.context_rows, rows)[:, :heads]
        if keep is not None:
            grad_in = grad_in.mul_(keep)
        owned = (grad.spent or grad.addend is not None) and grad_logits.is_contiguous()
        out = grad_logits if owned else torch.empty_like(grad_logits, memory_format=torch.contiguous_format)
        grad_in = torch.add(grad_in, grad_logits, alpha=1.0 - step.beta, out=out)
        scales = (1.0, None) if previous is None else (1.0 - step.alpha, step.alpha)
        grad_scores, grad_previous = split_by_scales(grad_in, scales)
    if needs_kernel:
        conv_input, _ = channels_last_input(step, maps, in_place=False, blend=False)
        kernel_rows, kernel_columns = scaled_weight.shape[-2:]
        grad_weight, grad_bias = weight_grad_by_convolution(
            conv_input, grad_convolved, kernel_rows, kernel_columns, step.context_rows
        )
        grad_weight, grad_bias = grad_weight[:heads, :heads].contiguous(), grad_bias[:heads]
    return grad_scores, grad_previous, grad_weight, grad_bias

"""Learned gates (alpha and beta as parameters of each layer) and the linear method's evolution.

With ``gates: learned`` each evolving layer holds alpha and beta as scalar parameters, started at the settings'
values (0 by default: the layer then computes the checkpoint's attention exactly). Their values are kept in
[0, 1] by :func:`gate_value`, a clamp whose gradient passes straight through: the forward uses
clamp(raw, 0, 1), the backward gives the raw parameter the gradient of the clamped value everywhere. A gate
pushed below 0 (or above 1) therefore still gets the gradient it would get at the border and comes back when the
loss asks for it, and at the start (raw = 0) its gradient is the exact one. (A sigmoid is never exactly 0, and
ReLU or a square have no gradient at 0.)

The gradients of the gates are exact:

    dL/dalpha = <G_in, A_prev - S>,   dL/dbeta = <G, R - A_in>,   R = ReLU(Conv(A_in * keep))

with G = dL/dA_logit and G_in = dL/dA_in (:func:`alpha_gradient`, :func:`beta_gradient`). In training the
attention core (``attention_core.EvolvingAttentionCore``) takes the step's kernels for the rest, as with fixed
gates (they take alpha and beta as numbers), and adds these two; :class:`GatedEvolveConvolution` does the same for
the step alone, where the core does not run. G_in is read from the gradients of S and A_prev that the kernels
return ((1 - alpha) G_in and alpha G_in), and R is recomputed in backward with the unscaled kernel (the step
convolves with beta * kernel, which is zero at beta = 0): one convolution more in backward, only with learned
gates.

The ``linear`` method has no ReLU: A_logit = beta * Conv(A_in * keep) + (1 - beta) * A_in, computed as
lerp(A_in, Conv(A_in * keep), beta). With the ``dirac`` start Conv is the identity on every kept entry (the
centre tap reads only its own entry, at the borders too), so A_logit = A_in there exactly for any beta; masked
entries differ, and the softmax masks them. The fused kernels apply the ReLU, so this method runs as torch
operations (:func:`evolve_with_autograd`), whose autograd gives every gradient.

This file is copied beside the weights of saved EA checkpoints (``trust_remote_code``): it imports only torch,
transformers and sibling files (single-dot relative imports).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .convolution import evolve_backward, evolve_step
from .history import ConvolutionHistory
from .step import EvolutionStep, GradientIn, ScaledMap, StepMaps


def gate_value(raw: Tensor) -> Tensor:
    """clamp(``raw``, 0, 1) with the gradient passed straight through to ``raw`` (see the module docstring).

    Example:
        >>> raw = torch.tensor([-0.5, 0.25, 1.5], requires_grad=True)
        >>> value = gate_value(raw)
        >>> value.sum().backward()
        >>> value.tolist(), raw.grad.tolist()
        ([0.0, 0.25, 1.0], [1.0, 1.0, 1.0])
    """
    return raw + (raw.detach().clamp(0.0, 1.0) - raw.detach())


def convolution_branch(
    conv_input: Tensor,
    weight: Tensor,
    bias: Tensor,
    context_rows: int,
    causal: bool,
    *,
    rows_before: int = 0,
    columns_before: int = 0,
    relu: bool = True,
) -> Tensor:
    """(ReLU of) Conv(``conv_input``) for the rows after its first ``rows_before`` (earlier, cached) rows and the
    columns after its first ``columns_before``; outside the map the convolution sees zeros. A causal kernel (its
    last row at the centre) makes output row i read input rows i - c .. i (c = ``context_rows``).

    Example:
        >>> x = torch.randn(1, 2, 4, 4)
        >>> identity = torch.zeros(2, 2, 2, 3)
        >>> identity[0, 0, 1, 1] = identity[1, 1, 1, 1] = 1.0
        >>> torch.equal(convolution_branch(x, identity, torch.zeros(2), 1, True, relu=False), x)
        True
    """
    columns = weight.shape[-1] // 2
    if causal:
        # Zero rows above the first one stand for the rows that do not exist yet (or are not cached).
        padded = F.pad(conv_input, (columns, columns, context_rows - rows_before, 0))
        convolved = F.conv2d(padded, weight, bias)[..., columns_before:]
    else:
        convolved = F.conv2d(conv_input, weight, bias, padding=(context_rows, columns))
    return F.relu(convolved) if relu else convolved


def evolve_with_autograd(
    alpha: Tensor | float,
    beta: Tensor | float,
    maps: StepMaps,
    weight: Tensor | None,
    bias: Tensor | None,
    step: EvolutionStep,
    *,
    linear: bool,
    history: ConvolutionHistory | None = None,
) -> Tensor:
    """A_logit as torch operations that autograd differentiates, ``alpha`` and ``beta`` numbers or (learned)
    tensors: lerp(S, A_prev, alpha), then without a convolution (``weight`` None) that alone, else
    lerp(A_in, R, beta) with R = Conv(A_in * keep), through a ReLU unless ``linear``. ``history``: the earlier rows
    of step-by-step decoding (see :meth:`~.history.ConvolutionHistory.extend`). ``step`` gives the kernel's
    ``context_rows`` and whether it is ``causal`` (its alpha and beta are not read).

    Example:
        >>> step = EvolutionStep(alpha=0.0, beta=0.0, context_rows=1)
        >>> s, prev = torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4)
        >>> weight = torch.zeros(2, 2, 3, 3)
        >>> weight[0, 0, 1, 1] = weight[1, 1, 1, 1] = 1.0  # dirac: the identity
        >>> logits = evolve_with_autograd(0.3, 0.7, StepMaps(s, prev, None), weight, torch.zeros(2), step, linear=True)
        >>> torch.equal(logits, torch.lerp(s, prev, 0.3))
        True
    """
    scores, previous, keep = maps
    gates = [g.to(scores.dtype) if isinstance(g, Tensor) else g for g in (alpha, beta)]
    attention_in = scores if previous is None else torch.lerp(scores, previous, gates[0])
    if weight is None:
        return attention_in
    conv_input = attention_in if keep is None else attention_in * keep
    rows_before = columns_before = 0
    if history is not None:
        conv_input, rows_before, columns_before = history.extend(conv_input, step.context_rows)
    branch = convolution_branch(
        conv_input, weight.to(scores.dtype), bias.to(scores.dtype), step.context_rows, step.causal,
        rows_before=rows_before, columns_before=columns_before, relu=not linear,
    )  # fmt: skip
    if step.causal:
        branch = branch[..., : scores.shape[-2], : scores.shape[-1]]
    return torch.lerp(attention_in, branch, gates[1])


def accumulation_dtype(maps: Tensor) -> torch.dtype:
    """The dtype the gates' gradients are summed in: float64 for float64 maps, else float32."""
    return torch.float64 if maps.dtype == torch.float64 else torch.float32


def alpha_gradient(
    grad_scores: Tensor | ScaledMap | None, grad_previous: Tensor | None, maps: StepMaps, alpha: float
) -> Tensor:
    """dL/dalpha = <G_in, A_prev - S> from the gradients of S and A_prev that a step's backward returns,
    (1 - ``alpha``) G_in and ``alpha`` G_in (S's may be a :class:`~.step.ScaledMap` of A_prev's map, or either may be
    absent where its factor is 0): G_in is read from A_prev's where alpha is not 0, else from S's. A 0-dim tensor in
    :func:`accumulation_dtype`.

    Example:
        >>> s, prev, grad_in = torch.randn(3, 1, 4, 4, dtype=torch.float64).unbind()
        >>> expected = (grad_in * (prev - s)).sum()
        >>> parts = [(0.7 * grad_in, 0.3 * grad_in, 0.3), (ScaledMap(0.3 * grad_in, 0.7 / 0.3), 0.3 * grad_in, 0.3),
        ...          (grad_in, None, 0.0)]
        >>> all(torch.allclose(alpha_gradient(gs, gp, StepMaps(s, prev, None), a), expected) for gs, gp, a in parts)
        True
    """
    scores, previous, _ = maps
    if grad_previous is not None and alpha != 0.0:
        grad_in, factor = grad_previous, 1.0 / alpha
    elif isinstance(grad_scores, ScaledMap):
        grad_in, factor = grad_scores.map, grad_scores.scale / (1.0 - alpha)
    else:
        grad_in, factor = grad_scores, 1.0 / (1.0 - alpha)
    return (grad_in * (previous - scores)).sum(dtype=accumulation_dtype(scores)) * factor


def beta_gradient(
    grads: tuple[Tensor | None, ...], step: EvolutionStep, maps: StepMaps, weight: Tensor, bias: Tensor
) -> Tensor:
    """dL/dbeta = <G, R - A_in>, R = ReLU(Conv(A_in * keep)) recomputed with the unscaled kernel (the step's own
    convolution is beta-scaled, zero at beta = 0), G the sum of ``grads`` (the gradients of A_logit; None ones
    left out). A 0-dim tensor in :func:`accumulation_dtype`."""
    scores, previous, keep = maps
    attention_in = scores if previous is None else torch.lerp(scores, previous, step.alpha)
    conv_input = attention_in if keep is None else attention_in * keep
    rows, columns = scores.shape[-2:]
    branch = convolution_branch(
        conv_input, weight.to(scores.dtype), bias.to(scores.dtype), step.context_rows, step.causal
    )[..., :rows, :columns]
    del conv_input
    difference = branch.sub_(attention_in)
    accumulate = accumulation_dtype(scores)
    return sum((grad * difference).sum(dtype=accumulate) for grad in grads if grad is not None)


class GatedEvolveConvolution(torch.autograd.Function):
    """A_logit = beta * ReLU(Conv(A_in * keep)) + (1 - beta) * A_in, A_in = lerp(S, A_prev, alpha), with alpha and
    beta learned: the step runs on the step's kernels with the gates' values as numbers (``step``), and backward
    adds the exact gradients of the gates (see the module docstring).

    ``apply(step, scores, previous, keep, weight, bias, alpha, beta)``: ``step`` with the clamped gates' values
    (``skip_masked_tails`` off: the gates' gradients read every entry), ``alpha`` and ``beta`` the clamped gates as
    0-dim tensors (the outputs of :func:`gate_value`), whose gradients this function returns.

    Example:
        >>> s, prev = torch.randn(1, 2, 5, 5, dtype=torch.float64), torch.randn(1, 2, 5, 5, dtype=torch.float64)
        >>> weight, bias = torch.randn(2, 2, 3, 3, dtype=torch.float64), torch.randn(2, dtype=torch.float64)
        >>> gates = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in (0.3, 0.4)]
        >>> step = EvolutionStep(0.3, 0.4, context_rows=1)
        >>> GatedEvolveConvolution.apply(step, s, prev, None, weight, bias, *gates).sum().backward()
        >>> plain = [g.detach().clone().requires_grad_() for g in gates]
        >>> expected = evolve_with_autograd(*plain, StepMaps(s, prev, None), weight, bias, step, linear=False)
        >>> expected.sum().backward()
        >>> all(torch.allclose(g.grad, p.grad) for g, p in zip(gates, plain))
        True
    """

    @staticmethod
    def forward(ctx, step: EvolutionStep, scores, previous, keep, weight, bias, alpha, beta):
        maps = StepMaps(scores, previous, keep)
        logits, gate, scaled_weight = evolve_step(step, maps, weight, bias, for_backward=True)
        ctx.save_for_backward(scores, previous, keep, weight, bias, gate, scaled_weight, alpha, beta)
        ctx.step = step
        return logits

    @staticmethod
    @torch.autocast("cpu", enabled=False)
    @torch.autocast("cuda", enabled=False)
    def backward(ctx, grad_logits):
        scores, previous, keep, weight, bias, gate, scaled_weight, alpha, beta = ctx.saved_tensors
        step, needs = ctx.step, ctx.needs_input_grad
        maps = StepMaps(scores, previous, keep)
        grad_scores, grad_previous, grad_weight, grad_bias = evolve_backward(
            step, maps, GradientIn(grad_logits), gate, scaled_weight, needs_kernel=needs[4] or needs[5]
        )
        if isinstance(grad_scores, ScaledMap):
            grad_scores = grad_scores.map * grad_scores.scale
        grad_alpha = grad_beta = None
        if needs[6] and previous is not None:
            grad_alpha = alpha_gradient(grad_scores, grad_previous, maps, step.alpha).to(alpha.dtype)
        elif needs[6]:
            grad_alpha = torch.zeros_like(alpha)
        if needs[7]:
            grad_beta = beta_gradient((grad_logits,), step, maps, weight, bias).to(beta.dtype)
        if not needs[1]:
            grad_scores = None
        if not needs[2]:
            grad_previous = None
        if grad_weight is not None:
            grad_weight, grad_bias = grad_weight.to(weight.dtype), grad_bias.to(bias.dtype)
        return None, grad_scores, grad_previous, None, grad_weight, grad_bias, grad_alpha, grad_beta

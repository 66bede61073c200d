"""The evolution step as tensor operations and one autograd node: mix, mask, convolve, ReLU, blend.

:class:`EvolveConvolution` computes A_logit = beta * ReLU(Conv(A_in * keep)) + (1 - beta) * A_in with
A_in = lerp(S, A_prev, alpha) and keeps only S, A_prev and the ReLU gate for backward. Fused kernels (the CPU
kernel of ``ea_hf.ops``; GPU kernels later) plug in through :func:`register_fused_kernel`; where none is
registered or applicable, the same steps run as torch operations.

This file is copied beside the weights of saved EA checkpoints (``trust_remote_code``): it imports only torch,
transformers and sibling files (single-dot relative imports).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F

from .history import ConvolutionHistory


class FusedKernel(Protocol):
    """What a fused implementation of the evolution step provides (see ``ea_hf.ops.cpu`` for one).

    ``evolve`` is the forward step with beta-scaled weights: (A_logit, the ReLU gate in the form its ``backward``
    reads: a bool map, or the CPU kernel's :func:`packed_gate`), or with ``in_place``
    A_logit written over ``scores`` and no gate unless ``gate``; ``convolve`` a plain correlation plus bias whose
    output row i reads input rows ``i + row_shift ..``; ``backward`` the step's gradients (see
    ``ea_hf.ops.cpu.backward``; with ``shared_map=True`` it may return S's gradient as a :class:`ScaledMap` of
    A_prev's); ``select_kept`` the attention core's masked passes, ``keep ? scale * x : fill`` (into ``out`` where
    given), or ``None`` where the kernel does not take them (see :func:`select_kept`). ``skip_masked_tails``: the
    caller's softmax masks, in every layer of the chain, the entries right of
    each row's last kept column, so a kernel may leave them out (the CPU kernel does, see
    ``ea_hf.ops.cpu.forward_correlation``).
    """

    def applicable(
        self, *tensors: torch.Tensor | None, keep: torch.Tensor | None = None, weight: torch.Tensor
    ) -> bool: ...

    def evolve(
        self,
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
        skip_masked_tails: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def convolve(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, row_shift: int) -> Any: ...

    def backward(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]: ...

    def select_kept(
        self, x: torch.Tensor, keep: torch.Tensor, scale: float, fill: float, out: torch.Tensor | None
    ) -> torch.Tensor | None: ...


class ScaledMap(NamedTuple):
    """``scale * map``, not multiplied out: a fused backward writes the gradient of A_in once, as A_prev's
    gradient alpha * G_in, and gives S's, (1 - alpha) * G_in, as that map times (1 - alpha) / alpha. The
    attention core folds the factor into the products that consume S's gradient (the gradients of Q and K):
    one [B, H, Q, K] map less to write and to allocate in every layer's backward.

    Example:
        >>> gradient = ScaledMap(torch.ones(2), 0.5)
        >>> gradient.scale * gradient.map
        tensor([0.5000, 0.5000])
    """

    map: torch.Tensor
    scale: float


#: Fused kernels, tried in order; registered by ``ea_hf.ops`` (remote-code copies of this file have none).
FUSED_KERNELS: list[FusedKernel] = []


def register_fused_kernel(kernel: FusedKernel) -> None:
    """Use ``kernel`` for the evolution step wherever it says it is applicable (idempotent)."""
    if kernel not in FUSED_KERNELS:
        FUSED_KERNELS.append(kernel)


def fused_kernel(*tensors: torch.Tensor | None, keep: torch.Tensor | None = None, weight: torch.Tensor):
    """The first registered kernel applicable to these tensors, or None (torch operations)."""
    # A loop, not next() over a generator: torch 2.8's dynamo cannot trace that (fullgraph fails).
    for kernel in FUSED_KERNELS:
        if kernel.applicable(*tensors, keep=keep, weight=weight):
            return kernel
    return None


def select_kept(
    x: torch.Tensor, keep: torch.Tensor, scale: float = 1.0, fill: float = 0.0, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``keep ? scale * x : fill`` for a bool ``keep`` that broadcasts to ``x``, into ``out`` where given (which
    may be ``x``): the attention core's masked passes over its maps (dropout's gradient and dropout(P) with
    dropout's mask; a bool attention mask's zeros in a gradient, or its masked logits). Outside autograd and
    compilation the first registered kernel that takes these tensors runs it in one pass (``select_kept`` of
    :class:`FusedKernel`); elsewhere torch operations give the same numbers (dropout's gradient by torch's
    ``native_dropout_backward``, whose zeros keep the sign of ``x``).

    Example:
        >>> x, keep = torch.tensor([[1.0, -2.0, 3.0]]), torch.tensor([[True, False, True]])
        >>> select_kept(x, keep, 2.0).tolist()
        [[2.0, -0.0, 6.0]]
    """
    if not torch.compiler.is_compiling() and not (torch.is_grad_enabled() and x.requires_grad):
        # A loop, not next() over a generator: torch 2.8's dynamo cannot trace that (see fused_kernel).
        for kernel in FUSED_KERNELS:
            result = kernel.select_kept(x, keep, scale, fill, out)
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
    fused kernel (see :func:`register_fused_kernel`; the CPU one) runs the residual mix, mask, convolution, ReLU
    and blend as one pass forward; backward, one pass gives the gradients of S and A_prev (transposed convolution
    of the gated gradient, mask, blend, split by the residual weights) and one the weight and bias gradients, without
    materialising A_in, the gated gradient or the masked input. Elsewhere (GPU, float64, no compiler) the
    same steps run as torch operations.

    ``previous`` is A_prev (``None``: A_in = S); ``keep`` is a float 0/1 mask broadcastable to S (``None``:
    every entry enters the convolution); ``causal`` marks a kernel that has only the rows at and above its
    centre.
    """

    @staticmethod
    def forward(ctx, scores, previous, keep, weight, bias, alpha, beta, causal, context_rows, skip_masked_tails=False):
        logits, gate, scaled_weight = evolve_for_backward(
            scores, previous, keep, weight, bias, alpha, beta, causal, context_rows, skip_masked_tails=skip_masked_tails
        )
        ctx.save_for_backward(scores, previous, gate, scaled_weight, keep)
        ctx.alpha, ctx.beta, ctx.context_rows, ctx.skip_masked_tails = alpha, beta, context_rows, skip_masked_tails
        return logits

    @staticmethod
    @torch.autocast("cpu", enabled=False)
    @torch.autocast("cuda", enabled=False)
    def backward(ctx, grad_logits):
        scores, previous, gate, scaled_weight, keep = ctx.saved_tensors
        grad_scores, grad_previous, grad_weight, grad_bias = evolve_backward(
            scores,
            previous,
            keep,
            gate,
            scaled_weight,
            grad_logits,
            ctx.alpha,
            ctx.beta,
            ctx.context_rows,
            needs_input=ctx.needs_input_grad[0] or ctx.needs_input_grad[1],
            needs_kernel=ctx.needs_input_grad[3] or ctx.needs_input_grad[4],
            skip_masked_tails=ctx.skip_masked_tails,
        )
        return grad_scores, grad_previous, None, grad_weight, grad_bias, None, None, None, None, None


def evolve_for_backward(
    scores: torch.Tensor,
    previous: torch.Tensor | None,
    keep: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    alpha: float,
    beta: float,
    causal: bool,
    context_rows: int,
    *,
    spend_scores: bool = False,
    skip_masked_tails: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(A_logit, the ReLU gate, the beta-scaled weight) of a step that :func:`evolve_backward` will
    differentiate. S is left as it is (backward needs it), or with ``spend_scores`` (backward recomputes it)
    the fused kernel may write A_logit over it."""
    options = {"for_backward": True, "spend_scores": spend_scores, "skip_masked_tails": skip_masked_tails}
    return scaled_step(
        scores, keep, weight, bias, beta, causal, None, context_rows, previous=previous, alpha=alpha, **options
    )


def scaled_step(
    scores: torch.Tensor,
    keep: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    beta: float,
    *args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(A_logit, the ReLU gate or None, the beta-scaled weight): :func:`evolve_step`, with its arguments, after
    scaling the kernel by beta (see :func:`scale_kernel`)."""
    scaled_weight, scaled_bias = scale_kernel(weight, bias, beta, scores.dtype)
    return *evolve_step(scores, keep, scaled_weight, scaled_bias, beta, *args, **kwargs), scaled_weight


def evolve_backward(
    scores: torch.Tensor,
    previous: torch.Tensor | None,
    keep: torch.Tensor | None,
    gate: torch.Tensor,
    scaled_weight: torch.Tensor,
    grad_logits: torch.Tensor,
    alpha: float,
    beta: float,
    context_rows: int,
    *,
    needs_input: bool = True,
    needs_kernel: bool = True,
    spent: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    grad_addend: torch.Tensor | None = None,
    scaled_scores: bool = False,
    skip_masked_tails: bool = False,
) -> tuple[torch.Tensor | ScaledMap | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of S, A_prev, the weight and the bias (of the parameters, not the beta-scaled kernel) of
    A_logit = beta * ReLU(Conv(A_in * keep)) + (1 - beta) * A_in, A_in = lerp(S, A_prev, alpha), given the
    ReLU gate of the forward step and the gradient of A_logit.

    On a fused kernel one pass gives all four (it applies the ReLU gate and the residual mix as it reads;
    nothing is materialised but the gradients); elsewhere torch operations compute what is asked for.
    ``spent`` names maps the caller no longer needs (``grad_logits`` itself may be the first): the kernel may
    write the gradients of S and of A_prev over them instead of allocating maps. ``grad_addend`` is a second
    gradient of A_logit, added to ``grad_logits`` (by the kernel as it reads them, where one runs).
    ``scaled_scores``: S's gradient is returned as a :class:`ScaledMap`, which a fused kernel may share with
    A_prev's (one map written instead of two); A_prev's is then ``None`` where alpha is 0 (no gradient flows).
    """
    kernel_rows, kernel_columns = scaled_weight.shape[-2:]
    grad_scores = grad_previous = grad_weight = grad_bias = None
    kernel = fused_kernel(scores, previous, grad_logits, keep=keep, weight=scaled_weight)
    if kernel is not None:
        grad_scores, grad_previous, grad_weight, grad_bias = kernel.backward(
            scores,
            previous,
            alpha,
            keep,
            grad_logits,
            gate,
            scaled_weight,
            context_rows,
            beta,
            spent,
            grad_addend,
            shared_map=scaled_scores,
            skip_masked_tails=skip_masked_tails,
        )
    else:
        grad_logits = plus_addend(grad_logits, grad_addend, owned=spent[0] is grad_logits)
        # Gradients of A_in go to S and A_prev in the proportions of the residual mix.
        scales = (1.0, None) if previous is None else (1.0 - alpha, alpha)
        grad_convolved = relu_gate(grad_logits, gate)
        if needs_input:
            grad_scores, grad_previous = convolution_input_grad(
                grad_convolved, scaled_weight, keep, grad_logits, beta, context_rows, scales=scales
            )
        if needs_kernel:
            attention_in = scores if previous is None else torch.lerp(scores, previous, alpha)
            conv_input = attention_in if keep is None else attention_in * keep
            grad_weight = convolution_weight_grad(conv_input, grad_convolved, kernel_rows, kernel_columns, context_rows)
            grad_bias = grad_convolved.sum((0, 2, 3))
    if grad_weight is not None:  # gradients of the beta-scaled kernel, brought back to the parameters
        grad_weight, grad_bias = beta * grad_weight, beta * grad_bias
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
    the weights are scaled instead of the map (fp32 for half-precision models, see evolving_attention_forward)."""
    return weight.to(dtype) * beta, bias.to(dtype) * beta


def evolve_step(
    scores: torch.Tensor,
    keep: torch.Tensor | None,
    scaled_weight: torch.Tensor,
    scaled_bias: torch.Tensor,
    beta: float,
    causal: bool,
    history: ConvolutionHistory | None,
    context_rows: int,
    *,
    previous: torch.Tensor | None = None,
    alpha: float = 0.0,
    for_backward: bool = False,
    spend_scores: bool = False,
    skip_masked_tails: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(A_logit, the ReLU gate for backward if ``for_backward``) for the rows of S, with beta-scaled kernel
    weights (``skip_masked_tails``: see :class:`FusedKernel`).

    A_in is S, or with ``previous`` the residual mix lerp(S, previous, alpha): the CPU kernel mixes as it
    reads; elsewhere it is computed in S's storage, or in a new tensor ``for_backward`` (which keeps S; the
    fused kernel writes A_logit over S all the same with ``spend_scores``). The gate says where the ReLU output
    is positive: a bool map (a quarter of a float map's memory), or on the CPU kernel :func:`packed_gate`'s form
    (an eighth of that). Row i of a causal convolution reads input
    rows i - c .. i (c = ``context_rows``); ``history`` supplies the earlier rows of step-by-step decoding.
    """
    blend = 1.0 - beta
    if history is not None and history.rows is None:
        # The first step of cached decoding (a prefill) has no earlier rows: it only needs to leave its last
        # rows behind, and can otherwise run like an uncached forward, on the fused kernel.
        begin_history(history, scores, previous, alpha, keep, context_rows)
        history = None
    kernel = None if history is not None else fused_kernel(scores, previous, keep=keep, weight=scaled_weight)
    if kernel is not None:
        # Without autograd, or with spend_scores (backward recomputes it), S is not needed afterwards: the
        # kernel writes A_logit over it.
        step = (scores, previous, keep, scaled_weight, scaled_bias, alpha, blend, context_rows)
        in_place = spend_scores or not for_backward
        return kernel.evolve(*step, in_place=in_place, gate=for_backward, skip_masked_tails=skip_masked_tails)
    attention_in = scores
    if previous is not None:
        attention_in = torch.lerp(scores, previous, alpha) if for_backward else scores.lerp_(previous, alpha)
    conv_input = attention_in if keep is None else attention_in * keep
    rows_before = columns_before = 0
    kernel = None
    if history is not None:
        conv_input, rows_before, columns_before = history.extend(conv_input, context_rows)
        # A decoding step with earlier rows: the fused kernel convolves the extended map (earlier rows + this
        # step's, already mixed and masked) like the padded convolution below; only this step's rows are kept,
        # and the ReLU below runs on them alone.
        kernel = fused_kernel(conv_input, weight=scaled_weight) if causal else None
    if kernel is not None:
        convolved = kernel.convolve(conv_input, scaled_weight, scaled_bias, row_shift=-context_rows)
    else:
        # Padding `context_rows` on both sides: a causal kernel (its last row at the centre) then produces
        # `context_rows` extra rows at the bottom, and output row i reads input rows i - c .. i. Autocast off:
        # it would convolve in half precision.
        with torch.autocast(conv_input.device.type, enabled=False):
            padding = (context_rows, scaled_weight.shape[-1] // 2)
            convolved = F.conv2d(conv_input, scaled_weight, scaled_bias, padding=padding)
    if causal:
        rows, columns = scores.shape[-2:]
        convolved = convolved[..., rows_before : rows_before + rows, columns_before : columns_before + columns]
    convolved = convolved.relu_()
    if for_backward:
        return torch.add(convolved, attention_in, alpha=blend), convolved > 0
    return convolved.add_(attention_in, alpha=blend), None


def begin_history(
    history: ConvolutionHistory,
    scores: torch.Tensor,
    previous: torch.Tensor | None,
    alpha: float,
    keep: torch.Tensor | None,
    context_rows: int,
    query_length: int | None = None,
) -> None:
    """Record the last ``context_rows`` rows of the convolution input (A_in, masked) of a first decoding step.

    ``scores``, ``previous`` and ``keep`` may hold only the step's last rows when ``query_length`` gives how
    many it has (``keep`` may also have a single, broadcast row)."""
    rows = slice(scores.shape[-2] - min(context_rows, scores.shape[-2]), None)
    last = scores[..., rows, :]
    if previous is not None:
        last = torch.lerp(last, previous[..., rows, :], alpha)
    if keep is not None:
        last = last * keep[..., rows, :] if keep.shape[-2] > 1 else last * keep
    history.begin(last, scores.shape[-2] if query_length is None else query_length)


def convolution_input_grad(
    grad_convolved: torch.Tensor,
    scaled_weight: torch.Tensor,
    keep: torch.Tensor | None,
    grad_logits: torch.Tensor,
    beta: float,
    context_rows: int,
    scales: tuple[float, float | None] = (1.0, None),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradient of A_logit with respect to A_in: the transposed convolution of the ReLU-gated gradient
    ``grad_convolved``, masked like the forward input, plus (1 - beta) times the incoming gradient; returned
    times each of ``scales`` (the second ``None``: not needed). The CPU kernel computes the same in
    ``ea_hf.ops.cpu.backward``.

    The transposed convolution is a convolution with the kernel flipped in both directions and its channels
    swapped; a causal kernel then reads rows i .. i + c (the rows whose outputs read row i).
    """
    transposed = scaled_weight.flip(-2, -1).transpose(0, 1)
    shift = scaled_weight.shape[-2] - 1 - context_rows  # c for a centred kernel, 0 for a causal one
    grad_in = F.conv2d(grad_convolved, transposed, padding=(context_rows, scaled_weight.shape[-1] // 2))
    offset = context_rows - shift
    grad_in = grad_in[..., offset : offset + grad_logits.shape[-2], :]
    if keep is not None:
        grad_in = grad_in.mul_(keep)
    grad_in = grad_in.add_(grad_logits, alpha=1.0 - beta)
    second = None if scales[1] is None else grad_in * scales[1]
    return (grad_in if scales[0] == 1.0 else grad_in.mul_(scales[0])), second


def relu_gate(grad: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The gradient through the ReLU, given where its output is positive (a bool map, or :func:`packed_gate`'s
    form)."""
    return grad * unpacked_gate(gate, grad.shape[-1])


def packed_gate(scores: torch.Tensor) -> torch.Tensor:
    """A bit-packed ReLU gate for maps like ``scores`` [B, H, Q, K], the form the CPU kernel writes and reads:
    per row, ceil(K / 16) little-endian 16-bit words (as bytes), bit j % 16 of word j // 16 for column j, and
    zeros past the last column. An eighth of a bool map's memory. Zeros until written (a kernel with 8-column
    vectors writes a byte a vector and leaves a row's last byte alone where its vectors are odd in number).

    Example:
        >>> packed_gate(torch.zeros(2, 3, 5, 40)).shape
        torch.Size([2, 3, 5, 6])
    """
    return scores.new_zeros(packed_gate_shape(scores.shape), dtype=torch.uint8)


def packed_gate_shape(shape: torch.Size) -> torch.Size:
    """The shape of a :func:`packed_gate` for maps of ``shape``: two bytes a 16 columns (or fewer, at the end).

    Example:
        >>> tuple(packed_gate_shape(torch.Size([2, 3, 5, 33])))
        (2, 3, 5, 6)
    """
    return torch.Size((*shape[:-1], 2 * -(-shape[-1] // 16)))


def pack_gate(gate: torch.Tensor) -> torch.Tensor:
    """A bool ReLU gate in :func:`packed_gate`'s form (a packed one as it is).

    Example:
        >>> gate = torch.rand(2, 3, 4, 21) > 0.5
        >>> torch.equal(unpacked_gate(pack_gate(gate), 21), gate)
        True
    """
    if gate.dtype != torch.bool:
        return gate
    padded = gate.new_zeros((*gate.shape[:-1], 8 * packed_gate_shape(gate.shape)[-1]))
    padded[..., : gate.shape[-1]] = gate
    bits = padded.unflatten(-1, (-1, 8)).to(torch.uint8) << torch.arange(8, dtype=torch.uint8, device=gate.device)
    return bits.sum(-1, dtype=torch.uint8)


def unpacked_gate(gate: torch.Tensor, cols: int) -> torch.Tensor:
    """A ReLU gate as a bool map of ``cols`` columns: ``gate`` itself where it is one, else unpacked from
    :func:`packed_gate`'s form.

    Example:
        >>> packed = torch.tensor([[0b00000101, 0b10000000]], dtype=torch.uint8)
        >>> unpacked_gate(packed, 16).nonzero()[:, -1].tolist()
        [0, 2, 15]
    """
    if gate.dtype == torch.bool:
        return gate
    bits = gate.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8, device=gate.device)
    return (bits & 1).flatten(-2)[..., :cols].bool()


def evolve_convolution(
    scores: torch.Tensor,
    keep: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    beta: float,
    causal: bool = False,
    history: ConvolutionHistory | None = None,
    context_rows: int | None = None,
    *,
    previous: torch.Tensor | None = None,
    alpha: float = 0.0,
    skip_masked_tails: bool = False,
) -> torch.Tensor:
    """beta * ReLU(Conv(A_in * keep)) + (1 - beta) * A_in (see :class:`EvolveConvolution`; ``skip_masked_tails``:
    see :class:`FusedKernel`).

    A_in is ``scores``, or with ``previous`` (the previous layer's A_logit) the residual mix
    (1 - alpha) * scores + alpha * previous; where it is materialised without autograd, it overwrites
    ``scores``. Without autograd (inference, ``generate``) nothing is kept for backward; with it, the step
    runs through :class:`EvolveConvolution`. ``context_rows`` defaults to the kernel's half width.

    Example:
        >>> a_in, weight, bias = torch.randn(1, 2, 4, 4), torch.randn(2, 2, 3, 3), torch.zeros(2)
        >>> plain = 0.5 * torch.relu(F.conv2d(a_in, weight, bias, padding=1)) + 0.5 * a_in
        >>> torch.allclose(evolve_convolution(a_in.clone(), None, weight, bias, 0.5), plain, atol=1e-6)
        True
    """
    if context_rows is None:
        context_rows = weight.shape[-1] // 2
    tensors = (scores, weight, bias, previous)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        if history is not None:  # a first decoding step with autograd on: record its rows for the next steps
            if history.rows is not None:
                raise ValueError("evolve_convolution back-propagates only through a first decoding step")
            begin_history(history, scores, previous, alpha, keep, context_rows)
        step = (scores, previous, keep, weight, bias, alpha, beta, causal, context_rows, skip_masked_tails)
        return EvolveConvolution.apply(*step)
    options = {"previous": previous, "alpha": alpha, "skip_masked_tails": skip_masked_tails}
    return scaled_step(scores, keep, weight, bias, beta, causal, history, context_rows, **options)[0]


def convolution_weight_grad(
    conv_input: torch.Tensor, grad_output: torch.Tensor, kernel_rows: int, kernel_columns: int, context_rows: int
) -> torch.Tensor:
    """Weight gradient [H_out, H_in, kh, kw] of a stride-1 convolution with ``context_rows`` rows and
    kw // 2 columns of zero padding, as one batched matrix product per kernel tap over the map's rows.

    Each tap pairs the output gradient with the input shifted by the tap's offset, both cropped to where
    the shifted input exists (the zero padding contributes nothing), so no padded copy is made.
    """
    batch, heads_out, rows, width = grad_output.shape
    columns = kernel_columns // 2
    grad_weight = grad_output.new_zeros(heads_out, conv_input.shape[1], kernel_rows, kernel_columns)
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
                grad_weight[:, :, dy, dx] += torch.bmm(grad_rows, input_rows.transpose(1, 2)).sum(0)
    return grad_weight

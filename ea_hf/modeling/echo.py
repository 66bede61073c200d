"""Echo attention (method ``echo``; Tay et al., "Echo-Attention: Attend Once and Get N Attentions for Free",
section 2.2): each layer refines its own logits E_0 = S_i in S steps

    P_k = sigmoid(Q_i w_k + b_k)                       (one gate per head and query token)
    E_k = P_k * U_k((1 - P_(k-1)) * E_(k-1)),  U_k(X) = a_k * X,  P_0 = 0
    A_logit_i = E_0 + E_1 + ... + E_S

with a_k one scale per head (``scalar``) or per query/key position (``row``/``column``); a_k starts at 0,
so a freshly patched echo model computes what the original does.

This file is copied beside the weights of saved EA checkpoints (``trust_remote_code``): it imports only torch,
transformers and sibling files (single-dot relative imports).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import initialization as hf_init

from .evolution import AttentionMapEvolution
from .history import ConvolutionHistory
from .settings import EvolvingAttentionSettings


class EchoAttention(AttentionMapEvolution):
    """Echo attention (method ``echo``): S gated, stateful refinements of a layer's own logits (see the module
    docstring). Each step has a gate projection per head (``head_dim`` weights and a bias) and a state scale
    per head (``scalar``) or per head and position (``row``: query positions, ``column``: key positions, up to
    ``max_positions``). The gates depend on one query token each and the scales on one position, so nothing
    crosses from padding or future tokens into valid entries.

    Example:
        >>> echo = EchoAttention(4, head_dim=8, echoes=2, position=0)
        >>> scores, query = torch.randn(1, 4, 5, 5), torch.randn(1, 4, 5, 8)
        >>> torch.equal(echo(scores, None, {}, query=query), scores)  # the state starts at zero
        True
        >>> sum(p.numel() for p in echo.parameters())  # 2 steps x 4 heads x (8 gate weights + bias + scale)
        80
    """

    def __init__(
        self,
        num_heads: int,
        *,
        head_dim: int,
        echoes: int = 2,
        state: str = "scalar",
        max_positions: int | None = None,
        role: str = "encoder",
        position: int = 0,
        previous: int | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            num_heads,
            alpha=0.0,
            beta=0.0,
            kernel_size=1,
            role=role,
            position=position,
            previous=previous,
            method="echo",
            device=device,
            dtype=dtype,
        )
        if state not in ("scalar", "row", "column"):
            raise ValueError(f"Unknown echo state {state!r}; expected 'scalar', 'row' or 'column'")
        if state != "scalar" and not max_positions:
            raise ValueError(f"echo state {state!r} needs max_positions")
        self.echoes, self.state, self.max_positions = echoes, state, max_positions
        factory = {"device": device, "dtype": dtype}
        self.gate_weight = nn.Parameter(torch.empty(echoes, num_heads, head_dim, **factory))
        self.gate_bias = nn.Parameter(torch.empty(echoes, num_heads, **factory))
        scale_shape = (echoes, num_heads) if state == "scalar" else (echoes, num_heads, max_positions)
        self.state_scale = nn.Parameter(torch.empty(scale_shape, **factory))
        self.reset_parameters()

    @classmethod
    def from_settings(cls, settings: EvolvingAttentionSettings, num_heads: int, head_dim: int, **where: Any):
        return cls(
            num_heads,
            head_dim=head_dim,
            echoes=settings.echoes,
            state=settings.echo_state,
            max_positions=settings.max_positions,
            **where,
        )

    def extra_repr(self) -> str:
        return (
            f"method='echo', heads={self.num_heads}, echoes={self.echoes}, state={self.state!r}, "
            f"role={self.role!r}, position={self.position}"
        )

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Gate weights ~ N(0, 0.02), gate bias 0, state scales 0 (so the layer starts as the plain one)."""
        if not hasattr(self, "state_scale"):  # called by the base class before the echo weights exist
            return
        hf_init.normal_(self.gate_weight, mean=0.0, std=0.02)
        hf_init.zeros_(self.gate_bias)
        hf_init.zeros_(self.state_scale)

    def _scale(self, step: int, query_length: int, key_length: int, past: int) -> torch.Tensor:
        """a_k, broadcastable to [B, H, Q, K]."""
        scale = self.state_scale[step]
        if self.state == "scalar":
            return scale[:, None, None]
        positions = past + query_length if self.state == "row" else key_length
        if positions > self.max_positions:
            raise ValueError(
                f"echo attention with a {self.state} state takes at most {self.max_positions} positions, "
                f"got {positions}"
            )
        if self.state == "row":
            return scale[:, past : past + query_length, None]
        return scale[:, None, :key_length]

    def forward(
        self,
        scores: torch.Tensor,
        conv_mask: torch.Tensor | None,
        chain: dict[Any, Any] | None,
        history: ConvolutionHistory | None = None,
        query: torch.Tensor | None = None,
        past: int = 0,
    ) -> torch.Tensor:
        if query is None:
            raise RuntimeError("echo attention needs the layer's queries")
        query_length, key_length = scores.shape[-2:]
        # [S, B, H, Q, 1]: one gate per step, head and query token, shared by the whole row.
        gates = torch.sigmoid(
            torch.einsum("bhqd,shd->sbhq", query.to(scores.dtype), self.gate_weight.to(scores.dtype))
            + self.gate_bias.to(scores.dtype)[:, None, :, None]
        ).unsqueeze(-1)
        logits, echo, previous_gate = scores, scores, None
        for step in range(self.echoes):
            carried = echo if previous_gate is None else (1.0 - previous_gate) * echo
            echo = gates[step] * (self._scale(step, query_length, key_length, past) * carried)
            logits = logits + echo
            previous_gate = gates[step]
        return logits

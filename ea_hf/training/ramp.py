"""Ramping evolving attention in: alpha and beta rise linearly from 0 to their values over the first steps of
fine-tuning (``ea.ramp_ratio``), so that the patched model starts as exactly the pretrained checkpoint.

The papers start the new convolutions from a random init at their full weight, which changes every attention
map of a pretrained model at step 0 (with all-MiniLM-L6-v2 on Rotten Tomatoes that start costs accuracy; see
docs/does-ea-help.md). With alpha = beta = 0 a patched model computes what the checkpoint did, as LoRA's
zero-initialised B does; the ramp lets fine-tuning move away from it gradually. The convolution's gradient is
scaled by beta, so it starts small and grows with the ramp.

Example:
    >>> ramp_factor(step=0, ramp_steps=100), ramp_factor(step=25, ramp_steps=100), ramp_factor(step=300, ramp_steps=100)
    (0.0, 0.25, 1.0)
"""

from __future__ import annotations

import math

import transformers
from torch import nn

from ..modeling.evolution import AttentionMapEvolution


def ramp_factor(step: int, ramp_steps: int) -> float:
    """The share of alpha and beta in effect at optimizer step ``step`` of a ramp of ``ramp_steps`` steps."""
    return 1.0 if ramp_steps <= 0 else min(1.0, step / ramp_steps)


class EvolutionRamp(transformers.TrainerCallback):
    """Scales every evolution's alpha and beta by :func:`ramp_factor` before each training step, and restores
    them when training ends (the saved config holds the full values, which the model has from then on)."""

    def __init__(self, model: nn.Module, ramp_ratio: float) -> None:
        self.ramp_ratio = ramp_ratio
        self.targets = {
            module: (module.alpha, module.beta)
            for module in model.modules()
            if isinstance(module, AttentionMapEvolution)
        }
        self.ramp_steps = 0

    def _scale(self, factor: float) -> None:
        for module, (alpha, beta) in self.targets.items():
            module.alpha, module.beta = alpha * factor, beta * factor

    def on_train_begin(self, args, state, control, **kwargs):
        self.ramp_steps = math.ceil(self.ramp_ratio * state.max_steps)
        self._scale(ramp_factor(state.global_step, self.ramp_steps))  # a resumed run continues its ramp

    def on_step_begin(self, args, state, control, **kwargs):
        self._scale(ramp_factor(state.global_step, self.ramp_steps))

    def on_train_end(self, args, state, control, **kwargs):
        self._scale(1.0)

"""Triton kernels for GPUs (the ``gpu`` extra): by default for bf16 and fp16 maps on Hopper GPUs, elsewhere with
``EA_HF_TRITON=1`` (``0`` turns them off); on CPU tensors they run in Triton's interpreter under
``TRITON_INTERPRET=1`` (for tests).

- :mod:`.common`: what the families share: triton (optional), where they run, how products are multiplied, the tile
  product, and the jitting of a family's kernels once per interpreter setting.
- :mod:`.evolution`: the evolution step's kernels (the correlation, the input and weight gradients), as the
  ``FusedKernel`` protocol of ``ea_hf.modeling``.
- :mod:`.attention_tail`: the attention tail after the evolution (the masked softmax and the product with the
  values, flash-style, without forming P), as the ``FusedAttentionTail`` protocol, where nobody reads the
  attention weights.
- :mod:`.operators`: both as torch operators (``torch.ops.ea_hf.triton_evolve_with_gate_bits``,
  ``triton_evolve_backward``, ``triton_convolve``, ``triton_attention_tail``, ``triton_attention_tail_backward``),
  which the kernels call while torch.compile traces.
"""

from . import attention_tail, common, evolution, operators  # noqa: F401  (operators registers the torch operators)

__all__ = ["attention_tail", "common", "evolution", "operators"]

"""Layer-by-layer attention maps, side by side (as in TPAMI 2023, Figure 8), for EA models and their bases.

Needs matplotlib (``pip install "ea_hf[viz]"``). The maps are the models' attention probabilities as
``output_attentions=True`` returns them: for an EA model the evolved ones, for a plain model (run with eager
attention for the occasion) the usual ones. :func:`plot_attention` draws them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .modeling.attach import is_patched


def attention_maps(model: nn.Module, inputs: Mapping[str, Any], example: int = 0) -> list[torch.Tensor]:
    """The attention probabilities of every (encoder) layer for one example of ``inputs``: [H, N, N] per
    layer, cropped to the example's real tokens when ``inputs`` has an ``attention_mask``."""
    switch = not is_patched(model) and model.config._attn_implementation != "eager"
    previous = model.config._attn_implementation
    if switch:  # sdpa and flash kernels do not return attention probabilities
        model.set_attn_implementation("eager")
    # Encoder-decoder models: the encoder's maps (the input's own attention).
    runner = model.get_encoder() if getattr(model.config, "is_encoder_decoder", False) else model
    try:
        with torch.no_grad():
            outputs = runner(**inputs, output_attentions=True)
    finally:
        if switch:
            model.set_attn_implementation(previous)
    attentions = outputs.attentions
    if not attentions:
        raise ValueError(f"{type(model).__name__} returned no attention probabilities")
    maps = [layer[example].float() for layer in attentions]
    mask = inputs.get("attention_mask")
    if mask is not None:
        keep = mask[example].bool()
        maps = [layer[:, keep][:, :, keep] for layer in maps]
    return maps


def plot_attention(
    model: nn.Module | Mapping[str, nn.Module],
    inputs: Mapping[str, Any],
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    tokens: Sequence[str] | None = None,
    example: int = 0,
    cell_size: float = 2.2,
):
    """Draw the attention maps of ``layers`` (default: all) side by side, one row per head in ``heads``
    (default: one row with the mean over heads), for one example of ``inputs``.

    ``model`` may be a mapping of labels to models (e.g. ``{"EA": ea_model, "base": base_model}``), which
    stacks their rows, to compare them on the same input (each panel's title then starts with its model's
    label on a line of its own). Each panel's image holds exactly the probabilities it shows.

    Args:
        model: an EA model or a plain one (run with eager attention for the occasion), or a mapping of labels to
            models.
        inputs: the model's keyword inputs (``input_ids``, ``attention_mask``, ``pixel_values``...); with an
            ``attention_mask`` the maps are cropped to the example's real tokens.
        layers: indices of the (encoder) layers to draw; ``None``: all.
        heads: the heads to draw, one row each; ``None``: one row with the mean over heads.
        tokens: labels of the axes (text); image patches are left unlabelled.
        example: which example of the batch to draw.
        cell_size: the size of one panel, in inches.

    Returns:
        figure (matplotlib.figure.Figure): the panels; save it with ``figure.savefig(path)``.

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: the model returns no attention probabilities, or ``layers`` or ``heads`` are out of range.

    Example:
        >>> import torch, transformers, ea_hf
        >>> config = transformers.BertConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        ...                                  intermediate_size=37, vocab_size=99)
        >>> model = ea_hf.patch(transformers.BertModel(config))
        >>> figure = ea_hf.plot_attention(model, {"input_ids": torch.tensor([[2, 7, 9, 4, 3]])}, layers=[0, 2])
        >>> [ax.get_title() for ax in figure.axes if ax.images]
        ['layer 0, mean of heads', 'layer 2, mean of heads']
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError('plot_attention needs matplotlib: pip install "ea_hf[viz]"') from None
    models = dict(model) if isinstance(model, Mapping) else {"": model}
    panels = []  # (row title, column title, [N, N] map)
    for label, one in models.items():
        prefix = f"{label}\n" if label else ""
        maps = attention_maps(one, inputs, example)
        chosen_layers = list(range(len(maps))) if layers is None else list(layers)
        bad = [i for i in chosen_layers if not 0 <= i < len(maps)]
        if bad:
            raise ValueError(f"layers {bad} out of range: the model has {len(maps)} layers (0..{len(maps) - 1})")
        num_heads = maps[0].shape[0]
        if heads is not None and any(not 0 <= h < num_heads for h in heads):
            raise ValueError(f"heads {list(heads)} out of range: the model has {num_heads} heads")
        for head in [None] if heads is None else heads:
            row = []
            for layer in chosen_layers:
                values = maps[layer].mean(0) if head is None else maps[layer][head]
                what = "mean of heads" if head is None else f"head {head}"
                row.append((f"{prefix}layer {layer}, {what}", values.numpy()))
            panels.append(row)
    rows, columns = len(panels), len(panels[0])
    figure = Figure(figsize=(cell_size * columns + 1.0, cell_size * rows + 0.5), layout="constrained")
    grid = figure.subplots(rows, columns, squeeze=False)
    for r, row in enumerate(panels):
        top = max(max(float(values.max()) for _, values in row), 1e-6)  # one colour scale per row
        for c, (title, values) in enumerate(row):
            ax = grid[r][c]
            image = ax.imshow(values, cmap="viridis", vmin=0.0, vmax=top)
            ax.set_title(title, fontsize=8)
            if tokens is not None and len(tokens) == values.shape[0]:
                ax.set_xticks(range(len(tokens)), tokens, rotation=90, fontsize=6)
                ax.set_yticks(range(len(tokens)), tokens, fontsize=6)
            else:
                ax.set_xticks([])
                ax.set_yticks([])
        figure.colorbar(image, ax=list(grid[r]), shrink=0.8)
    return figure

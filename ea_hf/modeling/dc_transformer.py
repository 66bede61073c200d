"""EA-DC-Transformer (TPAMI 2023, section 3.3, Figure 1(c), equations 6 to 10) for multivariate time series, as
ordinary transformers models: a config, a base model and classification, regression and pre-training heads.

Each block splits its width d between an attention branch (p * d, with Evolving Attention across blocks) and
a dilated 1-D convolution branch ((1 - p) * d, dilation 2^i in block i), concatenates them and applies a
feed-forward layer (residual connections and layer norms around both, as in TST, which the paper's figure
omits). With ``attention_ratio=1`` and ``alpha=beta=0`` it is a plain transformer encoder; with
``alpha=beta=0`` it is DC-Transformer: the baselines come from the same classes.

Padding: ``attention_mask`` [B, T] marks the real time steps. Padded steps are zeroed before every
convolution (so a padded series sees the zero border it sees alone), masked as attention keys, left out of the
evolution's convolution (see ``masks.py``) and out of the pooled representation.

This file is copied beside the weights of saved checkpoints (``trust_remote_code``): it imports only torch,
transformers and sibling files (single-dot relative imports).

Example:
    >>> import torch
    >>> config = EADCTransformerConfig(input_size=3, hidden_size=16, num_layers=2, num_attention_heads=2,
    ...                                num_labels=4)
    >>> model = EADCTransformerForTimeSeriesClassification(config)
    >>> out = model(torch.randn(2, 7, 3), attention_mask=torch.tensor([[1] * 7, [1] * 5 + [0] * 2]),
    ...             labels=torch.tensor([0, 3]))
    >>> out.logits.shape, out.loss.shape
    (torch.Size([2, 4]), torch.Size([]))
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, SequenceClassifierOutput
from transformers.utils import ModelOutput

from .attention import evolving_attention_forward
from .call_state import CHAIN_KWARG
from .evolution import AttentionMapEvolution

MODEL_TYPE = "ea-dc-transformer"


class EADCTransformerConfig(PreTrainedConfig):
    """Hyper-parameters of EA-DC-Transformer (the paper's names in brackets).

    Args:
        input_size: number of variables C of the series.
        hidden_size: width d of every block.
        num_layers: number of blocks n.
        num_attention_heads: heads of the attention branch.
        attention_ratio: share p of the width given to the attention branch ((1 - p) goes to the dilated
            convolution); 1 gives a plain transformer block, 0 a dilated convolution network.
        alpha, beta, evolution_kernel_size: Evolving Attention across blocks (0, 0: none).
        conv_kernel_size: kernel of the dilated convolutions (dilation 2^i in block i).
        intermediate_size: inner width of the feed-forward layer (default 2 d).
        dropout: dropout of every branch and of the positional input.
        max_position_embeddings: longest series (learned positional embeddings).
        mask_ratio: share of the input values hidden for pre-training (r).
        num_targets: outputs of the regression head.
    """

    model_type = MODEL_TYPE

    def __init__(
        self,
        *,
        input_size: int = 1,
        hidden_size: int = 64,
        num_layers: int = 3,
        num_attention_heads: int = 8,
        attention_ratio: float = 0.25,
        alpha: float = 0.2,
        beta: float = 0.2,
        evolution_kernel_size: int = 3,
        conv_kernel_size: int = 3,
        intermediate_size: int | None = None,
        dropout: float = 0.1,
        max_position_embeddings: int = 512,
        mask_ratio: float = 0.15,
        num_targets: int = 1,
        layer_norm_eps: float = 1e-5,
        initializer_range: float = 0.02,
        **kwargs: Any,
    ) -> None:
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.num_attention_heads = num_attention_heads
        self.attention_ratio = attention_ratio
        self.alpha = alpha
        self.beta = beta
        self.evolution_kernel_size = evolution_kernel_size
        self.conv_kernel_size = conv_kernel_size
        self.intermediate_size = intermediate_size or 2 * hidden_size
        self.dropout = dropout
        self.max_position_embeddings = max_position_embeddings
        self.mask_ratio = mask_ratio
        self.num_targets = num_targets
        self.layer_norm_eps = layer_norm_eps
        self.initializer_range = initializer_range
        super().__init__(**kwargs)
        problems = []
        if not 0.0 <= attention_ratio <= 1.0:
            problems.append(f"attention_ratio must be in [0, 1], got {attention_ratio}")
        if self.attention_width % max(num_attention_heads, 1) != 0:
            problems.append(
                f"the attention branch ({self.attention_width} = attention_ratio x hidden_size) must split "
                f"evenly into {num_attention_heads} heads"
            )
        if conv_kernel_size % 2 == 0 or evolution_kernel_size % 2 == 0:
            problems.append("conv_kernel_size and evolution_kernel_size must be odd")
        if not (0.0 <= alpha <= 1.0 and 0.0 <= beta <= 1.0):
            problems.append(f"alpha and beta must be in [0, 1], got {alpha}, {beta}")
        if problems:
            raise ValueError("Invalid EA-DC-Transformer config: " + "; ".join(problems))

    @property
    def attention_width(self) -> int:
        return round(self.attention_ratio * self.hidden_size)

    @property
    def evolving_attention(self) -> dict[str, dict[str, Any]]:
        """The evolution of the attention branch as the EA models of ``ea_hf.patch`` store theirs (one chain of
        encoder self-attention over every block), for model cards and summaries."""
        settings = {"alpha": self.alpha, "beta": self.beta, "kernel_size": self.evolution_kernel_size}
        return {"encoder": {**settings, "layers": None, "init": "kaiming_uniform", "method": "conv"}}


class DilatedConvolution(nn.Module):
    """One block's dilated 1-D convolution over time (same length out), fed zeros at padded steps."""

    def __init__(self, config: EADCTransformerConfig, layer: int) -> None:
        super().__init__()
        dilation = 2**layer
        self.conv = nn.Conv1d(
            config.hidden_size,
            config.hidden_size - config.attention_width,
            config.conv_kernel_size,
            dilation=dilation,
            padding=dilation * (config.conv_kernel_size // 2),
        )

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if mask is not None:
            hidden = hidden * mask[..., None]
        return F.gelu(self.conv(hidden.transpose(1, 2)).transpose(1, 2))


class EvolvingSelfAttention(nn.Module):
    """Multi-head self-attention of width p * d whose attention maps evolve across blocks (eq. 6)."""

    def __init__(self, config: EADCTransformerConfig, layer: int) -> None:
        super().__init__()
        width = config.attention_width
        self.num_heads = config.num_attention_heads
        self.head_dim = width // self.num_heads
        self.query = nn.Linear(config.hidden_size, width)
        self.key = nn.Linear(config.hidden_size, width)
        self.value = nn.Linear(config.hidden_size, width)
        self.output = nn.Linear(width, width)
        self.dropout = config.dropout
        if config.alpha or config.beta:
            self.evolving_attention = AttentionMapEvolution(
                self.num_heads,
                alpha=config.alpha,
                beta=config.beta,
                kernel_size=config.evolution_kernel_size,
                position=layer,
                previous=layer - 1 if layer > 0 else None,
            )

    def forward(
        self, hidden: torch.Tensor, allowed: torch.Tensor | None, chain: dict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch, length, _ = hidden.shape

        def heads(projection: nn.Linear) -> torch.Tensor:
            return projection(hidden).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)

        output, probs = evolving_attention_forward(
            self,
            heads(self.query),
            heads(self.key),
            heads(self.value),
            allowed,
            dropout=self.dropout if self.training else 0.0,
            **{CHAIN_KWARG: chain},
        )
        return self.output(output.reshape(batch, length, -1)), probs


class EADCTransformerBlock(nn.Module):
    """R = [attention branch, dilated convolution branch]; then the feed-forward layer (eq. 10)."""

    def __init__(self, config: EADCTransformerConfig, layer: int) -> None:
        super().__init__()
        self.attention = EvolvingSelfAttention(config, layer) if config.attention_width else None
        self.convolution = DilatedConvolution(config, layer) if config.attention_width < config.hidden_size else None
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.feed_forward = nn.Sequential(
            nn.Linear(config.hidden_size, config.intermediate_size),
            nn.ReLU(),
            nn.Dropout(config.dropout),
            nn.Linear(config.intermediate_size, config.hidden_size),
        )
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, hidden, mask, allowed, chain):
        parts, probs = [], None
        if self.attention is not None:
            attended, probs = self.attention(hidden, allowed, chain)
            parts.append(attended)
        if self.convolution is not None:
            parts.append(self.convolution(hidden, mask))
        hidden = self.norm1(hidden + self.dropout(torch.cat(parts, dim=-1)))
        return self.norm2(hidden + self.dropout(self.feed_forward(hidden))), probs


class EADCTransformerPreTrainedModel(PreTrainedModel):
    config_class = EADCTransformerConfig
    base_model_prefix = "dc_transformer"
    main_input_name = "values"
    # Fine-tuning starts from a pre-training checkpoint; dropping its reconstruction layer is the plan.
    _keys_to_ignore_on_load_unexpected = [r"^reconstruction\."]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Conv1d)):
            module.weight.normal_(0.0, std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, std)
        elif isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
            module.bias.zero_()
        elif isinstance(module, AttentionMapEvolution):
            module.reset_parameters()


class EADCTransformerModel(EADCTransformerPreTrainedModel):
    """The encoder: values [B, T, C] -> hidden states [B, T, d] (and each block's attention probabilities)."""

    def __init__(self, config: EADCTransformerConfig) -> None:
        super().__init__(config)
        self.input_projection = nn.Linear(config.input_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(EADCTransformerBlock(config, i) for i in range(config.num_layers))
        self.post_init()

    def forward(
        self,
        values: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        output_attentions: bool = False,
        **kwargs: Any,
    ) -> BaseModelOutput:
        length = values.shape[1]
        if length > self.config.max_position_embeddings:
            raise ValueError(f"series of {length} steps; the model takes at most {self.config.max_position_embeddings}")
        mask = None if attention_mask is None else attention_mask.to(values.dtype)
        if mask is not None:
            values = values * mask[..., None]
        hidden = self.input_projection(values) + self.position_embeddings.weight[:length]
        hidden = self.dropout(hidden)
        # Keys of padded steps are masked; padded query rows are left out of the evolution (masks.py).
        allowed = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        chain: dict = {}  # this call's attention logits, passed from block to block (eq. 6)
        attentions = []
        for block in self.blocks:
            hidden, probs = block(hidden, mask, allowed, chain)
            attentions.append(probs)
        return BaseModelOutput(last_hidden_state=hidden, attentions=tuple(attentions) if output_attentions else None)


def masked_mean(hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The mean over the real time steps: [B, T, d] -> [B, d]."""
    if attention_mask is None:
        return hidden.mean(dim=1)
    weights = attention_mask.to(hidden.dtype)[..., None]
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)


class EADCTransformerForTimeSeriesClassification(EADCTransformerPreTrainedModel):
    """Classification: the mean representation of the real steps -> MLP -> logits; cross-entropy loss."""

    def __init__(self, config: EADCTransformerConfig) -> None:
        super().__init__(config)
        self.dc_transformer = EADCTransformerModel(config)
        self.classifier = nn.Sequential(
            nn.Linear(config.hidden_size, config.hidden_size),
            nn.ReLU(),
            nn.Dropout(config.dropout),
            nn.Linear(config.hidden_size, config.num_labels),
        )
        self.post_init()

    def forward(self, values, attention_mask=None, labels=None, output_attentions=False, **kwargs):
        encoded = self.dc_transformer(values, attention_mask, output_attentions)
        logits = self.classifier(masked_mean(encoded.last_hidden_state, attention_mask))
        loss = None if labels is None else F.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits, attentions=encoded.attentions)


class EADCTransformerForTimeSeriesRegression(EADCTransformerPreTrainedModel):
    """Regression: the mean representation of the real steps -> linear -> ``num_targets`` values; MSE loss."""

    def __init__(self, config: EADCTransformerConfig) -> None:
        super().__init__(config)
        self.dc_transformer = EADCTransformerModel(config)
        self.regressor = nn.Linear(config.hidden_size, config.num_targets)
        self.post_init()

    def forward(self, values, attention_mask=None, labels=None, output_attentions=False, **kwargs):
        encoded = self.dc_transformer(values, attention_mask, output_attentions)
        predictions = self.regressor(masked_mean(encoded.last_hidden_state, attention_mask))
        loss = None
        if labels is not None:
            loss = F.mse_loss(predictions, labels.to(predictions.dtype).view_as(predictions))
        return SequenceClassifierOutput(loss=loss, logits=predictions, attentions=encoded.attentions)


@dataclasses.dataclass
class PreTrainingOutput(ModelOutput):
    loss: torch.Tensor | None = None
    reconstruction: torch.Tensor | None = None
    value_mask: torch.Tensor | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


def random_value_mask(shape: torch.Size, ratio: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """A boolean [B, T, C] mask hiding each value with probability ``ratio`` (True = hidden)."""
    return torch.rand(shape, generator=generator) < ratio


class EADCTransformerForPreTraining(EADCTransformerPreTrainedModel):
    """Masked value reconstruction (eq. 7, 8): hide a share ``mask_ratio`` of the input values, reconstruct
    every value linearly from the representation, and take the MSE over the hidden values of real steps only.

    ``value_mask`` (True = hidden) may be given; otherwise it is drawn from torch's RNG on each call.
    """

    def __init__(self, config: EADCTransformerConfig) -> None:
        super().__init__(config)
        self.dc_transformer = EADCTransformerModel(config)
        self.reconstruction = nn.Linear(config.hidden_size, config.input_size)
        self.post_init()

    def forward(self, values, attention_mask=None, value_mask=None, output_attentions=False, **kwargs):
        if value_mask is None:
            value_mask = random_value_mask(values.shape, self.config.mask_ratio).to(values.device)
        value_mask = value_mask.bool()
        encoded = self.dc_transformer(values.masked_fill(value_mask, 0.0), attention_mask, output_attentions)
        reconstruction = self.reconstruction(encoded.last_hidden_state)
        counted = value_mask if attention_mask is None else value_mask & attention_mask.bool()[..., None]
        loss = ((reconstruction - values) ** 2)[counted].mean() if counted.any() else reconstruction.sum() * 0.0
        return PreTrainingOutput(
            loss=loss, reconstruction=reconstruction, value_mask=value_mask, attentions=encoded.attentions
        )


MODEL_CLASSES = {
    "AutoModel": EADCTransformerModel,
    "AutoModelForSequenceClassification": EADCTransformerForTimeSeriesClassification,
    "AutoModelForPreTraining": EADCTransformerForPreTraining,
}


def register() -> None:
    """Register the config and models with the Auto classes (the regression head has no Auto class of its own:
    load it with ``EADCTransformerForTimeSeriesRegression.from_pretrained``)."""
    transformers.AutoConfig.register(MODEL_TYPE, EADCTransformerConfig, exist_ok=True)
    for auto_name, model_class in MODEL_CLASSES.items():
        getattr(transformers, auto_name).register(EADCTransformerConfig, model_class, exist_ok=True)
    # save_pretrained writes an auto_map, and copies this file (and the sibling files it imports) for trust_remote_code.
    EADCTransformerConfig.register_for_auto_class("AutoConfig")
    for auto_name, model_class in MODEL_CLASSES.items():
        model_class.register_for_auto_class(auto_name)

"""EA-DC-Transformer: the public import path of :mod:`ea_hf.modeling.dc_transformer`
(``from ea_hf.dc_transformer import EADCTransformerConfig, ...``)."""

from .modeling.dc_transformer import (
    MODEL_TYPE,
    EADCTransformerConfig,
    EADCTransformerForPreTraining,
    EADCTransformerForTimeSeriesClassification,
    EADCTransformerForTimeSeriesRegression,
    EADCTransformerModel,
)

__all__ = [
    "MODEL_TYPE",
    "EADCTransformerConfig",
    "EADCTransformerForPreTraining",
    "EADCTransformerForTimeSeriesClassification",
    "EADCTransformerForTimeSeriesRegression",
    "EADCTransformerModel",
]

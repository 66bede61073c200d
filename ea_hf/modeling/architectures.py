"""The architecture table: where each supported transformers architecture keeps its attention.

Each entry is a few lines of data naming the attention classes; everything else is found by walking the module
tree (``attach.py``). Adding an architecture whose attention calls transformers' ``AttentionInterface`` is one
entry in :data:`ARCHITECTURES`.

This file is copied beside the weights of saved EA checkpoints (``trust_remote_code``): it imports only torch,
transformers and sibling files (single-dot relative imports).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import transformers
from torch import nn

from .versions import release  # re-exported: tests and older imports take it from here


@dataclasses.dataclass(frozen=True)
class ArchitectureSpec:
    """Where an architecture keeps its attention.

    Args:
        attention: class names of its attention modules (those that call transformers' attention interface
            with the full logits of one layer).
        num_heads_attribute: attribute of those modules holding the number of heads.
        cross_attention: attribute names under which its layers hold encoder-decoder attention modules.
            Other attention modules are decoder self-attention if their ``is_causal`` is true, else encoder
            self-attention.
        head_dim_attribute: attribute of those modules holding the size of a head; where they lack it, the
            query projection's outputs per head.
        since: the oldest transformers release whose version of the architecture ea_hf supports (its
            attention goes through ``AttentionInterface`` with the full logits), when newer than the oldest
            release ea_hf supports at all; ``patch`` refuses older ones and names this release.
        shared_layers: whether one attention module serves several layers (ALBERT calls one layer's weights at
            every depth). Each call is then the next layer of the chain: it mixes in the logits of the call before
            it, and the evolution module is shared like every other weight of the layer.
        kind: what the architecture is (one of :data:`KINDS`), which decides the guarantees its tests check and
            where the docs list it; set by the section of :data:`ARCHITECTURES` the entry is in.
    """

    attention: tuple[str, ...]
    num_heads_attribute: str = "num_attention_heads"
    cross_attention: tuple[str, ...] = ()
    head_dim_attribute: str = "head_dim"
    since: str | None = None
    shared_layers: bool = False
    kind: str = ""


#: The kinds of architecture, in the order the docs list them.
KINDS = ("text encoder", "vision encoder", "audio encoder", "seq2seq", "decoder-only")
#: The attention roles (see :data:`~.settings.ATTENTION_ROLES`) a model of each kind has: what ``patch``
#: configures, known from the config alone (a test checks it against every architecture's modules).
ROLES_OF_KIND = {
    "text encoder": ("encoder",),
    "vision encoder": ("encoder",),
    "audio encoder": ("encoder",),
    "seq2seq": ("encoder", "decoder", "cross"),
    "decoder-only": ("decoder",),
}


def _known_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}, expected one of {KINDS}")
    return kind


def _of_kind(kind: str, entries: dict[str, ArchitectureSpec]) -> dict[str, ArchitectureSpec]:
    kind = _known_kind(kind)
    return {model_type: dataclasses.replace(spec, kind=kind) for model_type, spec in entries.items()}


_FROM_CONFIG = "config.num_attention_heads"
_QK = "qk_head_dim"  # multi-head latent attention's query/key head size (its values have another)
_BART_FAMILY: dict[str, Any] = {"num_heads_attribute": "num_heads", "cross_attention": ("encoder_attn",)}

_TEXT_ENCODERS: dict[str, ArchitectureSpec] = {
    "bert": ArchitectureSpec(("BertSelfAttention",)),
    "roberta": ArchitectureSpec(("RobertaSelfAttention",)),
    "xlm-roberta": ArchitectureSpec(("XLMRobertaSelfAttention",)),
    "camembert": ArchitectureSpec(("CamembertSelfAttention",)),
    "electra": ArchitectureSpec(("ElectraSelfAttention",)),
    "distilbert": ArchitectureSpec(("DistilBertSelfAttention",), num_heads_attribute="n_heads"),
    "roberta-prelayernorm": ArchitectureSpec(("RobertaPreLayerNormSelfAttention",)),
    "xlm-roberta-xl": ArchitectureSpec(("XLMRobertaXLSelfAttention",)),
    "data2vec-text": ArchitectureSpec(("Data2VecTextSelfAttention",)),
    "ernie": ArchitectureSpec(("ErnieSelfAttention",)),
    "roc_bert": ArchitectureSpec(("RoCBertSelfAttention",)),
    "layoutlm": ArchitectureSpec(("LayoutLMSelfAttention",)),
    # GTE (gte-multilingual-base and kin; in transformers from 5.18): rotary positions, no head count on the module.
    "gte": ArchitectureSpec(("GteAttention",), num_heads_attribute=_FROM_CONFIG, since="5.18.0"),
    "nomic_bert": ArchitectureSpec(("NomicBertAttention",), num_heads_attribute=_FROM_CONFIG),
    # Protein language models (ESM-2): rotary positions, queries scaled before them (the interface's scaling is 1).
    "esm": ArchitectureSpec(("EsmSelfAttention",)),
    # A Llama-like encoder: rotary positions, grouped-query attention possible, every token attends to every other.
    "eurobert": ArchitectureSpec(("EuroBertAttention",), num_heads_attribute=_FROM_CONFIG),
    "albert": ArchitectureSpec(("AlbertAttention",), head_dim_attribute="attention_head_size", shared_layers=True),
    # Local (sliding-window) and global layers form one chain; a local layer's mask removes the entries outside
    # its window, so its convolution never reads them (see masks.py).
    "modernbert": ArchitectureSpec(("ModernBertAttention",), num_heads_attribute=_FROM_CONFIG),
}

_VISION_ENCODERS: dict[str, ArchitectureSpec] = {
    "vit": ArchitectureSpec(("ViTAttention",)),
    "deit": ArchitectureSpec(("DeiTAttention",)),
    "vit_msn": ArchitectureSpec(("ViTMSNAttention",)),
    # DINOv3: rotary positions and register tokens; every token attends to every other.
    "dinov3_vit": ArchitectureSpec(("DINOv3ViTAttention",), num_heads_attribute="num_heads"),
    # CLIP's vision tower alone (CLIPVisionModel; CLIPForImageClassification is built on a whole CLIP config): its
    # text tower attends causally through the same non-causal module, so a whole CLIP model is not in the table.
    "clip_vision_model": ArchitectureSpec(("CLIPAttention",), num_heads_attribute="num_heads"),
    # Before 5.18 its layers did not hand keyword arguments on to the attention (nor was Dinov2Attention the
    # module that called the interface).
    "dinov2": ArchitectureSpec(("Dinov2Attention",), since="5.18.0"),
    "dinov2_with_registers": ArchitectureSpec(("Dinov2WithRegistersAttention",), since="5.18.0"),  # (as DINOv2)
    "ijepa": ArchitectureSpec(("IJepaAttention",)),
}

_AUDIO_ENCODERS: dict[str, ArchitectureSpec] = {
    # Audio Spectrogram Transformer: a ViT over patches of a fixed-length spectrogram (no padding mask).
    "audio-spectrogram-transformer": ArchitectureSpec(("ASTAttention",)),
    # Speech encoders (wav2vec 2.0, HuBERT): a convolutional stem turns the waveform into frames, and a padding
    # mask over the samples becomes one over the frames. Before 5.16 their encoders took no keyword arguments.
    **{
        model_type: ArchitectureSpec((f"{name}Attention",), num_heads_attribute="num_heads", since="5.16.0")
        for model_type, name in {"wav2vec2": "Wav2Vec2", "hubert": "Hubert"}.items()
    },
}

_SEQ2SEQ: dict[str, ArchitectureSpec] = {
    "t5": ArchitectureSpec(("T5Attention",), num_heads_attribute="n_heads", cross_attention=("EncDecAttention",)),
    "mt5": ArchitectureSpec(("MT5Attention",), num_heads_attribute="n_heads", cross_attention=("EncDecAttention",)),
    # Before 5.16 its decoder's self-attention did not say it was causal (is_causal).
    "umt5": ArchitectureSpec(
        ("UMT5Attention",), num_heads_attribute="n_heads", cross_attention=("EncDecAttention",), since="5.16.0"
    ),
    "bart": ArchitectureSpec(("BartAttention",), **_BART_FAMILY),
    "mbart": ArchitectureSpec(("MBartAttention",), **_BART_FAMILY),
    "marian": ArchitectureSpec(("MarianAttention",), **_BART_FAMILY),
    "pegasus": ArchitectureSpec(("PegasusAttention",), **_BART_FAMILY),
    # M2M100's architecture also serves NLLB's dense checkpoints (model_type m2m_100).
    "m2m_100": ArchitectureSpec(("M2M100Attention",), **_BART_FAMILY),
    "blenderbot": ArchitectureSpec(("BlenderbotAttention",), **_BART_FAMILY),
    "blenderbot-small": ArchitectureSpec(("BlenderbotSmallAttention",), **_BART_FAMILY),
    "plbart": ArchitectureSpec(("PLBartAttention",), **_BART_FAMILY),
    # Speech: the encoder reads audio features, which have no padding mask (Whisper pads audio with silence).
    "whisper": ArchitectureSpec(("WhisperAttention",), **_BART_FAMILY),
}

_DECODER_ONLY: dict[str, ArchitectureSpec] = {
    # Decoder-only language models: one causal chain. Grouped-query attention still has a map per query head,
    # so the convolution has num_attention_heads channels; sliding-window layers (Mistral, Qwen, Gemma 2/3/4,
    # Phi-3, StarCoder2, Cohere 2, VaultGemma, GPT-OSS) mask the entries outside their window, which the
    # convolution then never reads; Gemma 2's and VaultGemma's soft-capping applies to S before the evolution (see
    # attention.py). Mixtures of experts (Mixtral, Qwen2/3-MoE, Qwen3.5-MoE, Phi-MoE, DeepSeek-V2/V3, OLMoE,
    # GraniteMoE, GLM-4-MoE, ERNIE 4.5 MoE, Llama 4, GPT-OSS, Mistral 4) differ in their feed-forward layers only.
    # Multimodal wrappers (Gemma 4, Qwen3.5, Llama 4, Mistral 3 over Mistral 4) are not entries: their text
    # models are. Not supported: StableLM and Nemotron, whose decoder layers do not hand transformers' keyword
    # arguments (and so the per-call chain) on to their attention.
    "gpt2": ArchitectureSpec(("GPT2Attention",), num_heads_attribute="num_heads", cross_attention=("crossattention",)),
    "biogpt": ArchitectureSpec(("BioGptAttention",), num_heads_attribute="num_heads"),
    # One key/value head shared by every query head (multi-query attention).
    "gpt_bigcode": ArchitectureSpec(("GPTBigCodeAttention",), num_heads_attribute="num_heads"),
    **{
        model_type: ArchitectureSpec((f"{name}Attention",), num_heads_attribute=_FROM_CONFIG)
        for model_type, name in {
            "llama": "Llama",
            "mistral": "Mistral",
            "qwen2": "Qwen2",
            "qwen3": "Qwen3",
            "gemma2": "Gemma2",
            "gemma3_text": "Gemma3",
            "phi3": "Phi3",
            "gemma": "Gemma",
            "phi": "Phi",
            "olmo2": "Olmo2",
            "granite": "Granite",
            "smollm3": "SmolLM3",
            "starcoder2": "Starcoder2",
            "opt": "OPT",
            "mixtral": "Mixtral",
            "qwen3_moe": "Qwen3Moe",
            "qwen2_moe": "Qwen2Moe",
            "cohere": "Cohere",
            "cohere2": "Cohere2",
            "olmo": "Olmo",
            "glm4": "Glm4",
            "exaone4": "Exaone4",
            "helium": "Helium",
            "phimoe": "Phimoe",
            "olmo3": "Olmo3",
            "ministral": "Ministral",
            "ernie4_5": "Ernie4_5",
            "seed_oss": "SeedOss",
            "apertus": "Apertus",
            "olmoe": "Olmoe",
            "granitemoe": "GraniteMoe",
            "persimmon": "Persimmon",
            "arcee": "Arcee",
            "glm": "Glm",
            "vaultgemma": "VaultGemma",
            "hunyuan_v1_dense": "HunYuanDenseV1",
            "bitnet": "BitNet",
            "ministral3": "Ministral3",
            "jais2": "Jais2",
            "nanochat": "NanoChat",
            "hyperclovax": "HyperCLOVAX",
            "glm4_moe": "Glm4Moe",
            "ernie4_5_moe": "Ernie4_5_Moe",
            "granitemoeshared": "GraniteMoeShared",
            # Full layers have heads of their own size; a KV-sharing layer (E2B, E4B) would run on the last
            # prompt row alone in generate's first step, so a patched stack runs on every row (call_state.start_chain).
            "gemma4_text": "Gemma4Text",
            # Hybrids: only the full-attention layers have this class, so the linear-attention ones (gated delta
            # nets, no map) stay as they are, and the chain passes from one attention layer to the next.
            "qwen3_5_text": "Qwen3_5",
            "qwen3_5_moe_text": "Qwen3_5Moe",
            # Chunked layers mask the keys outside their chunk, as sliding-window layers do.
            "llama4_text": "Llama4Text",
            # A learned sink logit per head joins each row's softmax, not the evolving map (sinks.join_sinks).
            "gpt_oss": "GptOss",
        }.items()
    },
    # Multi-head latent attention (DeepSeek, Mistral 4): queries and keys have a head size of their own (values
    # another). transformers 5.24 maps Mistral4ForCausalLM to no AutoModelForCausalLM (pretraining and
    # image-text-to-text only).
    "deepseek_v2": ArchitectureSpec(("DeepseekV2Attention",), num_heads_attribute="num_heads", head_dim_attribute=_QK),
    "deepseek_v3": ArchitectureSpec(("DeepseekV3Attention",), num_heads_attribute="num_heads", head_dim_attribute=_QK),
    "mistral4": ArchitectureSpec(("Mistral4Attention",), num_heads_attribute="num_heads", head_dim_attribute=_QK),
    # Before 5.24 their attention did not go through AttentionInterface.
    "gptj": ArchitectureSpec(("GPTJAttention",), num_heads_attribute="num_attention_heads", since="5.24.0"),
    "codegen": ArchitectureSpec(("CodeGenAttention",), num_heads_attribute="num_attention_heads", since="5.24.0"),
    # One fused query/key/value projection: the head size is an attribute of its own.
    "gpt_neox": ArchitectureSpec(
        ("GPTNeoXAttention",), num_heads_attribute=_FROM_CONFIG, head_dim_attribute="head_size"
    ),
}

ARCHITECTURES: dict[str, ArchitectureSpec] = {
    **_of_kind("text encoder", _TEXT_ENCODERS),
    **_of_kind("vision encoder", _VISION_ENCODERS),
    **_of_kind("audio encoder", _AUDIO_ENCODERS),
    **_of_kind("seq2seq", _SEQ2SEQ),
    **_of_kind("decoder-only", _DECODER_ONLY),
}
"""Supported architectures: an :class:`ArchitectureSpec` by transformers ``model_type``, grouped by kind (see
:data:`KINDS`). All share the attention-interface path; docs/architectures.md lists them."""


def base_model_type(config) -> str:
    """The transformers model_type of a config, seen through an EA config class (``ea-bert`` -> ``bert``)."""
    return getattr(type(config), "evolving_attention_base", type(config)).model_type


def supported_model_types() -> list[str]:
    """The transformers ``model_type``s that evolving attention supports.

    Returns:
        The keys of :data:`ARCHITECTURES`, sorted.

    Example:
        >>> "bert" in supported_model_types(), "t5" in supported_model_types()
        (True, True)
    """
    return sorted(ARCHITECTURES)


def model_types_of_kind(kind: str) -> list[str]:
    """The supported ``model_type``s of one kind (see :data:`KINDS`), in table order.

    Example:
        >>> model_types_of_kind("seq2seq")[:2]
        ['t5', 'mt5']
    """
    kind = _known_kind(kind)
    return [model_type for model_type, spec in ARCHITECTURES.items() if spec.kind == kind]


def attention_roles_of_config(config) -> tuple[str, ...]:
    """The attention roles of a supported model, from its config alone (no model is built).

    Example:
        >>> attention_roles_of_config(transformers.T5Config())
        ('encoder', 'decoder', 'cross')
    """
    model_type = base_model_type(config)
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"Evolving attention does not support model_type {model_type!r}. "
            f"Supported: {', '.join(supported_model_types())}."
        )
    return ROLES_OF_KIND[ARCHITECTURES[model_type].kind]


def installed_release_supports(spec: ArchitectureSpec) -> bool:
    """Whether the installed transformers is at least the entry's ``since`` release (see :class:`ArchitectureSpec`).

    Example:
        >>> installed_release_supports(ArchitectureSpec(("BertSelfAttention",), since="5.0.0"))
        True
    """
    return spec.since is None or release(transformers.__version__) >= release(spec.since)


def architecture_of(model: nn.Module) -> ArchitectureSpec:
    """The :data:`ARCHITECTURES` entry of a model; ValueError naming the supported ones if it has none, and
    NotImplementedError naming the release to upgrade to if the installed transformers is older than the
    entry's ``since``."""
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"Expected a transformers PreTrainedModel, got {type(model).__name__}")
    model_type = base_model_type(config)
    spec = ARCHITECTURES.get(model_type)
    if spec is None:
        raise ValueError(
            f"Evolving attention does not support model_type {model_type!r} ({type(model).__name__}). "
            f"Supported: {', '.join(supported_model_types())}."
        )
    if not installed_release_supports(spec):
        raise NotImplementedError(
            f"Evolving attention supports {model_type} from transformers {spec.since} on (its attention goes "
            f"through AttentionInterface there); transformers {transformers.__version__} is installed: "
            f'pip install "transformers>={spec.since}"'
        )
    return spec

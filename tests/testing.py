"""Helpers shared by the tests: tiny random models of every architecture and their inputs, comparison helpers
and small GLUE-format samples. Fixtures live in conftest.py; this module is imported by name (``from testing
import tiny_model``; the tests folder is on pytest's ``pythonpath``)."""

import functools
import importlib
import inspect
import json
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pandas as pd
import pytest
import torch
import transformers

import ea_hf
from ea_hf.modeling.architectures import installed_release_supports, model_types_of_kind
from ea_hf.modeling.echo import EchoAttention
from ea_hf.modeling.model_classes import auto_class_names
from ea_hf.training.kinds.glue import GLUE_TASKS

SST2_SAMPLE_DIR = Path(__file__).parent / "fixtures" / "sst2-sample"
#: Overrides that point a ``glue`` recipe (``quickstart``) at the template-generated SST-2-format sample
#: (480 training and 120 validation sentences; see its make_sample.py): small, fast and learnable, for tests
#: of the pipeline. Its scores say nothing about EA.
SST2_SAMPLE = [
    "data.source=local",
    "data.max_train_samples=null",
    f"data.files={{train: {SST2_SAMPLE_DIR / 'train.tsv'}, validation: {SST2_SAMPLE_DIR / 'validation.tsv'}}}",
]

# The architecture lists come from the table, by kind: adding a family there adds it to every test of its kind.
TEXT_ARCHITECTURES = model_types_of_kind("text encoder")
#: One attention module serves every layer (ALBERT): it evolves all its layers or none.
SHARED_LAYER_ARCHITECTURES = [model_type for model_type, spec in ea_hf.ARCHITECTURES.items() if spec.shared_layers]
IMAGE_ARCHITECTURES = model_types_of_kind("vision encoder")
#: Spectrogram classifiers: a ViT over patches of a fixed-length spectrogram (``input_values``), no padding mask.
SPECTROGRAM_ARCHITECTURES = ["audio-spectrogram-transformer"]
#: Speech encoders: a convolutional stem turns the waveform (``input_values``) into frames.
AUDIO_ARCHITECTURES = [t for t in model_types_of_kind("audio encoder") if t not in SPECTROGRAM_ARCHITECTURES]
ARCHITECTURES = TEXT_ARCHITECTURES + IMAGE_ARCHITECTURES + AUDIO_ARCHITECTURES + SPECTROGRAM_ARCHITECTURES
#: Speech-to-text: the encoder reads audio features (``input_features``), without a padding mask.
SPEECH_ARCHITECTURES = ["whisper"]
SEQ2SEQ_ARCHITECTURES = model_types_of_kind("seq2seq")
DECODER_ONLY_ARCHITECTURES = model_types_of_kind("decoder-only")
#: Mixtures of experts: each expert's product runs over the tokens routed to it, so the model's own outputs at a
#: position move by fp32 rounding (about 1e-7) when other tokens change.
MIXTURE_OF_EXPERTS_ARCHITECTURES = ["mixtral", "qwen3_moe", "qwen2_moe", "phimoe", "deepseek_v3", "olmoe", "granitemoe"]
MIXTURE_OF_EXPERTS_ARCHITECTURES += ["glm4_moe", "ernie4_5_moe", "deepseek_v2", "granitemoeshared"]
# (Not Llama 4's: its experts take every token, scaled by its router score.)
MIXTURE_OF_EXPERTS_ARCHITECTURES += ["qwen3_5_moe_text", "gpt_oss", "mistral4"]
ALL_ARCHITECTURES = ARCHITECTURES + SEQ2SEQ_ARCHITECTURES + DECODER_ONLY_ARCHITECTURES
_GEMMA4_LARGE = {"num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0, "attention_k_eq_v": True}
_GEMMA4_LARGE |= {"num_global_key_value_heads": 1, "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2}
_GEMMA4_LARGE |= {"moe_intermediate_size": 16}


def routing_noise(family: str) -> float:
    """How far a decoder family's own outputs at a position may move when other tokens change: 0 (bit-identical),
    or for mixtures of experts fp32 rounding (their experts' products run over the tokens routed to them: up to
    about 2e-6 on the tiny models with 2 threads, unpatched as well). A convolution that leaked across positions
    would move them by 1e-3 and more."""
    model_type, overrides = CAUSAL_LM_FAMILIES[family]
    experts = model_type in MIXTURE_OF_EXPERTS_ARCHITECTURES or overrides.get("enable_moe_block", False)
    return 1e-5 if experts else 0.0


#: How far generation with the KV cache may drift from generation without it, where the unpatched family itself
#: drifts by more than fp32 noise of a few 1e-6: Gemma 4 (per-layer inputs, shared KV) drifts by up to 7e-6
#: unpatched with 2 threads, 1.3e-5 patched. Others: 1e-5.
GENERATION_NOISE = {"gemma4_text": 3e-5}


#: Decoder-only language models, by test id: (model_type, config overrides). The BERT family and the BART family
#: have decoder-only forms too (``is_decoder=True``; ``BartForCausalLM`` and kin).
CAUSAL_LM_FAMILIES = {model_type: (model_type, {}) for model_type in DECODER_ONLY_ARCHITECTURES} | {
    "bert-decoder": ("bert", {"is_decoder": True, "initializer_range": 0.2}),
    "roberta-decoder": ("roberta", {"is_decoder": True, "initializer_range": 0.2}),
    "bart-causal": ("bart", {}),
    "mbart-causal": ("mbart", {}),
    # Gemma 4 as its larger checkpoints are (26B-A4B, 31B): full layers take their keys as values (one head of
    # them), no layer shares another's keys and values, no per-layer embeddings, experts beside the MLP.
    "gemma4_text-k-eq-v": ("gemma4_text", _GEMMA4_LARGE),
}
#: 4-token windows (shorter than the test inputs) on some layers; grouped-query attention (2 key/value heads).
_WINDOW = {"sliding_window": 4, "layer_types": ["full_attention", "sliding_attention", "full_attention"]}
#: 4 layers, the second of them linear attention (Qwen3.5): three attention layers, as the other families have.
#: Weights drawn with std 0.1: the gated delta net computes a prompt in chunks and each new token recurrently, which
#: at std 0.2 (logits up to 3.8) moves the unpatched tiny model's cached logits 4e-5 from its uncached ones.
_FULL, _LINEAR = "full_attention", "linear_attention"
_HYBRID = {"num_hidden_layers": 4, "layer_types": [_FULL, _LINEAR, _FULL, _FULL], "initializer_range": 0.1}
_HYBRID |= {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8}
_HYBRID |= {"linear_value_head_dim": 8}
_DECODER_ONLY_CONFIGS = {
    "gpt2": {"n_inner": 37},
    "llama": {"num_key_value_heads": 2},
    "mistral": {"num_key_value_heads": 2, "sliding_window": 4},
    "qwen2": {"num_key_value_heads": 2, "use_sliding_window": True, **_WINDOW},
    "qwen3": {"num_key_value_heads": 2, "use_sliding_window": True, **_WINDOW},
    # Soft-capping at 1.0: the tiny model's logits exceed it, so the cap changes the maps. Eager attention: sdpa
    # cannot soft-cap (transformers before 5.16 still chose it for Gemma 2, and computed another model).
    "gemma2": {"num_key_value_heads": 2, "attn_logit_softcapping": 1.0, "query_pre_attn_scalar": 8, **_WINDOW}
    | {"attn_implementation": "eager"},
    "gemma3_text": {"num_key_value_heads": 2, "query_pre_attn_scalar": 8, **_WINDOW},
    "phi3": {"num_key_value_heads": 2, "sliding_window": 4},
    "gemma": {"num_key_value_heads": 2},
    "phi": {"num_key_value_heads": 2},
    "gpt_neox": {},
    "olmo2": {"num_key_value_heads": 2},
    # Granite scales S by attention_multiplier, not head_dim ** -0.5 (not a power of two here).
    "granite": {"num_key_value_heads": 2, "attention_multiplier": 0.3},
    "smollm3": {"num_key_value_heads": 2},
    "starcoder2": {"num_key_value_heads": 2, "sliding_window": 4},
    "opt": {"ffn_dim": 37},
    # 4 experts, 2 per token (the experts' grouped products want rows of a multiple of 16 bytes).
    "mixtral": {"num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 40},
    "qwen3_moe": {"num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
    "qwen2_moe": {"num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    | {"shared_expert_intermediate_size": 16},
    "cohere": {"num_key_value_heads": 2},
    "exaone4": {"num_key_value_heads": 2},
    "helium": {"num_key_value_heads": 2},
    "phimoe": {"num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 40},
    # Multi-head latent attention (low-rank queries and keys/values; 8 rotary and 8 other query/key dimensions),
    # a dense first layer, then 4 routed experts.
    "deepseek_v3": {"q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8}
    | {"v_head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    | {"first_k_dense_replace": 1, "n_group": 1, "topk_group": 1},
    "cohere2": {"num_key_value_heads": 2, **_WINDOW},
    "olmo": {"num_key_value_heads": 2},
    "glm4": {"num_key_value_heads": 2},
    # Multi-query attention: one key/value head.
    "gpt_bigcode": {"n_inner": 37},
    # Rotary embeddings on the first 4 of each head's 8 dimensions.
    "gptj": {"rotary_dim": 4, "n_inner": 37},
    "olmo3": {"num_key_value_heads": 2, **_WINDOW},
    "ministral": {"num_key_value_heads": 2, **_WINDOW},
    # Multi-head attention (no key/value heads to group); learned positions counted from the first real token.
    "biogpt": {},
    "ernie4_5": {"num_key_value_heads": 2},
    "seed_oss": {"num_key_value_heads": 2},
    "apertus": {"num_key_value_heads": 2},
    "olmoe": {"num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 16},
    "granitemoe": {"num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 16},
    "codegen": {"rotary_dim": 4, "n_inner": 37},
    "persimmon": {},
    "arcee": {"num_key_value_heads": 2},
    "glm": {"num_key_value_heads": 2},
    # As Gemma 2 (soft-capping, eager attention), with the sliding window on the middle layer.
    "vaultgemma": {"num_key_value_heads": 2, "attn_logit_softcapping": 1.0, "query_pre_attn_scalar": 8, **_WINDOW}
    | {"attn_implementation": "eager"},
    "hunyuan_v1_dense": {"num_key_value_heads": 2},
    "bitnet": {"num_key_value_heads": 2},
    "ministral3": {"num_key_value_heads": 2},
    "jais2": {"num_key_value_heads": 2},
    "nanochat": {"num_key_value_heads": 2},
    "hyperclovax": {"num_key_value_heads": 2},
    "glm4_moe": {"num_key_value_heads": 2, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    | {"first_k_dense_replace": 1, "n_group": 1, "topk_group": 1},
    "ernie4_5_moe": {"num_key_value_heads": 2, "moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 16}
    | {"moe_num_shared_experts": 1, "moe_layer_start_index": 1, "moe_layer_end_index": 2},
    "deepseek_v2": {"q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8}
    | {"v_head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    | {"first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "n_shared_experts": 1},
    "granitemoeshared": {"num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2}
    | {"intermediate_size": 16, "shared_intermediate_size": 16},
    # As its small checkpoints are (E2B, E4B): full layers with heads of their own size (16), the last layer
    # reusing the keys and values of the one before of its type, per-layer embeddings (over 99 ids).
    "gemma4_text": {"num_key_value_heads": 2, "global_head_dim": 16, "num_kv_shared_layers": 1, **_WINDOW}
    | {"vocab_size_per_layer_input": 99, "hidden_size_per_layer_input": 8},
    # Hybrid: layer 1 is linear attention (a gated delta net, left as it is); layers 0, 2 and 3 attend.
    "qwen3_5_text": {"num_key_value_heads": 2, **_HYBRID},
    "qwen3_5_moe_text": {"num_key_value_heads": 2, **_HYBRID, "num_experts": 4, "num_experts_per_tok": 2}
    | {"moe_intermediate_size": 16, "shared_expert_intermediate_size": 16},
    # Full attention without rotary positions (NoPE) on layers 0 and 2, 4-token chunks on layer 1; 4 experts.
    "llama4_text": {"num_key_value_heads": 2, "no_rope_layers": [0, 1, 0], "attention_chunk_size": 4}
    | {"num_local_experts": 4, "intermediate_size": 16, "intermediate_size_mlp": 37},
    # Attention sinks; full, sliding, full; 4 experts.
    "gpt_oss": {"num_key_value_heads": 2, **_WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2}
    | {"intermediate_size": 16},
    # Multi-head latent attention as DeepSeek-V3's (head_dim is the query/key head size, for the rotary share),
    # a dense first layer, then 4 routed experts.
    "mistral4": {"q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "head_dim": 16}
    | {"v_head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    | {"first_k_dense_replace": 1, "n_group": 1, "topk_group": 1},
}
#: Triton's CPU interpreter runs the kernels from this release on (3.6's interpreter fails on them); compiling
#: them needs ea_hf.ops.triton.common.MIN_TRITON.
INTERPRETER_TRITON = "3.9"

NUM_LAYERS = 3
NUM_HEADS = 4
VOCAB_SIZE = 99
IMAGE_SIZE = 16
MEL_BINS = 8
SOURCE_FRAMES = 12


PAD, BOS, EOS = 1, 0, 2  # special token ids of the tiny seq2seq configs


def run_without_ea_hf(script: str, *arguments: str, folder) -> object:
    """Run ``script`` in a fresh interpreter that loads EA checkpoints as remote code (``trust_remote_code``,
    the modules cached in ``folder``), and return the JSON its last line prints."""
    env = {**os.environ, "PYTHONPATH": "", "HF_MODULES_CACHE": str(folder / "modules")}
    run = subprocess.run(
        [sys.executable, "-c", script, *arguments], capture_output=True, text=True, env=env, cwd=folder, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def bench_script(script: str):
    """A script of ``bench/`` (not a package: ``"benchmarks/decoder_cpu"``, ``"analyses/roofline"``) as a module,
    loaded from its file under the name ``bench_<its stem>``."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / f"{script}.py"
    name = f"bench_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)  # where its dataclasses look their module up
    spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def bench_harness(module: str):
    """A module of ``bench/harness/`` (the package the benchmark scripts share), imported as the scripts import it:
    ``harness.<module>`` with ``bench/`` on ``sys.path``."""
    import importlib

    folder = str(Path(__file__).resolve().parents[1] / "bench")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(f"harness.{module}")


def spy_on(monkeypatch, module, names=("correlate", "backward")) -> list[str]:
    """The names of ``module``'s functions ``names`` as they are called, in order (a fused kernel module's entry
    points by default): proof of which kernels an evolution ran on."""
    called = []
    for name in names:
        original = getattr(module, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            called.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return called


def recorded_triton_launches(
    monkeypatch, kernels, call, names=("correlate", "input_grad", "weight_grad")
) -> list[tuple[str, tuple, dict, list[dict]]]:
    """(kernel name, positional arguments, constexpr switches, configurations) of every launch that ``call()``
    makes through the kernels ``names`` of a Triton kernel module (``ea_hf.ops.triton.evolution`` or
    ``attention_tail``, passed as ``kernels``) as it would on a GPU (the configurations and the precision of
    products for a compiled kernel; see ``ea_hf.ops.triton.common.launch``), without running any: the outputs are
    left unwritten."""
    from ea_hf.ops.triton import common

    launches = []

    def record(family, name, configs, grid, args, switches):
        assert family is kernels.jitted and name in names, name
        launches.append((name, args, dict(switches), list(configs)))

    with monkeypatch.context() as patch:
        patch.setattr(common, "launch", record)
        patch.setattr(common, "interpreting", lambda: False)  # for the precision of products
        call()
    return launches


#: Triton's signature types of the tensors the kernels take.
_TRITON_POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.bool: "*i1",
    torch.int8: "*i8",
    torch.uint8: "*u8",
}


def compile_for_cuda(kernel, args: tuple, kwargs: dict, capability: int):
    """``kernel`` (a ``triton.jit`` function) compiled for a CUDA GPU of compute ``capability`` (90: an H100) as
    a launch with ``args`` and ``kwargs`` would compile it, without a GPU: Triton's whole compiler down to the
    cubin (with the ptxas it ships). Tensors become pointers of their dtype, ``None`` and the parameters the
    kernel declares ``tl.constexpr`` constexprs, as a launch binds them. Keyword arguments (except the launch
    options ``num_warps`` and ``num_stages``) must be declared constexprs: a launch passes any other one as a
    run-time value, which fails on a GPU for a string (and the kernels pass their tiles and switches by keyword)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(kernel.arg_names)
    declared = {parameter.name for parameter in kernel.params if parameter.is_constexpr}
    kwargs = dict(kwargs)
    options = {name: kwargs.pop(name) for name in ("num_warps", "num_stages") if name in kwargs}
    undeclared = sorted(set(kwargs) - declared)
    assert not undeclared, f"{kernel.__name__}: keyword arguments not declared tl.constexpr: {undeclared}"
    signature, constants = {}, {}
    for name, value in [*zip(names, args, strict=False), *kwargs.items()]:
        if value is None or name in declared:
            signature[name], constants[(names.index(name),)] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = _TRITON_POINTER_TYPES[value.dtype]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif isinstance(value, int) and not isinstance(value, bool):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        else:
            raise TypeError(f"no Triton type for {name} = {value!r}")
    missing = set(names) - set(signature)
    assert not missing, f"arguments not passed: {missing}"
    source = ASTSource(fn=kernel, signature={name: signature[name] for name in names}, constexprs=constants)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)


def tiny_config(model_type: str, **overrides) -> transformers.PreTrainedConfig:
    """A small random config of an architecture: 3 layers (per stack), 4 heads, hidden size 32."""
    common = dict(hidden_size=32, num_hidden_layers=NUM_LAYERS, num_attention_heads=NUM_HEADS, intermediate_size=37)
    special = dict(pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, decoder_start_token_id=BOS)
    if model_type in ("t5", "mt5", "umt5"):
        kwargs = dict(
            special,
            vocab_size=VOCAB_SIZE,
            d_model=32,
            d_kv=8,
            d_ff=37,
            num_layers=NUM_LAYERS,
            num_heads=NUM_HEADS,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
        )
    elif model_type in SEQ2SEQ_ARCHITECTURES:
        if model_type in SPEECH_ARCHITECTURES:  # MEL_BINS features, 2 * SOURCE_FRAMES frames (the stem halves them)
            special |= dict(num_mel_bins=MEL_BINS, max_source_positions=SOURCE_FRAMES, max_target_positions=64)
            special |= dict(suppress_tokens=None, begin_suppress_tokens=None)
        # BART-family weights are drawn with std 0.02 by default, which makes every attention map nearly
        # uniform; a larger std gives the tiny models attention worth evolving.
        kwargs = dict(
            special,
            vocab_size=VOCAB_SIZE,
            d_model=32,
            encoder_layers=NUM_LAYERS,
            decoder_layers=NUM_LAYERS,
            encoder_attention_heads=NUM_HEADS,
            decoder_attention_heads=NUM_HEADS,
            encoder_ffn_dim=37,
            decoder_ffn_dim=37,
            max_position_embeddings=64,
            init_std=0.2,
        )
    elif model_type == "modernbert":
        # Global, local (a window of 2 tokens each side, so the 9-token test inputs have masked entries), global.
        kwargs = dict(common, vocab_size=VOCAB_SIZE, max_position_embeddings=64, local_attention=4)
        kwargs |= dict(layer_types=["full_attention", "sliding_attention", "full_attention"], pad_token_id=0)
        kwargs |= dict(bos_token_id=1, cls_token_id=1, eos_token_id=2, sep_token_id=2, initializer_range=0.2)
    elif model_type in DECODER_ONLY_ARCHITECTURES:
        # Weights drawn with std 0.2 (not 0.02) so the tiny models' attention maps are far from uniform.
        kwargs = dict(common, **special, vocab_size=VOCAB_SIZE, max_position_embeddings=64, initializer_range=0.2)
        kwargs |= dict(head_dim=8, attention_dropout=0.0) | _DECODER_ONLY_CONFIGS.get(model_type, {})
        if model_type in ("gpt2", "gpt_bigcode"):
            del kwargs["head_dim"], kwargs["attention_dropout"], kwargs["intermediate_size"]
            kwargs |= dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    elif model_type in AUDIO_ARCHITECTURES:
        # The stem (kernels 8 and 4, strides 4 and 2) makes 8 samples a frame (see audio_samples). Layer norms in
        # the stem and before each layer (as wav2vec2-large-lv60 and HuBERT-large): the layout that takes a padding
        # mask. No SpecAugment masking or layer drop: training steps compare runs.
        kwargs = dict(common, conv_dim=(8, 8), conv_stride=(4, 2), conv_kernel=(8, 4), vocab_size=20)
        kwargs |= dict(num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, feat_extract_norm="layer")
        kwargs |= dict(do_stable_layer_norm=True, mask_time_prob=0.0, layerdrop=0.0, initializer_range=0.2)
        kwargs |= dict(tdnn_dim=(8, 8), tdnn_kernel=(3, 1), tdnn_dilation=(1, 1), xvector_output_dim=8)
    elif model_type in SPECTROGRAM_ARCHITECTURES:  # 24 frames x 16 mel bins in 4 x 4 patches, 6 x 4 of them
        kwargs = dict(common, num_mel_bins=16, max_length=24, patch_size=4, frequency_stride=4, time_stride=4)
    elif model_type == "distilbert":
        kwargs = dict(dim=32, n_layers=NUM_LAYERS, n_heads=NUM_HEADS, hidden_dim=37, vocab_size=VOCAB_SIZE)
    elif model_type in IMAGE_ARCHITECTURES:
        kwargs = dict(common, image_size=IMAGE_SIZE, patch_size=4, num_channels=3)
        if model_type in ("dinov3_vit", "dinov2_with_registers"):  # register tokens, as released (4 there)
            kwargs["num_register_tokens"] = 2
        if model_type == "ijepa":  # std 0.2: with 0.02 its logits are near 0, and the last ReLU gate all closed
            kwargs["initializer_range"] = 0.2
    else:
        kwargs = dict(common, vocab_size=VOCAB_SIZE, max_position_embeddings=64)
        if model_type in ("electra", "albert"):
            kwargs["embedding_size"] = 16
        if model_type in ("nomic_bert", "roc_bert", "layoutlm", "gte"):  # std 0.2 (not 0.02): the tiny models'
            # maps are then far from uniform
            kwargs["initializer_range"] = 0.2
        if model_type == "eurobert":  # (its special tokens default to ids of its 128k vocabulary)
            kwargs |= dict(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, mask_token_id=4, num_key_value_heads=2)
        if model_type == "esm":  # as ESM-2: rotary positions, masked-token dropout scaling in the embeddings
            kwargs |= dict(pad_token_id=PAD, mask_token_id=4, position_embedding_type="rotary", token_dropout=True)
    kwargs.update(overrides)
    return transformers.CONFIG_MAPPING[model_type](**kwargs)


def seq2seq_head(model_type: str):
    """The Auto class of a seq2seq architecture's generating head (speech: ``AutoModelForSpeechSeq2Seq``)."""
    if model_type in SPEECH_ARCHITECTURES:
        return transformers.AutoModelForSpeechSeq2Seq
    return transformers.AutoModelForSeq2SeqLM


def causal_lm(family: str, seed: int = 0, **overrides):
    """A tiny random causal LM of one of :data:`CAUSAL_LM_FAMILIES`, in eval mode."""
    model_type, family_overrides = CAUSAL_LM_FAMILIES[family]
    head = transformers.AutoModelForCausalLM
    if "AutoModelForCausalLM" not in auto_class_names(model_type):  # Mistral 4: transformers maps its causal LM
        head = transformers.AutoModelForPreTraining  # as a pretraining and an image-text-to-text model only
    return tiny_model(model_type, head, seed, **family_overrides, **overrides)


def left_padded_inputs(batch: int = 3, length: int = 9, seed: int = 1) -> dict[str, torch.Tensor]:
    """Prompts for a causal LM, left-padded (with PAD) to different lengths as ``generate`` expects."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, VOCAB_SIZE, (batch, length), generator=generator)
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(1, batch):
        attention_mask[row, : 2 * row] = 0
    return {"input_ids": input_ids.masked_fill(attention_mask == 0, PAD), "attention_mask": attention_mask}


def tiny_model(model_type: str, auto_class=transformers.AutoModel, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return auto_class.from_config(tiny_config(model_type, **overrides)).eval()


#: Settings of each evolution method (and kernel size) that change the model; see `patched_model`.
METHODS = {
    "conv": {"method": "conv", "alpha": 0.5, "beta": 0.5},
    "residual": {"method": "residual", "alpha": 0.5},
    "echo": {"method": "echo", "echoes": 2},
    "echo-row": {"method": "echo", "echoes": 3, "echo_state": "row", "max_positions": 32},
    "echo-column": {"method": "echo", "echoes": 1, "echo_state": "column", "max_positions": 32},
    "conv-1x1": {"method": "conv", "alpha": 0.5, "beta": 0.5, "kernel_size": 1},
    "conv-5x5": {"method": "conv", "alpha": 0.5, "beta": 0.5, "kernel_size": 5},
}


def patched_model(model_type: str, settings: dict, head=transformers.AutoModel, **overrides):
    """A tiny model patched with ``settings``; echo state scales drawn non-zero so echo changes the model (as
    patched, they are zero and the model computes what the original does)."""
    model = ea_hf.patch(tiny_model(model_type, head, **overrides), **settings)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, EchoAttention):
                module.state_scale.uniform_(0.5, 1.5)
                module.gate_weight.normal_(0.0, 0.5)
    return model.eval()


def audio_samples(frames: int) -> int:
    """Samples of a waveform that the tiny speech encoders' stem turns into ``frames`` frames."""
    return 8 * frames + 16


def tiny_inputs(model_type: str, batch: int = 3, length: int = 9, seed: int = 1) -> dict[str, torch.Tensor]:
    """Inputs for a tiny model; text batches are right-padded to different lengths.

    Seq2seq inputs end each source sequence with EOS (classification heads pool there) and add decoder inputs.
    """
    generator = torch.Generator().manual_seed(seed)

    def decoder_input_ids() -> torch.Tensor:
        ids = torch.randint(5, VOCAB_SIZE, (batch, length - 2), generator=generator)
        ids[:, 0] = BOS
        return ids

    if model_type in IMAGE_ARCHITECTURES:
        return {"pixel_values": torch.randn(batch, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)}
    if model_type in SPECTROGRAM_ARCHITECTURES:
        return {"input_values": torch.randn(batch, 24, 16, generator=generator)}
    if model_type in AUDIO_ARCHITECTURES:  # right-padded with silence, `length` frames at most
        attention_mask = torch.ones(batch, audio_samples(length), dtype=torch.long)
        for row in range(1, batch):
            attention_mask[row, audio_samples(length - 2 * row) :] = 0
        waveform = torch.randn(batch, audio_samples(length), generator=generator) * attention_mask
        return {"input_values": waveform, "attention_mask": attention_mask}
    if model_type in SPEECH_ARCHITECTURES:
        targets = decoder_input_ids()
        features = torch.randn(batch, MEL_BINS, 2 * SOURCE_FRAMES, generator=generator)
        return {"input_features": features, "decoder_input_ids": targets}
    input_ids = torch.randint(5, VOCAB_SIZE, (batch, length), generator=generator)
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(1, batch):
        attention_mask[row, length - 2 * row :] = 0
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if model_type in SEQ2SEQ_ARCHITECTURES:
        real = attention_mask.sum(-1)
        input_ids[attention_mask == 0] = PAD
        input_ids[torch.arange(batch), real - 1] = EOS
        inputs["decoder_input_ids"] = decoder_input_ids()
    return inputs


# Representatives: the fast run's share of each table ----------------------------------------------------------------

#: The mark of a test (or one family of a table) that only CI's second stage runs (``pytest -m full_table``); the
#: README's test command deselects it (``-m "not full_table"``).
FULL_TABLE = pytest.mark.full_table


@functools.cache
def attention_features(family: str) -> frozenset[str]:
    """What a family's tiny model (:func:`tiny_config`, with a :data:`CAUSAL_LM_FAMILIES` id's overrides) is, as far
    as evolving attention takes different paths: its kind and inputs, and the attention variants of its layers
    (grouped or multi-query heads, sliding-window, chunked and linear layers, soft-capping, sinks, position bias,
    rotary positions, cross-attention, shared layers, experts, an attention module's own head size...), read off
    the architecture table, the config and the attention class's call of the attention interface.

    Example:
        >>> sorted(attention_features("gemma2") - attention_features("mistral"))
        ['soft-capping']
    """
    model_type, overrides = CAUSAL_LM_FAMILIES.get(family, (family, {}))
    spec = ea_hf.ARCHITECTURES[model_type]
    config = tiny_config(model_type, **overrides).to_dict()  # (a dict: some configs refuse per-layer attributes)
    features = {spec.kind, "inputs: " + ", ".join(sorted(tiny_inputs(model_type, batch=1, length=3)))}
    if family in CAUSAL_LM_FAMILIES and spec.kind != "decoder-only":
        features.add("causal form")  # BertForCausalLM, BartForCausalLM and kin
    if spec.cross_attention:
        features.add("cross-attention")
    if spec.shared_layers:
        features.add("shared layers")
    if spec.head_dim_attribute != "head_dim":
        features.add(f"head size from {spec.head_dim_attribute}")
    key_value_heads = config.get("num_key_value_heads")
    if config.get("multi_query") or key_value_heads == 1:
        features.add("multi-query")
    elif key_value_heads is not None and key_value_heads < config.get("num_attention_heads", NUM_HEADS):
        features.add("grouped-query")
    features |= set(config.get("layer_types") or ()) - {"full_attention"}
    if config.get("sliding_window") and config.get("use_sliding_window", True):
        features.add("sliding_attention")
    named = {
        "attention_chunk_size": "chunked_attention",
        "attn_logit_softcapping": "soft-capping",
        "relative_attention_num_buckets": "position bias",
        "alibi": "alibi",
        "num_kv_shared_layers": "layers sharing keys and values",
        "attention_k_eq_v": "keys as values",
        "num_register_tokens": "register tokens",
    }
    features |= {feature for key, feature in named.items() if config.get(key)}
    rotary = ("rope_parameters", "rope_theta", "rotary_dim")
    if any(config.get(key) for key in rotary) or config.get("position_embedding_type") == "rotary":
        features.add("rotary positions")
    if model_type in MIXTURE_OF_EXPERTS_ARCHITECTURES or overrides.get("enable_moe_block"):
        features.add("experts")
    modeling = importlib.import_module(
        transformers.CONFIG_MAPPING[model_type].__module__.replace(".configuration_", ".modeling_")
    )
    if "s_aux" in inspect.getsource(getattr(modeling, spec.attention[0]).forward):
        features.add("sinks")  # a learned sink logit per head, handed to the attention interface
    return frozenset(features)


def representatives(families: Iterable[str]) -> list[str]:
    """Few of ``families`` (architecture table ``model_type``s or :data:`CAUSAL_LM_FAMILIES` ids) that together
    show every kind and attention variant of them (each feature of :func:`attention_features`), among those the
    installed transformers supports (the others skip): the families a table test runs in the fast run. Chosen
    greedily, the family that adds the most features not yet shown first (ties: the earlier one), so a family with
    a feature no other has is always chosen, and adding one with a new feature adds it to the fast run.
    Combinations of features are CI's second stage (every family).

    Example:
        >>> representatives(["bert", "roberta", "modernbert", "llama", "mistral", "qwen2"])
        ['bert', 'mistral']
        >>> sorted({ea_hf.ARCHITECTURES[family].kind for family in representatives(ALL_ARCHITECTURES)})
        ['audio encoder', 'decoder-only', 'seq2seq', 'text encoder', 'vision encoder']
    """
    families = list(families)
    # (A family the installed transformers lacks has no config class to read features from; it skips anyway.)
    supported = [family for family in families if installed_release_supports(_spec_of(family))]
    features = {family: attention_features(family) for family in supported}
    shown: set[str] = set()
    chosen: set[str] = set()
    while supported:
        family = max(supported, key=lambda family: len(features[family] - shown))
        if not features[family] - shown:
            break
        chosen.add(family)
        shown |= features[family]
    return [family for family in families if family in chosen]


def _spec_of(family: str):
    return ea_hf.ARCHITECTURES[CAUSAL_LM_FAMILIES.get(family, (family, {}))[0]]


def table(values: Iterable, family_at: int | None = None) -> list:
    """Values for ``pytest.mark.parametrize`` over the families of a table: :func:`representatives` as they are,
    the others marked :data:`FULL_TABLE`, so that the fast run tests each kind and attention variant and CI's
    second stage every family. ``values`` are families, or tuples of parameters with the family at ``family_at``;
    representatives are then chosen among the tuples alike in their other parameters (each head of a family, each
    collator...).

    Example:
        >>> [bool(value.marks) for value in table(["bert", "llama", "olmo"])]
        [False, False, True]
        >>> [bool(value.marks) for value in table([("a", "llama"), ("a", "olmo"), ("b", "olmo")], family_at=1)]
        [False, True, False]
    """
    values = [value if family_at is not None else (value,) for value in values]
    position = family_at or 0
    families_alike: dict[tuple, list[str]] = {}
    for value in values:
        families_alike.setdefault(value[:position] + value[position + 1 :], []).append(value[position])
    fast = {(others, family) for others, families in families_alike.items() for family in representatives(families)}
    return [
        pytest.param(
            *value, marks=() if (value[:position] + value[position + 1 :], value[position]) in fast else FULL_TABLE
        )
        for value in values
    ]


def example_alone(model_type: str, inputs: dict[str, torch.Tensor], row: int) -> tuple[dict[str, torch.Tensor], int]:
    """Example ``row`` of a padded batch of :func:`tiny_inputs`, unpadded and alone, and how many positions of
    the model's output it has (tokens, or frames of a speech encoder)."""
    valid = int(inputs["attention_mask"][row].sum())
    if model_type in AUDIO_ARCHITECTURES:
        frames = (valid - 16) // 8  # (inverts audio_samples)
        assert audio_samples(frames) == valid
        return {"input_values": inputs["input_values"][row : row + 1, :valid]}, frames
    return {"input_ids": inputs["input_ids"][row : row + 1, :valid]}, valid


def first_output(outputs) -> torch.Tensor:
    """The first tensor of a model output (hidden states or logits)."""
    return outputs[0]


#: Architectures with local (sliding-window or chunked) layers, where the rows of some padding tokens have no key
#: left to attend to. What such a row computes is undefined: transformers' own sdpa and eager attention already disagree
#: there (0.44 on the tiny ModernBERT), so outputs of these models are compared at real tokens.
SLIDING_WINDOW_ARCHITECTURES = [
    "modernbert",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3_text",
    "phi3",
    "starcoder2",
    "cohere2",
    "olmo3",
    "ministral",
    "gemma4_text",
    "llama4_text",  # (4-token chunks)
    "gpt_oss",
]


def attention_layers(config) -> dict[int, str]:
    """The layers of a tiny decoder that attend, with their attention type (``config.layer_types``: full,
    sliding-window or chunked; one type where it has none). Linear-attention layers (Qwen3.5's gated delta
    nets) have no attention map, and are not among them."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return {layer: kind for layer, kind in enumerate(types) if kind != "linear_attention"}


def defined(model_type: str, inputs: dict[str, torch.Tensor], output: torch.Tensor) -> torch.Tensor:
    """The part of a [B, N, ...] output that the model defines: every position, or for
    :data:`SLIDING_WINDOW_ARCHITECTURES` the real tokens of ``inputs["attention_mask"]``."""
    if model_type not in SLIDING_WINDOW_ARCHITECTURES or "attention_mask" not in inputs:
        return output
    return output[inputs["attention_mask"].bool()]


def enable_checkpointing(model, **checkpointing_kwargs) -> None:
    """Gradient (activation) checkpointing, by the name the installed transformers gives it (5.23 renamed
    ``gradient_checkpointing_enable`` to ``activation_checkpointing_enable``)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing_kwargs or None)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs or None)


def checkpointing_changes_no_gradient(make_model, **inputs) -> dict[str, torch.Tensor]:
    """Gradients of one training step of ``make_model()`` on ``inputs`` (labels included), checked to be the
    same within 1e-5 with gradient checkpointing; returns them (parameters that got a gradient)."""

    def gradients(checkpointing: bool):
        model = make_model()
        if checkpointing:
            enable_checkpointing(model)
        model.train()
        model(**inputs).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, checkpointed = gradients(False), gradients(True)
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        assert max_abs_diff(plain[name], checkpointed[name]) <= 1e-5, name
    return plain


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def generate(model, inputs, **kwargs):
    """``model.generate`` of 8 new tokens (greedy unless ``kwargs`` say otherwise), with the logits and scores."""
    settings = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, output_logits=True, output_scores=True)
    # Tiny random models like to repeat one token; make every step differ.
    settings |= dict(no_repeat_ngram_size=1, return_dict_in_generate=True, pad_token_id=PAD)
    source = {name: value for name, value in inputs.items() if name != "decoder_input_ids"}
    return model.generate(**source, **settings | kwargs)


def generation_gap(a, b) -> float:
    """Largest difference between the raw logits of two generations; inf if the tokens differ."""
    if not torch.equal(a.sequences, b.sequences):
        return float("inf")
    return max(max_abs_diff(x, y) for x, y in zip(a.logits, b.logits, strict=True))


def cached_and_uncached_generation(model, inputs, tolerance: float = 1e-5, **settings):
    """Generate with and without the KV cache (from the same seed, for sampling), check that tokens, logits,
    scores and beam scores agree within ``tolerance`` (scores of beams are running sums of log-probabilities,
    about 50 in the tiny mT5, so they also get fp32 rounding of their size: 1e-6 relative), and return the cached
    generation."""
    torch.manual_seed(3)
    cached = generate(model, inputs, use_cache=True, **settings)
    torch.manual_seed(3)
    uncached = generate(model, inputs, use_cache=False, **{k: v for k, v in settings.items() if "cache" not in k})
    assert generation_gap(cached, uncached) <= tolerance
    for cached_scores, uncached_scores in zip(cached.scores, uncached.scores, strict=True):
        torch.testing.assert_close(cached_scores, uncached_scores, atol=tolerance, rtol=1e-6)  # -inf where banned
    if settings.get("num_beams", 1) > 1:
        torch.testing.assert_close(cached.sequences_scores, uncached.sequences_scores, atol=1e-5, rtol=1e-6)
    return cached


GENERATION_MODES = {
    "greedy": {"num_beams": 1},
    "beam": {"num_beams": 3},
    "greedy-static-cache": {"num_beams": 1, "cache_implementation": "static"},
    "beam-static-cache": {"num_beams": 3, "cache_implementation": "static"},
}


SENTENCES = [
    "Evolving attention links the attention maps of consecutive layers.",
    "A short one.",
    "Padding must never leak into valid positions through the convolution.",
]


# GLUE-format samples -------------------------------------------------------------------------------

FORMATS = ["tsv", "csv", "json", "jsonl", "parquet"]
LABELS = [0, 1, 1, 0, 1, 0, 0, 1]


def sample_rows(task: str, n: int = 8, as_names: bool = False) -> list[dict]:
    spec = GLUE_TASKS[task]
    rows = []
    for i in range(n):
        row = {column: f"{column} number {i} says something" for column in spec.text_columns}
        if spec.is_regression:
            row["label"] = round(5.0 * i / (n - 1), 2)
        else:
            label = LABELS[i] if spec.num_labels == 2 else i % 3
            row["label"] = spec.label_names[label] if as_names else label
        row["idx"] = i
        rows.append(row)
    return rows


def write(rows: list[dict], path) -> str:
    frame = pd.DataFrame(rows)
    suffix = path.suffix
    if suffix == ".tsv":
        frame.to_csv(path, sep="\t", index=False)
    elif suffix == ".csv":
        frame.to_csv(path, index=False)
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    elif suffix == ".jsonl":
        frame.to_json(path, orient="records", lines=True)
    else:
        frame.to_parquet(path)
    return str(path)


#: The modeling files that save_pretrained copies beside an EA checkpoint (model_classes.py and every sibling
#: it imports, transitively), for trust_remote_code.
SAVED_MODELING_FILES = {
    "model_classes.py",
    "config_classes.py",
    "architectures.py",
    "attach.py",
    "attention.py",
    "attention_core.py",
    "attention_tail.py",
    "call_state.py",
    "compiled.py",
    "convolution.py",
    "echo.py",
    "evolution.py",
    "gates.py",
    "history.py",
    "kernels.py",
    "map_reuse.py",
    "masks.py",
    "methods.py",
    "packing.py",
    "scores.py",
    "settings.py",
    "sinks.py",
    "step.py",
    "versions.py",
}


# Small checkpoints and data files for end-to-end runs ------------------------------------------------------


def tiny_checkpoint(
    model_type, tokenizer, directory, num_labels=2, head=transformers.AutoModelForSequenceClassification
):
    """A tiny random model of ``model_type`` (with ``head``) that reads MiniLM's tokenizer, saved with it."""
    special = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.sep_token_id, "num_labels": num_labels}
    special |= {"bos_token_id": tokenizer.cls_token_id}
    overrides = {"vocab_size": len(tokenizer), **special}
    if model_type == "t5":  # the classification head pools at the last EOS ([SEP] here)
        overrides["decoder_start_token_id"] = tokenizer.pad_token_id
    if model_type == "roberta":
        overrides |= {"type_vocab_size": 2, "max_position_embeddings": 160}
    model = tiny_model(model_type, head, **overrides)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def write_ts(path, series, labels, regression=False):
    """A UEA/UCR .ts file of series [T, C] of varying length."""
    header = [
        "@problemName synthetic",
        "@timeStamps false",
        "@missing false",
        "@univariate false",
        f"@dimensions {series[0].shape[1]}",
        "@equalLength false",
        "@targetLabel true" if regression else f"@classLabel true {' '.join(sorted(set(labels)))}",
        "@data",
    ]
    rows = [
        ":".join(",".join(f"{v:.6f}" for v in one[:, c]) for c in range(one.shape[1])) + f":{label}"
        for one, label in zip(series, labels, strict=True)
    ]
    path.write_text("\n".join(header + rows) + "\n")
    return str(path)


def tiny_vit_checkpoint(directory):
    """A tiny random ViT (16 px images, patch 4, 10 classes) with its image processor."""
    tiny_model("vit", transformers.AutoModelForImageClassification, num_labels=10).save_pretrained(directory)
    transformers.ViTImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(directory)
    return directory

"""The memory a training step with evolving attention adds, from the shapes: a model of what EA keeps for
backward, checked against torch's ``MemTracker`` on real steps, and the longest context that fits one GPU.

    python bench/analyses/memory_model.py --check  # tiny BERT and Llama steps measured on CPU against the model
                                                   # (and on the Triton path, interpreted, which is slow)
    python bench/analyses/memory_model.py --size   # the long-context table of docs/performance.md (8B shapes)

The model counts maps of E = batch x heads x queries x keys elements, in bytes. A training step on the
torch-operation path (GPUs' default; the CPU's with ``EA_HF_KERNELS=0``) keeps, per evolving layer:

- without gradient checkpointing, A_logit in the model's precision (maps evolve in it) and the ReLU gate as
  bools: 5 bytes per element in fp32, 3 in bf16 (dropout's mask adds 1 where attention dropout is on);
- with gradient checkpointing, A_logit alone: the next layer's replay reads it, everything else is recomputed.

A layer's backward adds a working set of a few maps: ``TRANSIENT_MAPS``, measured, counted in fp32 maps. Eager
attention keeps its softmax per layer (Llama-style families upcast the softmax: an fp32 and a model-dtype copy);
sdpa keeps no map. Layers that ``layers=`` leaves plain run ea_hf's eager attention, which keeps its softmax in the
maps' dtype.

On the Triton path (the evolution kernels and the fused attention tail: half-precision maps on Hopper GPUs by
default, any with ``EA_HF_TRITON=1``) a layer keeps A_logit,
the gate bit-packed (an eighth of a byte an element, the fused kernels' form) and two floats a query row, and its
backward forms no fp32 map:
``TRITON_TRANSIENT_MAPS``, measured with the kernels in Triton's interpreter on CPU tensors, where MemTracker
sees the same torch allocations a GPU would make (the interpreter's own arrays are numpy's).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # harness/ is in bench/, one folder up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness.ea import PATHS, evolution_on  # noqa: E402
from harness.models import DTYPE_BYTES, build_model, random_batch, torch_dtype  # noqa: E402

#: A layer's backward working set above what the step keeps, in fp32 maps of that layer: (causal, checkpointing,
#: dtype) -> maps, measured with MemTracker on CPU at N = 512 (``--check``); it does not grow with the depth.
TRANSIENT_MAPS = {
    (False, False, "fp32"): 4.8, (False, False, "bf16"): 2.9,
    (True, False, "fp32"): 5.8, (True, False, "bf16"): 3.3,
    (True, True, "fp32"): 6.2, (True, True, "bf16"): 3.8,
}  # fmt: skip
#: The same on the Triton path (the kernels interpreted), in bf16: an encoder without checkpointing (BERT,
#: N = 256), and a causal decoder (Llama, N = 512) without and with it. The decoder's grows with N towards it (a
#: term below the maps' N^2), so the model errs high on short maps (docs/performance.md).
TRITON_TRANSIENT_MAPS = {(False, False, "bf16"): 2.0, (True, False, "bf16"): 1.9, (True, True, "bf16"): 2.2}


@dataclasses.dataclass(frozen=True)
class Attention:
    """The attention shapes of a model: ``layers`` of ``heads`` query heads, of which those at ``evolving``
    (every layer by default) evolve."""

    layers: int
    heads: int
    evolving: tuple[int, ...] | None = None
    #: Whether the family's eager attention upcasts its softmax (Llama, Qwen, Mistral...: fp32 then a copy).
    upcast_softmax: bool = True
    causal: bool = True

    @property
    def evolving_positions(self) -> tuple[int, ...]:
        return tuple(range(self.layers)) if self.evolving is None else tuple(sorted(self.evolving))


def map_elements(batch: int, heads: int, queries: int, keys: int | None = None) -> int:
    return batch * heads * queries * (queries if keys is None else keys)


def ea_added_bytes(
    attention: Attention,
    batch: int,
    n: int,
    dtype: str,
    checkpointing: bool,
    dropout: bool = False,
    path: str = "torch",
) -> int:
    """What a training step of the EA model adds over the same model on sdpa, at its peak (the model above).

    Backward runs from the top layer down and frees each layer's maps as it goes, so the peak comes at the top
    evolving layer's backward: what the layers up to it keep, plus its working set.

    Example:
        >>> bert = Attention(layers=12, heads=12, upcast_softmax=False, causal=False)
        >>> round(ea_added_bytes(bert, 8, 512, "bf16", checkpointing=False) / 2**20)  # MiB
        1142
    """
    elements = map_elements(batch, attention.heads, n)
    evolving = attention.evolving_positions
    top = evolving[-1]
    map_bytes = DTYPE_BYTES[dtype]
    if checkpointing:  # every layer recomputed: A_logit alone stays, as the next evolving layer's input
        kept = len(evolving) * map_bytes * elements
    else:
        gate_bytes = 1 / 8 if path == "triton" else 1  # the Triton kernels keep it bit-packed
        per_layer = (map_bytes + gate_bytes + (1 if dropout else 0)) * elements  # A_logit, the gate, dropout's mask
        if path == "triton":  # and the fused tail's row statistics: a float32 maximum and sum a query row
            per_layer += 8 * batch * attention.heads * n
        if attention.causal:  # the convolution's causal mask, one per sequence
            per_layer += batch * n * n
        # Layers left plain run ea_hf's eager attention, which keeps its softmax in the maps' dtype.
        plain = sum(1 for layer in range(top + 1) if layer not in evolving)
        kept = len(evolving) * per_layer + plain * map_bytes * elements
    transients = TRITON_TRANSIENT_MAPS if path == "triton" else TRANSIENT_MAPS
    transient = transients[(attention.causal, checkpointing, dtype)] * 4 * elements
    return int(kept + transient)


# -- measuring --------------------------------------------------------------------------------------------------


def tiny_model(family: str, layers: int, heads: int = 4) -> tuple[Any, Any]:
    """(the model class, its config) of a tiny ``family`` (bert or llama) model, dropout off."""
    import transformers

    if family == "bert":
        config = transformers.BertConfig(
            hidden_size=64, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=128,
            vocab_size=100, max_position_embeddings=4096, attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0,
        )  # fmt: skip
        return transformers.BertForSequenceClassification, config
    config = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        intermediate_size=128, vocab_size=100, max_position_embeddings=4096,
    )  # fmt: skip
    return transformers.LlamaForCausalLM, config


def measured_peak(
    family: str, variant: str, layers: int, n: int, dtype: str, checkpointing: bool, batch: int = 2,
    evolving: list[int] | None = None, path: str = "torch",
) -> int:  # fmt: skip
    """The peak of memory allocated during one training step (forward and backward) of a tiny model, by torch's
    MemTracker (every tensor, weights and gradients included), on CPU: ``variant`` is eager, sdpa or ea, EA on
    ``path`` (see :func:`harness.ea.evolution_on`)."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    model_class, config = tiny_model(family, layers)
    layers_ = None if evolving is None else tuple(evolving)
    model = build_model(model_class, config, variant, dtype=torch_dtype(dtype), layers=layers_)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = random_batch(config.vocab_size, batch, n, mask=False)["input_ids"]
    labels = ids if family != "bert" else torch.zeros(batch, dtype=torch.long)
    tracker = MemTracker()
    tracker.track_external(model)
    with evolution_on(path, "cpu"), tracker:
        model(ids, labels=labels).loss.backward()
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def check_rows(cases, path: str = "torch") -> list[dict]:
    """Measured EA minus sdpa against the model, for each (family, layers, evolving, n, dtype, checkpointing), EA
    on ``path``."""
    rows = []
    for family, layers, evolving, n, dtype, checkpointing in cases:
        causal = family != "bert"
        attention = Attention(layers, 4, None if evolving is None else tuple(evolving), causal, causal)
        sdpa = measured_peak(family, "sdpa", layers, n, dtype, checkpointing)
        ea = measured_peak(family, "ea", layers, n, dtype, checkpointing, evolving=evolving, path=path)
        predicted = ea_added_bytes(attention, 2, n, dtype, checkpointing, path=path)
        rows.append(dict(family=family, layers=layers, evolving=evolving, n=n, dtype=dtype, path=path,
                         checkpointing=checkpointing, measured=ea - sdpa, predicted=predicted))  # fmt: skip
    return rows


# -- sizing a long-context run ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shapes:
    """A decoder's shapes, as its config.json gives them."""

    name: str
    parameters: float
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int


LLAMA_3_8B = Shapes("Llama-3-8B", 8.03e9, 32, 4096, 14336, 32, 8, 128, 128256)
QWEN3_8B = Shapes("Qwen3-8B", 8.19e9, 36, 4096, 12288, 32, 8, 128, 151936)
#: Multi-Token Attention evolves 5 of 24 layers; the same share of these.
FEW_LAYERS = 5


def base_bytes(shapes: Shapes, n: int, shards: int) -> float:
    """The same step on sdpa, bf16, batch 1, each layer checkpointed, FSDP over ``shards`` GPUs (an estimate):
    fp32 master weights, gradients and Adam's two moments sharded (16 bytes a parameter), two layers' bf16
    weights gathered, each layer's bf16 input kept, one layer's activations replayed (about 6 hidden-size and 3
    intermediate-size vectors a token), and the logits with their fp32 copy for the loss."""
    states = 16 * shapes.parameters / shards
    layer_parameters = (shapes.parameters - 2 * shapes.vocab * shapes.hidden) / shapes.layers
    gathered = 2 * 2 * layer_parameters
    inputs = shapes.layers * 2 * n * shapes.hidden
    replay = 2 * n * (6 * shapes.hidden + 3 * shapes.intermediate)
    logits = 6 * n * shapes.vocab
    return states + gathered + inputs + replay + logits


def longest_context(
    shapes: Shapes, evolving: int | None, budget: float, shards: int = 8, step: int = 256, path: str = "torch"
) -> int:
    """The longest context (a multiple of ``step``) whose step fits ``budget`` bytes; ``evolving``: how many
    layers evolve (None: none, the sdpa model itself; under checkpointing their positions do not matter), on
    ``path``."""
    attention = Attention(shapes.layers, shapes.heads, tuple(range(evolving or 0)))
    n = step
    while True:
        added = 0 if evolving is None else ea_added_bytes(attention, 1, n + step, "bf16", True, path=path)
        if base_bytes(shapes, n + step, shards) + added > budget:
            return n
        n += step


def decoding_rows_bytes(shapes: Shapes, n: int, evolving: int | None = None) -> tuple[int, int]:
    """(the rows EA keeps on the cache at context ``n``, the KV cache), both bf16, kernel 3: one row of each
    evolving layer's map per query head."""
    layers = shapes.layers if evolving is None else evolving
    return layers * shapes.heads * n * 2, shapes.layers * 2 * shapes.kv_heads * shapes.head_dim * n * 2


def sizing_table(budget: float = 76e9) -> str:
    lines = [
        "| model | sdpa, no EA | EA, every layer | EA, 5 layers | on Triton, every layer | on Triton, 5 layers "
        "| kept rows in decoding, per token |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for shapes in (LLAMA_3_8B, QWEN3_8B):
        contexts = [longest_context(shapes, None, budget)] + [
            longest_context(shapes, evolving, budget, path=path)
            for path in PATHS
            for evolving in (shapes.layers, FEW_LAYERS)
        ]
        rows, kv = decoding_rows_bytes(shapes, 1)
        lines.append(
            f"| {shapes.name} | {' | '.join(f'{n:,}' for n in contexts)} "
            f"| {rows / 1024:.1f} KiB ({rows / kv:.1%} of the KV cache's {kv / 1024:.0f} KiB) |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="measure tiny models on CPU against the model")
    parser.add_argument("--size", action="store_true", help="the long-context table for 8B shapes")
    parser.add_argument("--budget-gb", type=float, default=76.0, help="usable bytes of an 80 GB GPU, in GB")
    args = parser.parse_args()
    if args.check:
        cases = [(family, 3, None, 384, dtype, False) for family in ("bert", "llama") for dtype in ("fp32", "bf16")]
        cases += [("llama", 3, None, 384, dtype, True) for dtype in ("fp32", "bf16")]
        cases += [("llama", 4, [0, 2], 384, "bf16", False), ("llama", 4, [0, 2], 384, "bf16", True)]
        triton_cases = [("bert", 2, None, 256, "bf16", False)]
        triton_cases += [("llama", 2, None, 512, "bf16", checkpointing) for checkpointing in (False, True)]
        for row in [*check_rows(cases), *check_rows(triton_cases, path="triton")]:
            print(row, f"measured / model {row['measured'] / row['predicted']:.3f}")
    if args.size:
        print(sizing_table(args.budget_gb * 1e9))


if __name__ == "__main__":
    main()

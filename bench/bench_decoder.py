"""Decoder-only cost of Evolving Attention: a random ~125M Llama with eager, sdpa, EA and EA on a quarter of the layers.

Every (variant, N) case runs in a fresh subprocess of this script (``--case VARIANT N``): it builds the model,
times the prefill ``model(input_ids, use_cache=True)`` and then step-by-step decoding with the returned cache,
measures the peak memory the prefill adds, and inspects the cache for the convolution rows that EA keeps between
decoding steps. Fresh processes on a shared host differ in speed by more than EA's cost (docs/performance.md), so
one more process per N (``--paired N``) builds every variant and times them in turns, round after round: the paired
ratios compare variants that ran side by side. The parent collects the cases, computes the ratios against sdpa and
eager and writes a JSON file and a Markdown report.

    python bench/bench_decoder.py            # full run: N in {512, 2048}, 3 repeats, 1 warm-up, 16 decoded tokens,
                                             # and 5 paired rounds per N
    python bench/bench_decoder.py --tiny     # dry run: tiny config, N in {32, 64}, a few seconds per case

On a GPU (``--device cuda``, bf16 by default) the RSS of fresh processes measures nothing, so only the paired
processes run, one per N: every variant built on the GPU, timed in turns (CUDA events around each prefill and
each decoding step), and the peak memory each prefill adds read from the CUDA allocator. The report gives each
variant's prefill time, prefill memory and ms per decoded token against eager's and sdpa's, and which path evolved
the maps (``EA_HF_TRITON=1``: ea_hf's Triton kernels; else torch operations).

    python bench/bench_decoder.py --device cuda --paired-rounds 3  # bench/results/<gpu>/bench_decoder_gpu.*
    python bench/bench_decoder.py --gpu-protocol --tiny            # the same protocol on the CPU, a dry run

With ``--static``, fast generation as transformers documents it: a static cache, and each of eager, sdpa and EA
decoding as it is and with ``torch.compile(model.forward, fullgraph=True, mode="reduce-overhead")`` (CUDA graphs),
side by side in one process per N; the report holds each against plain (sdpa) decoding run alike, the graphs each
compiled, and whether EA meets fast generation's targets (compiled decoding within 1.10x of plain compiled, the
prefill within 1.3x of plain).

    python bench/bench_decoder.py --static --device cuda --lengths 512   # <gpu>/bench_decoder_static.*
    python bench/bench_decoder.py --static --tiny --compile-backend eager # a dry run on the CPU

Timing, memory, kernel-call counters, the result-line protocol and the machine's description come from
bench/harness.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # harness/ sits beside the scripts
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import BENCH_DIR, ea, host, is_cuda, memory  # noqa: E402
from harness.children import print_result, run_child  # noqa: E402
from harness.models import (  # noqa: E402
    LLAMA_125M_CONFIG,
    TORCH_DTYPES,
    build_model,
    parameter_count,
    random_batch,
    torch_dtype,
)
from harness.tables import markdown_table, number, ratio  # noqa: E402
from harness.timing import rotation, stopwatch, timed  # noqa: E402

VARIANTS = ("eager", "sdpa", "ea", "ea-layers")
DEVICES = ("cpu", "cuda")
#: --dtype names, and each device's default.
DTYPES = ("fp32", "bf16")
DEFAULT_DTYPES = {"cpu": "fp32", "cuda": "bf16"}
NO_CUDA_MESSAGE = "bench_decoder.py: --device cuda, but no CUDA device is available (--gpu-protocol: a CPU dry run)"
EA_VARIANTS = ("ea", "ea-layers")
#: --static: the attentions timed with a static cache, each as it is and with its decoding step compiled (the
#: variant ``<attention>-compile``); PLAIN, the unpatched model's default attention, is what EA is held against.
STATIC_ATTENTIONS = ("eager", "sdpa", "ea")
PLAIN = "sdpa"
COMPILED_SUFFIX = "-compile"
#: Fast generation's targets, (figure, variant): the most it may cost against plain run alike.
STATIC_TARGETS = {("decode", "ea-compile"): 1.10, ("prefill", "ea"): 1.3}
#: What the reports of a --gpu-protocol run and a --static run measured.
DEVICE_BENCHMARK = (
    "Random Llama-style decoder (~125M) on a GPU: prefill time and memory, and decoding latency, of eager vs sdpa vs "
    "ea_hf Evolving Attention (all layers and every 4th layer), side by side"
)
STATIC_BENCHMARK = (
    "Random Llama-style decoder (~125M) with a static cache: prefill and decoding per token of plain and Evolving "
    "Attention models, each as they are and compiled"
)
#: Every EA_LAYER_STRIDE-th layer is evolved in the ``ea-layers`` variant (a quarter: 0, 4, 8 of 12 layers).
EA_LAYER_STRIDE = 4

#: ~125M parameters (124,668,672): SmolLM/Llama-style proportions with grouped-query attention (4 key/value heads).
FULL_CONFIG = LLAMA_125M_CONFIG
#: --tiny: the same shape of model, small enough that a case runs in well under a second.
TINY_CONFIG = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 256,
}
#: How a CPU run measures, and how a --gpu-protocol run does (:func:`report_settings`).
CPU_METHOD = {
    "prefill_no_cache": "EA variants only: model(input_ids, use_cache=False), same warm-up and repeats",
    "memory": "fresh process per case; VmRSS after model construction; peak RSS (VmHWM, reset after "
    "construction) over the prefills; decode peak reset again before decoding",
    "paired": "one more process per N with all variants, timed in turns (a prefill, then decode_tokens "
    "steps) for paired_rounds rounds after an untimed one, the order rotating; medians over the rounds",
}
DEVICE_METHOD = {
    "timing": "one process per N with all variants, timed in turns (a prefill, then decode_tokens steps) "
    "for paired_rounds rounds after an untimed one, the order rotating; every call timed by CUDA events between "
    "two torch.cuda.synchronize() (time.perf_counter on the CPU); medians over the rounds",
    "memory": "per timed prefill: torch.cuda.max_memory_allocated() minus torch.cuda.memory_allocated() "
    "before it, the peak reset there; the largest of the rounds (None on the CPU)",
}
#: The columns of the Markdown tables: the cost of each case, the rows EA keeps, the paired timing's (a GPU
#: run's with its memory and path columns, :func:`paired_table`).
COST_HEADER = (
    "variant", "N", "prefill ms", "prefill x sdpa", "prefill x eager", "prefill ms, use_cache=False",
    "prefill peak above loaded MiB", "total peak RSS MiB", "held after prefill MiB", "decode ms/token",
    "decode x sdpa", "decode x eager", "others' cores",
)  # fmt: skip
KEPT_HEADER = (
    "variant", "N", "evolved layers", "kept rows per layer (elements)", "storage they hold after prefill, per layer",
    "after 1+ decode steps, per layer", "KV cache per layer", "kept rows / KV", "held storage / KV",
    "kept rows, whole model",
)  # fmt: skip


# --------------------------------------------------------------------------------------------------------------
# Child: one (variant, N) case.
# --------------------------------------------------------------------------------------------------------------


def model_config(tiny: bool) -> Any:
    """The random Llama-style config of the benchmark (no dropout, untied embeddings as Llama's default)."""
    from transformers import LlamaConfig

    return LlamaConfig(**(TINY_CONFIG if tiny else FULL_CONFIG), attention_dropout=0.0)


def evolved_layers(variant: str, num_layers: int) -> list[int] | None:
    """Layers that ``variant`` evolves: all for ``ea``, every EA_LAYER_STRIDE-th for ``ea-layers``, else None."""
    if variant == "ea":
        return list(range(num_layers))
    if variant == "ea-layers":
        return list(range(0, num_layers, EA_LAYER_STRIDE))
    return None


def llama(variant: str, tiny: bool, dtype: str = "fp32", device: str = "cpu") -> Any:
    """A LlamaForCausalLM with the same random weights for every variant, eval mode, in ``dtype`` (a --dtype name)
    on ``device``. Built on the CPU in fp32 and then moved: the CPU generator gives every variant, device and dtype
    the same weights (rounded to the dtype)."""
    from transformers import LlamaForCausalLM

    config = model_config(tiny)
    # ea patches all layers when layers=None; passing the full list for "ea" would mean the same thing.
    layers = evolved_layers(variant, config.num_hidden_layers) if variant == "ea-layers" else None
    attention = "ea" if variant in EA_VARIANTS else variant
    return build_model(
        LlamaForCausalLM, config, attention, device=device, dtype=torch_dtype(dtype), layers=layers
    ).eval()


def prompt(vocab_size: int, length: int, device: str = "cpu") -> Any:
    """The prompt every case and variant decodes after: random ids, batch 1, the same on every device."""
    return random_batch(vocab_size, 1, length, device, mask=False)["input_ids"]


def tensor_bytes(tensor: Any) -> int:
    """Bytes of the tensor's own elements (what it logically holds)."""
    return tensor.numel() * tensor.element_size()


def kept_rows(cache: Any) -> dict[str, dict]:
    """The convolution rows EA keeps on the cache object, per layer: shape, element bytes, and the bytes of the
    storage they keep alive (a view keeps its whole base tensor: larger than the rows if they slice a bigger map)."""
    from ea_hf.modeling.history import CACHE_ATTRIBUTE

    kept = {}
    for (role, layer), history in sorted(getattr(cache, CACHE_ATTRIBUTE, {}).items()):
        if history.rows is None:
            continue
        kept[f"{role}.{layer}"] = {
            "layer": layer,
            "shape": list(history.rows.shape),
            "bytes": tensor_bytes(history.rows),
            "storage_bytes": history.rows.untyped_storage().nbytes(),
        }
    return kept


def kv_cache_bytes(cache: Any) -> list[int]:
    """Keys + values bytes of every layer of a transformers Cache."""
    return [tensor_bytes(layer.keys) + tensor_bytes(layer.values) for layer in cache.layers]


def timed_decoding(
    model: Any, cache: Any, next_token: Any, tokens: int, device: str = "cpu"
) -> tuple[list[float], Any]:
    """(seconds of each step, the cache) of greedy decoding of ``tokens`` tokens, one a call, from ``next_token``
    (the prefill's argmax) and the prefill's ``cache``."""
    times = []
    for _ in range(tokens):
        step = timed(functools.partial(model, next_token, past_key_values=cache, use_cache=True), device)
        times.append(step.seconds)
        next_token, cache = step.output.logits[:, -1:].argmax(-1), step.output.past_key_values
        step = None
    return times, cache


def build_case(variant: str, length: int, threads: int, tiny: bool, dtype: str) -> tuple[Any, Any]:
    """(the model, the prompt) of one case on the CPU."""
    import torch

    ea.import_ea_hf()  # in every case, EA or not, so that all processes carry the same libraries
    torch.set_num_threads(threads)
    model = llama(variant, tiny, dtype)
    return model, prompt(model.config.vocab_size, length)


def time_prefills(model: Any, input_ids: Any, warmup: int, repeats: int) -> tuple[dict, Any]:
    """The timed prefills (seconds, their median and minimum, CPU over wall) after ``warmup`` untimed ones, and
    the last one's output."""
    times, cpu_times, output = [], [], None
    for index in range(warmup + repeats):
        # Drop the previous output first: two caches (and two logits tensors) alive would inflate the peak.
        output = None
        run = timed(lambda: model(input_ids, use_cache=True))
        output = run.output
        if index >= warmup:
            times.append(run.seconds)
            cpu_times.append(run.cpu_s)
        run = None
    figures = {
        "prefill_times_s": times,
        "prefill_median_s": statistics.median(times),
        "prefill_min_s": min(times),
        "prefill_cpu_over_wall": statistics.fmean(c / t for c, t in zip(cpu_times, times, strict=True)),
    }
    return figures, output


def held_after_prefill(output: Any, loaded_mib: float) -> dict:
    """What the last prefill's ``output`` (logits + cache) holds, alive: the RSS above the loaded model, and its
    cache's KV bytes and the rows EA kept on it."""
    held = {"after_prefill_rss_mib": memory.current_rss_mib()}
    held["retained_after_prefill_mib"] = held["after_prefill_rss_mib"] - loaded_mib
    held["kv_cache_bytes_per_layer"] = kv_cache_bytes(output.past_key_values)
    held["kept_rows_after_prefill"] = kept_rows(output.past_key_values)
    return held


def measure_decoding(model: Any, cache: Any, next_token: Any, tokens: int) -> dict:
    """The timed decoding after the prefill, with its own peak RSS (reset before it) and the rows the cache keeps
    after it."""
    gc.collect()
    memory.reset_peak_rss()
    figures = {"before_decode_rss_mib": memory.current_rss_mib()}
    figures["decode_times_s"], cache = timed_decoding(model, cache, next_token, tokens)
    figures["decode_peak_rss_mib"] = memory.peak_rss_since_reset_mib()
    figures["after_decode_rss_mib"] = memory.current_rss_mib()
    figures["kept_rows_after_decode"] = kept_rows(cache)
    figures["cache_length_after_decode"] = cache.get_seq_length()
    return figures


def time_prefills_without_cache(model: Any, input_ids: Any, warmup: int, repeats: int) -> list[float]:
    """EA only: the same prefills without a cache. With one, the evolution also keeps its last rows for decoding
    (both run on ea_hf's fused CPU kernel where it is built): the difference is the price of preparing for
    decoding (eager and sdpa compute the same thing either way, so they are not re-timed)."""
    times = []
    for index in range(warmup + repeats):
        run = timed(lambda: model(input_ids, use_cache=False))
        if index >= warmup:
            times.append(run.seconds)
        run = None
    return times


def run_case(
    variant: str,
    length: int,
    repeats: int,
    warmup: int,
    decode_tokens: int,
    threads: int,
    tiny: bool,
    dtype: str = "fp32",
) -> dict:
    """Time and measure one (variant, N) case on the CPU in this process; meant to run in a fresh process of its
    own."""
    import torch

    from ea_hf.ops.cpu import evolution as kernels

    model, input_ids = build_case(variant, length, threads, tiny, dtype)
    gc.collect()
    # Without the reset the peak would include model construction, whose transient allocations can exceed a
    # short prefill.
    peak_reset = memory.reset_peak_rss()
    loaded_mib = memory.current_rss_mib()
    with host.host_activity() as activity, torch.no_grad():
        prefill, output = time_prefills(model, input_ids, warmup, repeats)
        prefill_peak_mib = memory.peak_rss_since_reset_mib()
        held = held_after_prefill(output, loaded_mib)
        cache, next_token = output.past_key_values, output.logits[:, -1:].argmax(-1)
        output = None  # the [1, N, vocab] logits are not needed for decoding
        decoding = measure_decoding(model, cache, next_token, decode_tokens)
        cache = None
        no_cache = time_prefills_without_cache(model, input_ids, warmup, repeats) if variant in EA_VARIANTS else []
    decode_times, rows = decoding.pop("decode_times_s"), held["kept_rows_after_prefill"]
    return {
        "variant": variant,
        "n": length,
        "batch": 1,
        "threads": threads,
        "tiny": tiny,
        "dtype": dtype,
        "attn_implementation": model.config._attn_implementation,
        "evolved_layers": evolved_layers(variant, model.config.num_hidden_layers),
        # Whether EA's evolution ran on the fused CPU kernel (prefills and decoding steps) or on torch operations.
        "ea_cpu_kernel_available": kernels.cpu_kernel() is not None if variant in EA_VARIANTS else None,
        "parameters": parameter_count(model),
        "warmup": warmup,
        "repeats": repeats,
        **prefill,
        "prefill_no_cache_times_s": no_cache,
        "prefill_no_cache_median_s": statistics.median(no_cache) if no_cache else None,
        "decode_tokens": decode_tokens,
        "decode_times_s": decode_times,
        "decode_median_s": statistics.median(decode_times) if decode_times else None,
        "cache_length_after_decode": decoding.pop("cache_length_after_decode"),
        **rss_figures(peak_reset, loaded_mib, prefill_peak_mib),
        **held,
        **decoding,
        "kept_rows_bytes_total": sum(r["bytes"] for r in rows.values()),
        "kept_rows_storage_bytes_total": sum(r["storage_bytes"] for r in rows.values()),
        **host_figures(activity),
    }


def rss_figures(peak_reset: bool, loaded_mib: float, prefill_peak_mib: float) -> dict:
    """A case's RSS once its model is built and at its peak over the prefills, and how that peak was measured."""
    return {
        "memory_source": "VmRSS / VmHWM of a fresh process; the peak is reset (clear_refs) after the model is built"
        if peak_reset
        else "VmRSS / ru_maxrss of a fresh process (peak could not be reset: includes model construction)",
        "peak_reset": peak_reset,
        "loaded_rss_mib": loaded_mib,
        "prefill_peak_rss_mib": prefill_peak_mib,
        "prefill_peak_above_loaded_mib": prefill_peak_mib - loaded_mib,
    }


def host_figures(activity: host.HostActivity) -> dict:
    """What the rest of the machine did while a case was measured."""
    return {
        "loadavg_before_after": [list(activity.loadavg_before), list(activity.loadavg_after)],
        # CPU seconds of all other processes while this case ran: near 0 when it had the machine to itself.
        "other_processes_cpu_s": activity.other_cpu_s,
        "measured_wall_s": activity.wall_s,
        # Average number of cores other processes kept busy while this case was measured.
        "other_processes_cores": activity.other_cores,
        "steal_s": activity.steal_s,
    }


def one_turn(model: Any, input_ids: Any, decode_tokens: int, device: str) -> dict:
    """One variant's turn of the paired timing: a timed prefill and the bytes it added at its peak (None on the
    CPU), then the timed decoding; the rows EA kept on the cache after the prefill, the KV cache's bytes per layer
    and the cache's length after decoding."""
    # The previous turn's cache and logits are gone, so the baseline is the models and the prompt.
    allocated = memory.reset_gpu_peak(device)
    prefill = timed(lambda: model(input_ids, use_cache=True), device)
    added = memory.gpu_peak_added_bytes(device, allocated)
    cache, next_token = prefill.output.past_key_values, prefill.output.logits[:, -1:].argmax(-1)
    seconds, prefill = prefill.seconds, None
    kept, kv_bytes = kept_rows(cache), kv_cache_bytes(cache)
    steps, cache = timed_decoding(model, cache, next_token, decode_tokens, device)
    return {
        "prefill_s": seconds,
        "decode_s": steps,
        "added_bytes": added,
        "kept_rows_after_prefill": kept,
        "kv_cache_bytes_per_layer": kv_bytes,
        "cache_length_after_decode": cache.get_seq_length(),
    }


def paired_turns(
    turns: dict[str, Callable[[], dict]], rounds: int, evolving: set[str], compiled: set[str] = frozenset()
) -> dict:
    """Every variant's turn (``turns[variant]()``: :func:`one_turn` or :func:`static_turn`), round after round, in
    an order that rotates from round to round; a first round warms up (on CUDA selects and loads its kernels; under
    torch.compile compiles) and is not timed. ``evolving``: the variants whose maps evolve; ``compiled``: those that
    run under torch.compile.

    Returns, per variant: the seconds of each timed prefill and decoding step, the bytes each timed prefill added
    at its peak (None on the CPU), the fused kernels' calls over all its turns, the graphs torch.compile made for it,
    and from its last turn the rest of what the turn returned (the rows EA kept on the cache after the prefill, the
    KV cache's bytes per layer, the cache's length after decoding; a static turn's tokens); and the wall time, with
    the cores other processes kept busy meanwhile.
    """
    import torch
    from torch._dynamo.utils import counters

    variants = list(turns)
    prefill, decode, peaks = ({variant: [] for variant in variants} for _ in range(3))
    calls, graphs = {variant: {} for variant in variants}, dict.fromkeys(variants, 0)
    last = {}
    with host.host_activity() as activity, torch.no_grad(), ea.counted_kernel_calls() as counts:
        for round_index in range(rounds + 1):
            for variant in rotation(variants, round_index):
                before, graphs_before = dict(counts), counters["stats"]["unique_graphs"]
                last[variant] = turn = turns[variant]()
                calls[variant] = {key: calls[variant].get(key, 0) + counts[key] - before[key] for key in counts}
                graphs[variant] += counters["stats"]["unique_graphs"] - graphs_before
                if round_index > 0:
                    prefill[variant].append(turn["prefill_s"])
                    decode[variant].extend(turn["decode_s"])
                    peaks[variant].append(turn["added_bytes"])
    timing_keys = ("prefill_s", "decode_s", "added_bytes")
    kept_keys = [key for key in last[variants[0]] if key not in timing_keys]
    return {
        "prefill_times_s": prefill,
        "decode_times_s": decode,
        "prefill_memory_added_bytes": {variant: None if None in added else added for variant, added in peaks.items()},
        "kernel_calls": {
            variant: {"triton": ea.triton_calls(counted), "cpu_kernel": ea.cpu_kernel_calls(counted)}
            for variant, counted in calls.items()
        },
        "evolution_path": {
            variant: ea.evolution_path(variant in evolving, calls[variant], variant in compiled) for variant in variants
        },
        "graphs_compiled": graphs,
        **{key: {variant: last[variant][key] for variant in variants} for key in kept_keys},
        "measured_wall_s": activity.wall_s,
        "other_processes_cores": activity.other_cores,
    }


def baseline_ratios(
    figures: dict[str, dict[str, float | None]], baselines: tuple[str, ...] = ("eager", "sdpa")
) -> dict[str, dict[str, float | None]]:
    """``{what}_over_{baseline}`` for each ``what`` of ``figures`` (``{what: {variant: figure}}``) and each of
    ``baselines``: every variant's figure over the baseline's (None where a figure is missing)."""
    return {
        f"{what}_over_{baseline}": {variant: ratio(value, values[baseline]) for variant, value in values.items()}
        for what, values in figures.items()
        for baseline in baselines
    }


def run_device_paired(length: int, rounds: int, decode_tokens: int, dtype: str, device: str, tiny: bool) -> dict:
    """The paired timing (:func:`paired_turns`) of every variant built in ``dtype`` on ``device``, in this process.
    Returns the times, their medians per variant (the prefill memory: the largest of the rounds), the ratios of
    each to eager's and sdpa's, and where and how it ran: the device's name, the dtype, torch's version,
    ``EA_HF_TRITON`` and the path that evolved each EA variant's maps."""
    ea.import_ea_hf()
    models = {variant: llama(variant, tiny, dtype, device) for variant in VARIANTS}
    config = models["eager"].config
    input_ids = prompt(config.vocab_size, length, device)
    turns = paired_turns(
        {
            variant: functools.partial(one_turn, model, input_ids, decode_tokens, device)
            for variant, model in models.items()
        },
        rounds,
        set(EA_VARIANTS),
    )
    evolution = turns.pop("evolution_path")
    return {
        "n": length,
        "rounds": rounds,
        "decode_tokens": decode_tokens,
        "tiny": tiny,
        **where_it_ran(device, dtype),
        "evolution_path": evolution,
        "evolved_layers": {variant: evolved_layers(variant, config.num_hidden_layers) for variant in VARIANTS},
        "parameters": parameter_count(models["eager"]),
        **with_medians(turns, ("eager", "sdpa")),
    }


def where_it_ran(device: str, dtype: str) -> dict:
    """The device type and name, the dtype, torch's version and ``EA_HF_TRITON`` of a paired timing."""
    import torch

    return {
        "device": torch.device(device).type,
        "device_name": torch.cuda.get_device_name(device) if is_cuda(device) else "cpu",
        "dtype": dtype,
        "torch": torch.__version__,
        # On CUDA ea_hf evolves the maps with torch operations unless EA_HF_TRITON=1 selects its Triton kernels.
        "ea_hf_triton": os.environ.get("EA_HF_TRITON"),
    }


def with_medians(turns: dict, baselines: tuple[str, ...]) -> dict:
    """:func:`paired_turns`' figures with their medians per variant (the prefill memory: the largest of the rounds)
    and each median's ratio to the ``baselines``' (:func:`baseline_ratios`)."""
    prefill_median = {variant: statistics.median(times) for variant, times in turns["prefill_times_s"].items()}
    decode_median = {
        variant: statistics.median(times) if times else None for variant, times in turns["decode_times_s"].items()
    }
    memory_mib = {
        variant: None if added is None else max(added) / memory.MIB
        for variant, added in turns["prefill_memory_added_bytes"].items()
    }
    return {
        **turns,
        "prefill_median_s": prefill_median,
        "decode_median_s": decode_median,
        "prefill_memory_added_mib": memory_mib,
        **baseline_ratios(
            {"prefill": prefill_median, "decode": decode_median, "prefill_memory": memory_mib}, baselines
        ),
    }


def run_paired(length: int, rounds: int, decode_tokens: int, threads: int, tiny: bool, dtype: str = "fp32") -> dict:
    """Time every variant on the CPU in this one process, in turns (:func:`run_device_paired`): each round runs
    each variant's prefill and then its decoding, in an order that rotates from round to round; a first round
    warms up and is not timed. Returns the times and medians per variant, and the ratios of the medians to
    eager's and sdpa's. The variants run side by side, so that a slow spell of a shared host slows them alike.
    """
    import torch

    torch.set_num_threads(threads)
    return {**run_device_paired(length, rounds, decode_tokens, dtype, "cpu", tiny), "threads": threads}


def spawn_paired(length: int, args: argparse.Namespace) -> dict:
    """The paired timing of ``length`` (:func:`run_paired`, or with ``--gpu-protocol`` :func:`run_device_paired` on
    ``--device``) in a fresh process of this script."""
    arguments = ["--paired", str(length), "--paired-rounds", str(args.paired_rounds)]
    arguments += ["--decode-tokens", str(args.decode_tokens), "--threads", str(args.threads)]
    arguments += ["--device", args.device, "--dtype", args.dtype]
    arguments += [*(["--gpu-protocol"] if args.gpu_protocol else []), *(["--tiny"] if args.tiny else [])]
    if args.static:
        arguments += ["--static", "--static-attentions", *args.static_attentions]
        arguments += ["--compile-mode", args.compile_mode, "--compile-backend", args.compile_backend]
    return run_child(__file__, arguments, args.threads, f"paired timing N={length}")


def run_paired_in_process(length: int, args: argparse.Namespace) -> dict:
    """:func:`spawn_paired`'s timing in this process (the child's work; tests)."""
    if args.static:
        return run_static_paired(length, args)
    if args.gpu_protocol:
        return run_device_paired(length, args.paired_rounds, args.decode_tokens, args.dtype, args.device, args.tiny)
    return run_paired(length, args.paired_rounds, args.decode_tokens, args.threads, args.tiny, args.dtype)


# --------------------------------------------------------------------------------------------------------------
# Static cache (--static): decoding as it is and compiled, the way fast generation runs.
# --------------------------------------------------------------------------------------------------------------


def compiled_name(attention: str) -> str:
    """The --static variant of ``attention`` whose decoding step runs under torch.compile."""
    return attention + COMPILED_SUFFIX


def compiled_forward(model: Any, mode: str, backend: str) -> Callable:
    """``model.forward`` under ``torch.compile(fullgraph=True)``: with inductor in ``mode`` (``reduce-overhead``:
    CUDA graphs on a GPU), or with another ``backend`` (the dry run's ``eager``: dynamo's graphs run as they are)."""
    import torch

    options = {"mode": mode} if backend == "inductor" else {"backend": backend}
    return torch.compile(model.forward, fullgraph=True, **options)


def static_turn(model: Any, step: Callable, input_ids: Any, decode_tokens: int, device: str) -> dict:
    """One turn on a new static cache of N + ``decode_tokens`` positions, as ``generate`` runs it: the prefill by
    the model as it is, then ``decode_tokens`` greedy steps by ``step`` (the model, or its compiled forward), each
    given its cache position; a new CUDA-graph step is marked before each. The figures of :func:`one_turn`."""
    import torch
    import transformers

    length = input_ids.shape[1]
    cache = transformers.StaticCache(config=model.config, max_cache_len=length + decode_tokens)
    allocated = memory.reset_gpu_peak(device)
    prefill = timed(lambda: model(input_ids, past_key_values=cache, use_cache=True), device)
    added = memory.gpu_peak_added_bytes(device, allocated)
    next_token, seconds, prefill = prefill.output.logits[:, -1:].argmax(-1), prefill.seconds, None
    kept, kv_bytes = kept_rows(cache), kv_cache_bytes(cache)
    positions = torch.arange(length, length + decode_tokens, device=input_ids.device)
    times, tokens = [], []
    for index in range(decode_tokens):
        torch.compiler.cudagraph_mark_step_begin()
        call = functools.partial(
            step, input_ids=next_token, past_key_values=cache, cache_position=positions[index : index + 1]
        )
        run = timed(call, device)
        times.append(run.seconds)
        # The argmax copies the token out of the logits, which the next replay of a CUDA graph overwrites.
        next_token, run = run.output.logits[:, -1:].argmax(-1), None
        tokens.append(int(next_token))
    return {
        "prefill_s": seconds,
        "decode_s": times,
        "added_bytes": added,
        "kept_rows_after_prefill": kept,
        "kv_cache_bytes_per_layer": kv_bytes,
        "cache_length_after_decode": int(cache.get_seq_length()),
        "decoded_tokens": tokens,
    }


def run_static_paired(length: int, args: argparse.Namespace) -> dict:
    """The --static paired timing of N = ``length`` in this process: each of ``--static-attentions`` built in
    ``--dtype`` on ``--device``, its turns (:func:`static_turn`) as it is and with its decoding step compiled
    (``--compile-mode``, ``--compile-backend``), side by side for ``--paired-rounds`` rounds after one that warms
    up and compiles. Medians, ratios to plain (sdpa) decoding as it is and compiled, and the graphs each compiled."""
    ea.import_ea_hf()
    models = {attention: llama(attention, args.tiny, args.dtype, args.device) for attention in args.static_attentions}
    config = models[PLAIN].config
    input_ids = prompt(config.vocab_size, length, args.device)
    turns = {}
    for attention, model in models.items():
        forward = compiled_forward(model, args.compile_mode, args.compile_backend)
        turns[attention] = functools.partial(static_turn, model, model, input_ids, args.decode_tokens, args.device)
        turns[compiled_name(attention)] = functools.partial(
            static_turn, model, forward, input_ids, args.decode_tokens, args.device
        )
    evolving = {name for name in turns if name.removesuffix(COMPILED_SUFFIX) == "ea"}
    compiled = {name for name in turns if name.endswith(COMPILED_SUFFIX)}
    timing = paired_turns(turns, args.paired_rounds, evolving, compiled)
    return {
        "n": length,
        "rounds": args.paired_rounds,
        "decode_tokens": args.decode_tokens,
        "tiny": args.tiny,
        "compile": {"mode": args.compile_mode, "backend": args.compile_backend, "fullgraph": True},
        **where_it_ran(args.device, args.dtype),
        "parameters": parameter_count(models[PLAIN]),
        **with_medians(timing, (PLAIN, compiled_name(PLAIN))),
    }


def static_rows(timings: list[dict]) -> list[dict]:
    """One row per (N, variant) of a --static run: its medians, each against plain (sdpa) decoding compiled alike
    (*x plain*) and against its own attention as it is (*x as is*: what compiling saves), and the graphs compiled."""
    rows = []
    for timing in timings:
        for variant in timing["prefill_median_s"]:
            attention = variant.removesuffix(COMPILED_SUFFIX)
            plain = compiled_name(PLAIN) if variant != attention else PLAIN
            decode = timing["decode_median_s"]
            rows.append(
                {
                    "variant": variant,
                    "n": timing["n"],
                    "prefill_ms": timing["prefill_median_s"][variant] * 1e3,
                    "prefill_over_plain": timing[f"prefill_over_{plain}"][variant],
                    "prefill_memory_added_mib": timing["prefill_memory_added_mib"][variant],
                    "decode_ms_per_token": decode[variant] * 1e3,
                    "decode_over_plain": timing[f"decode_over_{plain}"][variant],
                    "decode_over_as_is": ratio(decode[variant], decode[attention]),
                    "graphs_compiled": timing["graphs_compiled"][variant],
                    "same_tokens_as_is": timing["decoded_tokens"][variant] == timing["decoded_tokens"][attention],
                    "evolution_path": timing["evolution_path"][variant],
                    "other_processes_cores": timing["other_processes_cores"],
                }
            )
    return rows


def static_targets(rows: list[dict]) -> list[dict]:
    """The targets of fast generation, each met or not on every N: EA's compiled decoding per token against
    plain compiled decoding, and EA's prefill against plain's."""
    checks = []
    for (what, variant), limit in STATIC_TARGETS.items():
        for row in rows:
            if row["variant"] == variant:
                value = row[f"{what}_over_plain"]
                checks.append({"what": what, "variant": variant, "n": row["n"], "ratio": value, "limit": limit,
                               "met": value is not None and value <= limit})  # fmt: skip
    return checks


def static_table(rows: list[dict]) -> str:
    """The --static rows as Markdown."""
    header = ["variant", "N", "prefill ms", "prefill x plain", "prefill peak added MiB", "decode ms/token"]
    header += ["decode x plain", "decode x as is", "graphs compiled", "tokens as is", "evolution", "others' cores"]
    cells = [
        [r["variant"], str(r["n"]), number(r["prefill_ms"], 2), number(r["prefill_over_plain"], 3)]
        + [number(r["prefill_memory_added_mib"], 1), number(r["decode_ms_per_token"], 2)]
        + [number(r["decode_over_plain"], 3), number(r["decode_over_as_is"], 3), str(r["graphs_compiled"])]
        + ["same" if r["same_tokens_as_is"] else "differ"]
        + [r["evolution_path"] or "-", number(r["other_processes_cores"], 2)]
        for r in rows
    ]
    return markdown_table(header, "llrrrrrrrllr", cells) + "\n"


def static_markdown_report(report: dict) -> str:
    """The Markdown file of a --static run: what was run, the table, the targets."""
    settings, compile_settings = report["settings"], report["paired_timing"][0]["compile"]
    targets = "\n".join(
        f"- {t['variant']} {t['what']} at N = {t['n']}: {number(t['ratio'], 3)}x plain (target <= {t['limit']}): "
        f"{'met' if t['met'] else 'NOT met'}"
        for t in report["targets"]
    )
    return (
        f"# Fast generation on {report['device_name']}: a static cache, decoding as it is and compiled "
        f"({report['model']})\n\n"
        f"{report['machine_line']}. {report['parameters']:,} parameters, {settings['dtype']}, batch 1, "
        f"`torch.no_grad()`, eval mode. EA: alpha = {ea.EA_ALPHA}, beta = {ea.EA_BETA}, kernel 3. Each turn makes "
        f"a new `StaticCache` of N + {settings['decode_tokens']} positions, runs the prefill by the model as it is "
        f"(as `generate` does) and then {settings['decode_tokens']} greedy steps `forward(next_token, "
        "past_key_values=cache, cache_position=...)`: the model's own forward, or (*-compile*) "
        f"`torch.compile(model.forward, fullgraph=True, {compile_settings_text(compile_settings)})`. The variants "
        f"run in turns for {settings['paired_rounds']} rounds after one that warms up and compiles, the order "
        "rotating; medians over the rounds (a new cache's first compiled step may record its CUDA graph again). "
        "*x plain*: against the plain model (sdpa) run alike, as it is or compiled; *x as is*: against the same "
        "attention's decoding without compiling; *graphs compiled*: torch.compile's graphs over all its turns (one: "
        "no recompilation between steps or caches); *tokens as is*: whether the greedy tokens of the last turn are "
        f"those of the same attention without compiling. Total run {report['wall_time_s']:.0f} s.\n\n"
        f"{report['markdown_table']}\n"
        f"Targets:\n\n{targets}\n"
    )


def compile_settings_text(settings: dict) -> str:
    """``mode="reduce-overhead"`` for inductor, else ``backend="eager"``."""
    return f'mode="{settings["mode"]}"' if settings["backend"] == "inductor" else f'backend="{settings["backend"]}"'


def run_static_timings(args: argparse.Namespace, paired_run: Callable[[int, argparse.Namespace], dict]) -> list[dict]:
    """The --static paired timing of each N, printed as each finishes."""
    timings = []
    for length in args.lengths:
        timings.append(paired_run(length, args))
        for row in static_rows(timings[-1:]):
            print(
                f"  {row['variant']:<14} N={length:<5} prefill {row['prefill_ms']:8.2f} ms  decode "
                f"{row['decode_ms_per_token']:7.2f} ms/token ({number(row['decode_over_plain'], 3)}x plain, "
                f"{number(row['decode_over_as_is'], 3)}x as is)  graphs {row['graphs_compiled']}",
                flush=True,
            )
    return timings


def static_comparison(timings: list[dict]) -> dict:
    """A --static report's rows, its targets and its table."""
    rows = static_rows(timings)
    return {"comparison": rows, "targets": static_targets(rows), "markdown_table": static_table(rows)}


# --------------------------------------------------------------------------------------------------------------
# Parent: spawn the cases, compare, write.
# --------------------------------------------------------------------------------------------------------------


def spawn_case(variant: str, length: int, args: argparse.Namespace) -> dict:
    """Run one case in a fresh process of this script (honest peak memory, no allocator state carried over)."""
    arguments = ["--case", variant, str(length), "--repeats", str(args.repeats), "--warmup", str(args.warmup)]
    arguments += ["--decode-tokens", str(args.decode_tokens), "--threads", str(args.threads), "--dtype", args.dtype]
    arguments += ["--tiny"] if args.tiny else []
    return run_child(__file__, arguments, args.threads, f"case {variant} N={length}")


def run_case_in_process(variant: str, length: int, args: argparse.Namespace) -> dict:
    """:func:`run_case` in this process (tests: no interpreter start-up per case; memory figures less clean)."""
    return run_case(variant, length, args.repeats, args.warmup, args.decode_tokens, args.threads, args.tiny, args.dtype)


def compare(results: list[dict], lengths: list[int], paired: list[dict] | None = None) -> list[dict]:
    """One row per (variant, N) with the ratios of its prefill and decode medians to sdpa's and eager's: of the
    separate processes, and of the paired process of that N (``*_paired``; None without one)."""
    by_case = {(r["variant"], r["n"]): r for r in results}
    paired_by_length = {r["n"]: r for r in paired or []}
    rows = []
    for length in lengths:
        sdpa, eager = by_case[("sdpa", length)], by_case[("eager", length)]
        side_by_side = paired_by_length.get(length)
        for variant in VARIANTS:
            case = by_case[(variant, length)]
            kept = case["kept_rows_after_prefill"]
            rows.append(
                {
                    **paired_cells(side_by_side, variant),
                    "variant": variant,
                    "n": length,
                    "evolved_layers": case["evolved_layers"],
                    "prefill_ms": case["prefill_median_s"] * 1e3,
                    "prefill_over_sdpa": ratio(case["prefill_median_s"], sdpa["prefill_median_s"]),
                    "prefill_over_eager": ratio(case["prefill_median_s"], eager["prefill_median_s"]),
                    "prefill_no_cache_ms": None
                    if case["prefill_no_cache_median_s"] is None
                    else case["prefill_no_cache_median_s"] * 1e3,
                    "peak_above_loaded_mib": case["prefill_peak_above_loaded_mib"],
                    "total_peak_rss_mib": case["prefill_peak_rss_mib"],
                    "retained_after_prefill_mib": case["retained_after_prefill_mib"],
                    "decode_ms_per_token": None if case["decode_median_s"] is None else case["decode_median_s"] * 1e3,
                    "decode_over_sdpa": ratio(case["decode_median_s"], sdpa["decode_median_s"]),
                    "decode_over_eager": ratio(case["decode_median_s"], eager["decode_median_s"]),
                    "kv_cache_bytes_per_layer": case["kv_cache_bytes_per_layer"][0],
                    "kept_rows_layers": len(kept),
                    "kept_rows_bytes_per_layer": per_layer(kept, "bytes"),
                    "kept_rows_storage_bytes_per_layer": per_layer(kept, "storage_bytes"),
                    "kept_rows_bytes_total": case["kept_rows_bytes_total"],
                    "kept_rows_storage_bytes_total": case["kept_rows_storage_bytes_total"],
                    "kept_rows_storage_bytes_per_layer_after_decode": max(
                        (r["storage_bytes"] for r in case["kept_rows_after_decode"].values()), default=0
                    ),
                    "loadavg_1min_before_after": [
                        case["loadavg_before_after"][0][0],
                        case["loadavg_before_after"][1][0],
                    ],
                    "other_processes_cpu_s": case["other_processes_cpu_s"],
                    "other_processes_cores": case["other_processes_cores"],
                    "contended": case.get("contended", False),
                }
            )
    return rows


def per_layer(kept: dict[str, dict], key: str) -> int:
    """``key`` of the rows one layer keeps (:func:`kept_rows`; 0 where none are kept): every evolved layer keeps
    the same shape of rows, so per layer = the first one's."""
    return next(iter(kept.values()))[key] if kept else 0


def device_rows(timings: list[dict]) -> list[dict]:
    """One row per (N, variant) of a --gpu-protocol run (:func:`run_device_paired` per N): the paired cells, the
    memory the prefill added with its ratios, what evolved the maps, and the rows EA kept on the cache."""
    rows = []
    for timing in timings:
        for variant in VARIANTS:
            kept = timing["kept_rows_after_prefill"][variant]
            rows.append(
                {
                    **paired_cells(timing, variant),
                    "variant": variant,
                    "n": timing["n"],
                    "evolved_layers": timing["evolved_layers"][variant],
                    "evolution_path": timing["evolution_path"][variant],
                    "prefill_memory_added_mib": timing["prefill_memory_added_mib"][variant],
                    "prefill_memory_over_sdpa": timing["prefill_memory_over_sdpa"][variant],
                    "prefill_memory_over_eager": timing["prefill_memory_over_eager"][variant],
                    "kv_cache_bytes_per_layer": timing["kv_cache_bytes_per_layer"][variant][0],
                    "kept_rows_layers": len(kept),
                    "kept_rows_bytes_per_layer": per_layer(kept, "bytes"),
                }
            )
    return rows


def paired_cells(paired: dict | None, variant: str) -> dict:
    """A comparison row's figures from the paired process (:func:`run_paired`), or None for each without one."""
    cells = {
        "prefill_ms_paired": None if paired is None else paired["prefill_median_s"][variant] * 1e3,
        "decode_ms_per_token_paired": None,
        "paired_other_processes_cores": None if paired is None else paired["other_processes_cores"],
    }
    if paired is not None and paired["decode_median_s"][variant] is not None:
        cells["decode_ms_per_token_paired"] = paired["decode_median_s"][variant] * 1e3
    for what in ("prefill", "decode"):
        for baseline in ("eager", "sdpa"):
            key = f"{what}_over_{baseline}"
            cells[f"{key}_paired"] = None if paired is None else paired[key][variant]
    return cells


def variant_label(row: dict) -> str:
    """``ea-layers [0, 4, 8]``: the variant and, for a partial patch, which layers evolve."""
    layers = row["evolved_layers"]
    if row["variant"] == "ea-layers" and layers is not None:
        return f"ea-layers {layers}"
    return row["variant"]


def human_bytes(count: int) -> str:
    """Bytes in B, KiB or MiB for the tables."""
    if count < 1024:
        return f"{count} B"
    if count >= memory.MIB:
        return f"{count / memory.MIB:.2f} MiB"
    return f"{count / 1024.0:.1f} KiB"


def paired_table(rows: list[dict], device: bool = False) -> str:
    """The paired timing as Markdown (empty without paired processes); ``device``: the rows of a --gpu-protocol run
    (:func:`device_rows`), with the memory each prefill added, the rows kept per layer and what evolved the maps."""
    if all(r["prefill_ms_paired"] is None for r in rows):
        return ""
    header = ["variant", "N", "prefill ms", "prefill x sdpa", "prefill x eager"]
    header += ["prefill peak added MiB", "peak x sdpa", "peak x eager"] if device else []
    header += ["decode ms/token", "decode x sdpa", "decode x eager", "others' cores"]
    header += ["kept rows per layer", "evolution"] if device else []
    table = []
    for r in rows:
        cells = [variant_label(r), str(r["n"]), number(r["prefill_ms_paired"], 1)]
        cells += [number(r["prefill_over_sdpa_paired"], 3), number(r["prefill_over_eager_paired"], 3)]
        if device:
            cells += [number(r["prefill_memory_added_mib"], 1), number(r["prefill_memory_over_sdpa"], 3)]
            cells += [number(r["prefill_memory_over_eager"], 3)]
        cells += [number(r["decode_ms_per_token_paired"], 1), number(r["decode_over_sdpa_paired"], 3)]
        cells += [number(r["decode_over_eager_paired"], 3), number(r["paired_other_processes_cores"], 2)]
        if device:
            kept = human_bytes(r["kept_rows_bytes_per_layer"]) if r["kept_rows_layers"] else "-"
            cells += [kept, r["evolution_path"] or "-"]
        table.append(cells)
    return markdown_table(header, "l" + "r" * (len(header) - 1), table) + "\n"


def cost_table(rows: list[dict]) -> str:
    """The cost of every case (:func:`compare`'s rows) as Markdown."""
    cells = [
        [variant_label(r), str(r["n"]), number(r["prefill_ms"], 1), number(r["prefill_over_sdpa"], 2)]
        + [number(r["prefill_over_eager"], 2), number(r["prefill_no_cache_ms"], 1)]
        + [number(r["peak_above_loaded_mib"], 0), number(r["total_peak_rss_mib"], 0)]
        + [number(r["retained_after_prefill_mib"], 0), number(r["decode_ms_per_token"], 1)]
        + [number(r["decode_over_sdpa"], 2), number(r["decode_over_eager"], 2)]
        + [number(r["other_processes_cores"], 2) + (" (!)" if r["contended"] else "")]
        for r in rows
    ]
    return markdown_table(COST_HEADER, "l" + "r" * (len(COST_HEADER) - 1), cells) + "\n"


def kept_table(rows: list[dict], num_layers: int) -> str:
    """The rows each EA variant keeps on the cache against its KV cache (:func:`compare`'s rows) as Markdown."""
    cells = []
    for r in rows:
        if r["variant"] not in EA_VARIANTS:
            continue
        kv = r["kv_cache_bytes_per_layer"]
        cells.append(
            [variant_label(r), str(r["n"]), f"{r['kept_rows_layers']} / {num_layers}"]
            + [human_bytes(r["kept_rows_bytes_per_layer"]), human_bytes(r["kept_rows_storage_bytes_per_layer"])]
            + [human_bytes(r["kept_rows_storage_bytes_per_layer_after_decode"]), human_bytes(kv)]
            + [f"{100.0 * r['kept_rows_bytes_per_layer'] / kv:.1f} %"]
            + [f"{r['kept_rows_storage_bytes_per_layer'] / kv:.1f} x"]
            + [human_bytes(r["kept_rows_bytes_total"])]
        )
    return markdown_table(KEPT_HEADER, "l" + "r" * (len(KEPT_HEADER) - 1), cells) + "\n"


def markdown_report(report: dict, cost: str, kept: str, paired: str = "") -> str:
    """The Markdown file: what was run, the tables and how to read them."""
    settings = report["settings"]
    loads = report["loadavg"]
    side_by_side = (
        "## Paired: every variant in one process\n\n"
        f"One more process per N builds all four models and runs them in turns for {settings['paired_rounds']} "
        "rounds after a warm-up round (each turn: a prefill, then the decoding steps; the order rotates from round "
        "to round): median prefill and ms/token over the rounds. Fresh processes run 10 to 20 % apart in speed on "
        "a shared host, more than EA's cost, so the ratios of the table above move by that much from run to run; "
        "these compare variants that ran side by side. *others' cores*: as above, over the whole paired process.\n\n"
        f"{paired}\n"
        if paired
        else ""
    )
    return (
        f"# Decoder cost: eager vs sdpa vs Evolving Attention ({report['model']})\n\n"
        f"{report['machine_line']}. {report['parameters']:,} parameters, {settings['dtype']}, batch 1, "
        f"{settings['threads']} threads, `torch.no_grad()`, eval mode. EA: alpha = {ea.EA_ALPHA}, "
        f"beta = {ea.EA_BETA}, kernel 3. Prefill = `model(input_ids, use_cache=True)` (logits for all N positions), "
        f"median of {settings['repeats']} after {settings['warmup']} warm-up; decode = {settings['decode_tokens']} "
        "greedy steps `model(next_token, past_key_values=cache, use_cache=True)` after the prefill, median ms/token. "
        f"Load average (1 min) at start / end: {loads['start'][0]:.2f} / {loads['end'][0]:.2f}; per case in the "
        f"JSON. Total run {report['wall_time_s'] / 60:.1f} min.\n\n"
        "Memory: each (variant, N) in a fresh process. *prefill peak above loaded* = peak RSS during the prefills "
        "minus the RSS once the model is built (what the prefill itself adds; the peak is reset after model "
        "construction); *total peak RSS* = that peak itself (model + prefill + interpreter); *held after "
        "prefill* = RSS with the last prefill's output (logits + cache) alive, minus the loaded RSS. *prefill ms, "
        "use_cache=False* (EA only): the same prefill without a cache, where the evolution may use ea_hf's fused "
        "CPU kernel, as it does with a cache (a prefill only leaves its last rows behind for decoding). "
        "*others' cores*: "
        "the average number of cores other processes used while the case was measured (each case waits for a "
        "quiet machine first and is run again if this exceeds "
        f"{settings['max_other_cores']}; (!) marks a case that stayed disturbed).\n\n"
        f"{cost}\n"
        f"{side_by_side}"
        "## Convolution rows kept for decoding\n\n"
        "Per evolved layer, in the cache's `evolving_attention_histories` after the prefill: the rows' own bytes "
        "(`rows.numel() * element_size()`), and the bytes of the storage they keep alive (equal when the rows are "
        "their own copy, as they are since ea_hf stopped keeping a view that pinned the layer's whole [B, H, N, N] "
        "map). KV cache per layer = keys + values of that layer "
        f"({FULL_CONFIG['num_key_value_heads'] if not settings['tiny'] else TINY_CONFIG['num_key_value_heads']} "
        "key/value heads; the kept rows are per query head).\n\n"
        f"{kept}"
    )


def run_quietly(
    variant: str, length: int, args: argparse.Namespace, run: Callable[[str, int, argparse.Namespace], dict]
) -> dict:
    """``run(variant, length, args)`` on a quiet machine (:func:`harness.host.run_quietly`, with ``--quiet-wait``,
    ``--max-other-cores`` and ``--retries``): the least disturbed attempt, the others summarised."""
    return host.run_quietly(
        lambda: run(variant, length, args),
        f"{variant} N={length}",
        max_wait_s=args.quiet_wait,
        max_other_cores=args.max_other_cores,
        retries=args.retries,
        summary_keys=("prefill_median_s", "decode_median_s"),
    )


def protocol_settings(num_layers: int) -> dict[str, Any]:
    """What every report says of the variants, the inputs, the prefill and the decoding."""
    return {
        "variants": {
            "eager": 'attn_implementation="eager"',
            "sdpa": 'attn_implementation="sdpa"',
            "ea": f"ea_hf.patch(model, alpha={ea.EA_ALPHA}, beta={ea.EA_BETA}) (every layer)",
            "ea-layers": f"ea_hf.patch(model, alpha={ea.EA_ALPHA}, beta={ea.EA_BETA}, "
            f"layers={evolved_layers('ea-layers', num_layers)}) (the other layers run eager math inside ea_hf's "
            "attention function)",
        },
        "inputs": "random input_ids (seed 1), no attention mask, batch 1",
        "prefill": "model(input_ids, use_cache=True) under torch.no_grad(); previous output freed before each",
        "decode": "greedy: model(next_token, past_key_values=cache, use_cache=True), one token per call",
    }


def report_head(benchmark: str, args: argparse.Namespace, info: dict) -> dict:
    """The first fields of both reports: what was run, when, on which model and machine."""
    return {
        "benchmark": benchmark,
        "created": host.utc_now(),
        "model": "LlamaForCausalLM, tiny config" if args.tiny else "LlamaForCausalLM, ~125M",
        "machine": info,
        "machine_line": host.machine_line(info),
    }


def run_cases(
    args: argparse.Namespace,
    run: Callable[[str, int, argparse.Namespace], dict],
    paired_run: Callable[[int, argparse.Namespace], dict],
) -> tuple[list[dict], list[dict]]:
    """(every case, the paired timing of each N), each on a quiet machine, printed as they finish."""
    results, paired = [], []
    for length in args.lengths:
        for variant in VARIANTS:
            result = run_quietly(variant, length, args, run)
            results.append(result)
            print(case_line(result), flush=True)
        if args.paired_rounds > 0:
            timing = run_quietly("paired", length, args, lambda _variant, n, a: paired_run(n, a))
            paired.append(timing)
            print(
                f"  paired    N={length:<5} EA prefill {timing['prefill_over_eager']['ea']:.3f}x eager, "
                f"{timing['prefill_over_sdpa']['ea']:.3f}x sdpa; decode {timing['decode_over_eager']['ea']:.3f}x "
                f"eager, {timing['decode_over_sdpa']['ea']:.3f}x sdpa  others {timing['other_processes_cores']:.2f} "
                f"cores  [{timing.get('process_wall_s', 0.0):.0f} s]",
                flush=True,
            )
    return results, paired


def case_line(result: dict) -> str:
    """The printed line of a case."""
    decode = result["decode_median_s"]
    return (
        f"  {result['variant']:<9} N={result['n']:<5} prefill {result['prefill_median_s'] * 1e3:9.1f} ms  "
        f"peak +{result['prefill_peak_above_loaded_mib']:6.0f} MiB ({result['prefill_peak_rss_mib']:.0f})  "
        f"decode {'-' if decode is None else f'{decode * 1e3:.1f}'} ms/token  "
        f"kept rows {result['kept_rows_bytes_total']} B  load {os.getloadavg()[0]:.2f}  "
        f"others {result['other_processes_cores']:.2f} cores  [{result.get('process_wall_s', 0.0):.0f} s]"
    )


def collect(
    args: argparse.Namespace,
    run: Callable[[str, int, argparse.Namespace], dict] = spawn_case,
    paired_run: Callable[[int, argparse.Namespace], dict] = spawn_paired,
) -> dict:
    """Run every case (``run``: a fresh process each by default) and, with ``--paired-rounds``, the paired timing
    of each N (``paired_run``), compare, write the JSON and Markdown files."""
    elapsed = stopwatch()
    info = host.machine_info(args.threads)
    info["batch"] = 1
    load_start = os.getloadavg()
    out = Path(args.out or BENCH_DIR / "results")
    out.mkdir(parents=True, exist_ok=True)
    dtype = "" if args.dtype == DEFAULT_DTYPES["cpu"] else f"_{args.dtype}"
    stem = f"decoder_{info['device']}{dtype}{'_tiny' if args.tiny else ''}"
    print(f"machine: {host.machine_line(info)}; load average {load_start[0]:.2f}", flush=True)
    results, paired = run_cases(args, run, paired_run)
    config = model_config(args.tiny)
    rows = compare(results, args.lengths, paired)
    cost, kept, side_by_side = cost_table(rows), kept_table(rows, config.num_hidden_layers), paired_table(rows)
    report = {
        **report_head(
            "Random Llama-style decoder (~125M): prefill, decode and memory of eager vs sdpa vs ea_hf "
            "Evolving Attention (all layers and every 4th layer)",
            args,
            info,
        ),
        "config": config.to_diff_dict(),
        "parameters": results[0]["parameters"],
        "settings": report_settings(args, config.num_hidden_layers),
        "loadavg": {"start": list(load_start), "end": list(os.getloadavg())},
        "cases": results,
        "paired_timing": paired,
        "comparison": rows,
        "markdown_cost_table": cost,
        "markdown_paired_table": side_by_side,
        "markdown_kept_rows_table": kept,
        "wall_time_s": elapsed(),
    }
    json_path, markdown_path = out / f"{stem}.json", out / f"{stem}.md"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    markdown_path.write_text(markdown_report(report, cost, kept, side_by_side))
    print()
    print(cost)
    print(side_by_side)
    print(kept)
    print(f"wall time {report['wall_time_s']:.0f} s; wrote {json_path}, {markdown_path}")
    return report


def device_output_paths(args: argparse.Namespace, gpu: str | None) -> tuple[Path, Path]:
    """(JSON, Markdown) of a --gpu-protocol run: ``bench_decoder_gpu.*`` under ``--out``, by default in the GPU's
    folder (bench/results/<gpu name slug>, as bench_gpu.py's). On the CPU (a dry run) ``bench_decoder_gpu_dry_run.*``,
    by default under bench/results/cpu; a dtype other than the device's default and the tiny config add a suffix."""
    cuda = args.device == "cuda"
    out = host.gpu_results_folder(args.out, gpu if cuda else None)
    stem = ("bench_decoder_static" if args.static else "bench_decoder_gpu") + ("" if cuda else "_dry_run")
    stem += ("" if args.dtype == DEFAULT_DTYPES[args.device] else f"_{args.dtype}") + ("_tiny" if args.tiny else "")
    return out / f"{stem}.json", out / f"{stem}.md"


def device_markdown_report(report: dict) -> str:
    """The Markdown file of a --gpu-protocol run: what was run, the table and how to read it."""
    settings = report["settings"]
    paths = sorted({path for t in report["paired_timing"] for path in t["evolution_path"].values() if path})
    triton = report["ea_hf_triton"]
    return (
        f"# Decoder cost on {report['device_name']}: eager vs sdpa vs Evolving Attention ({report['model']})\n\n"
        f"{report['machine_line']}. {report['parameters']:,} parameters, {settings['dtype']}, batch 1, "
        f"`torch.no_grad()`, eval mode. EA: alpha = {ea.EA_ALPHA}, beta = {ea.EA_BETA}, kernel 3; its maps "
        f"evolved by {', '.join(paths)} (`EA_HF_TRITON` {'unset' if triton is None else f'= {triton}'}; the kernel "
        "calls counted tell which path ran). One process per N builds the four models on the device and runs them in "
        f"turns for {settings['paired_rounds']} rounds after an untimed one, the order rotating from round to round; "
        "each turn: the prefill `model(input_ids, use_cache=True)` (logits for all N positions), then "
        f"{settings['decode_tokens']} greedy steps `model(next_token, past_key_values=cache, use_cache=True)`. "
        "Every call is timed by CUDA events between two `torch.cuda.synchronize()` (by `time.perf_counter()` on "
        "the CPU): median prefill ms and median ms per decoded token over the rounds. *prefill peak added*: "
        "`torch.cuda.max_memory_allocated()` during the prefill minus `torch.cuda.memory_allocated()` just before it "
        "(the peak reset there; the models and the prompt not counted; logits and cache included), the largest of "
        "the rounds; none on the CPU. *kept rows per layer*: the convolution rows each evolved layer keeps on the "
        "cache for decoding. *others' cores*: host CPU cores other processes used meanwhile. Total run "
        f"{report['wall_time_s']:.0f} s.\n\n"
        f"{report['markdown_table']}"
    )


def run_device_timings(args: argparse.Namespace, paired_run: Callable[[int, argparse.Namespace], dict]) -> list[dict]:
    """The paired timing of each N of a --gpu-protocol run, printed as each finishes."""
    timings = []
    for length in args.lengths:
        timing = paired_run(length, args)
        timings.append(timing)
        for variant in VARIANTS:
            added_mib = timing["prefill_memory_added_mib"][variant]
            print(
                f"  {variant:<9} N={length:<5} prefill {timing['prefill_median_s'][variant] * 1e3:8.2f} ms "
                f"({timing['prefill_over_eager'][variant]:.3f}x eager)  peak +{number(added_mib, 1)} MiB  decode "
                f"{timing['decode_median_s'][variant] * 1e3:7.2f} ms/token "
                f"({timing['decode_over_eager'][variant]:.3f}x eager)  {timing['evolution_path'][variant] or ''}",
                flush=True,
            )
        print(f"  [N={length}: {timing.get('process_wall_s', timing['measured_wall_s']):.0f} s]", flush=True)
    return timings


def report_settings(args: argparse.Namespace, num_layers: int) -> dict:
    """What a report says of how it was run: a CPU run's cases and its waits for a quiet machine, or a
    --gpu-protocol run's device."""
    device = args.gpu_protocol
    settings = {"lengths": args.lengths} | ({} if device else {"repeats": args.repeats, "warmup": args.warmup})
    settings |= {"decode_tokens": args.decode_tokens, "paired_rounds": args.paired_rounds, "threads": args.threads}
    settings["tiny"] = args.tiny
    if device:
        settings["device"] = args.device
    if args.static:
        settings |= {"static_attentions": args.static_attentions, "compile_mode": args.compile_mode}
        settings["compile_backend"] = args.compile_backend
    else:
        settings |= {"quiet_wait_s": args.quiet_wait, "max_other_cores": args.max_other_cores, "retries": args.retries}
    settings |= {"dtype": TORCH_DTYPES[args.dtype], **protocol_settings(num_layers)}
    return settings | (DEVICE_METHOD if device else CPU_METHOD)


def collect_device(
    args: argparse.Namespace, paired_run: Callable[[int, argparse.Namespace], dict] = spawn_paired
) -> dict:
    """The --gpu-protocol run (and --static's): the paired timing of each N on ``--device`` (``paired_run``: a
    fresh process each by default), compared, written as JSON and Markdown. No fresh process per case: their RSS
    says nothing of a GPU, and the allocator's peak, reset before each prefill, measures memory in the paired
    process itself."""
    elapsed = stopwatch()
    info = host.machine_info(args.threads)
    # machine_info says cuda wherever a GPU is visible; the device is what the run used.
    info["device"], info["batch"] = args.device, 1
    json_path, markdown_path = device_output_paths(args, info["gpu"])
    json_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"machine: {host.machine_line(info)}; {args.dtype}", flush=True)
    timings = (run_static_timings if args.static else run_device_timings)(args, paired_run)
    config = model_config(args.tiny)
    first = timings[0]
    report = {
        **report_head(STATIC_BENCHMARK if args.static else DEVICE_BENCHMARK, args, info),
        **{key: first[key] for key in ("device_name", "torch", "ea_hf_triton")},
        "config": config.to_diff_dict(),
        "parameters": first["parameters"],
        "settings": report_settings(args, config.num_hidden_layers),
        "paired_timing": timings,
        **(static_comparison(timings) if args.static else device_comparison(timings)),
    }
    report["wall_time_s"] = elapsed()
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    markdown_path.write_text((static_markdown_report if args.static else device_markdown_report)(report))
    print()
    print(report["markdown_table"])
    print(f"wall time {report['wall_time_s']:.0f} s; wrote {json_path}, {markdown_path}")
    return report


def device_comparison(timings: list[dict]) -> dict:
    """A --gpu-protocol report's rows and its table."""
    rows = device_rows(timings)
    return {"comparison": rows, "markdown_table": paired_table(rows, device=True)}


def build_parser() -> argparse.ArgumentParser:
    """The command line; the defaults of the lengths, repeats, decoded tokens and rounds are set after parsing."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--out", help="output folder (default bench/results, with --gpu-protocol bench/results/<gpu name slug>; a "
        "CPU run to keep goes to bench/results/<machine>)")  # fmt: skip
    add("--lengths", type=int, nargs="+", help="context lengths N (default 512 2048; tiny 32 64)")
    add("--repeats", type=int, help="timed prefills per case (default 3; tiny 2)")
    add("--warmup", type=int, default=1, help="untimed prefills before them (default 1)")
    add("--decode-tokens", type=int, help="tokens decoded one at a time (default 16; tiny 4)")
    add("--threads", type=int, default=2, help="torch.set_num_threads in every case (default 2)")
    add("--quiet-wait", type=float, default=300.0, help="before each case, wait up to this many seconds for other "
        "processes to leave the CPU (default 300; 0: do not wait)")  # fmt: skip
    add("--max-other-cores", type=float, default=0.1, help="a case during which other processes used more cores "
        "than this on average is run again (default 0.1)")  # fmt: skip
    add("--retries", type=int, default=1, help="how often a disturbed case is run again (default 1)")
    add("--paired-rounds", type=int, help="rounds of the paired timing, every variant in one process per N "
        "(default 5; tiny 2; 0: none)")  # fmt: skip
    add("--tiny", action="store_true", help="dry run: tiny config, N in {32, 64}, 2 repeats")
    add("--device", choices=DEVICES, default="cpu", help="where the models run (default cpu); cuda implies "
        "--gpu-protocol")  # fmt: skip
    add("--dtype", choices=DTYPES, help="the models' dtype (default fp32 on the CPU, bf16 on CUDA)")
    add("--gpu-protocol", action="store_true", help="only the paired processes, one per N, with the peak memory "
        "each prefill adds by the device's allocator (none on the CPU) and no fresh process per case; on the CPU "
        "a dry run of a GPU run")  # fmt: skip
    add("--static", action="store_true", help="fast generation: a static cache, each of --static-attentions "
        "decoding as it is and with its step compiled, in paired processes (as --gpu-protocol); "
        "bench_decoder_static.*")  # fmt: skip
    add("--static-attentions", nargs="+", choices=STATIC_ATTENTIONS, default=list(STATIC_ATTENTIONS),
        help=f"--static: the attentions (default all; {PLAIN} and ea at least)")  # fmt: skip
    add("--compile-mode", default="reduce-overhead", help="--static: torch.compile's mode with inductor (default "
        "reduce-overhead: CUDA graphs)")  # fmt: skip
    add("--compile-backend", default="inductor", help="--static: torch.compile's backend (default inductor; the "
        "CPU's dry run: eager)")  # fmt: skip
    add("--case", nargs=2, metavar=("VARIANT", "N"), help="internal: run one case, print its JSON")
    add("--paired", type=int, metavar="N", help="internal: run the paired timing, print its JSON")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; ``--tiny`` replaces the lengths and repeats unless they are given explicitly."""
    parser = build_parser()
    args = parser.parse_args(argv)
    defaults = ([32, 64], 2, 4, 2) if args.tiny else ([512, 2048], 3, 16, 5)
    args.lengths = args.lengths or defaults[0]
    args.repeats = args.repeats if args.repeats is not None else defaults[1]
    args.decode_tokens = args.decode_tokens if args.decode_tokens is not None else defaults[2]
    args.paired_rounds = args.paired_rounds if args.paired_rounds is not None else defaults[3]
    args.dtype = args.dtype or DEFAULT_DTYPES[args.device]
    args.gpu_protocol = args.gpu_protocol or args.device == "cuda" or args.static
    if args.static and not {PLAIN, "ea"} <= set(args.static_attentions):
        parser.error(f"--static-attentions must include {PLAIN} and ea")
    if args.gpu_protocol and (args.case or args.paired_rounds < 1):
        parser.error("--gpu-protocol (and --device cuda) runs paired processes only: no --case, --paired-rounds >= 1")
    if args.case:
        if args.case[0] not in VARIANTS:
            parser.error(f"--case expects VARIANT in {VARIANTS}")
        args.case = (args.case[0], int(args.case[1]))
    if min(args.repeats, args.threads, *args.lengths) < 1:
        parser.error("--repeats, --threads and --lengths must be positive")
    if min(args.warmup, args.decode_tokens, args.retries, args.quiet_wait, args.max_other_cores) < 0:
        parser.error("--warmup, --decode-tokens, --retries, --quiet-wait and --max-other-cores must be >= 0")
    if args.paired_rounds < 0 or (args.paired is not None and (args.paired < 1 or args.paired_rounds < 1)):
        parser.error("--paired-rounds must be >= 0 (>= 1 with --paired), --paired N positive")
    return args


def main(argv: list[str] | None = None) -> None:
    """Parent run by default (with ``--gpu-protocol`` or ``--device cuda``, the GPU's); ``--case VARIANT N`` and
    ``--paired N`` run one case or one paired timing and print it as a result line."""
    args = parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print(NO_CUDA_MESSAGE, file=sys.stderr)
            sys.exit(2)
    if args.case:
        print_result(run_case_in_process(*args.case, args))
    elif args.paired is not None:
        print_result(run_paired_in_process(args.paired, args))
    elif args.gpu_protocol:
        collect_device(args)
    else:
        collect(args)


if __name__ == "__main__":
    main()

"""What the decoder benchmarks share (``benchmarks/decoder_cpu.py``, ``decoder_gpu.py`` and ``decoder_static.py``):
the random ~125M Llama and its tiny config, the variants, the prompt, greedy decoding timed step by step, the rows
EA keeps on the cache, the paired timing (every variant in one process, in turns, the order rotating) with its
medians and ratios, the reports' head and settings, the options every one of them takes, and a GPU run's
protocol (its files, the run itself)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import ea, host, is_cuda, memory
from harness.children import print_result, run_child
from harness.models import LLAMA_125M_CONFIG, TORCH_DTYPES, build_model, parameter_count, random_batch, torch_dtype
from harness.tables import markdown_table, number, ratio
from harness.timing import rotation, stopwatch, timed

VARIANTS = ("eager", "sdpa", "ea", "ea-layers")
EA_VARIANTS = ("ea", "ea-layers")
#: --device names (decoder_gpu.py, decoder_static.py: the CPU is their dry run).
DEVICES = ("cpu", "cuda")
#: --dtype names, and each device's default.
DTYPES = ("fp32", "bf16")
DEFAULT_DTYPES = {"cpu": "fp32", "cuda": "bf16"}
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
#: How a paired run on a device measures (decoder_gpu.py, decoder_static.py).
DEVICE_METHOD = {
    "timing": "one process per N with all variants, timed in turns (a prefill, then decode_tokens steps) "
    "for paired_rounds rounds after an untimed one, the order rotating; every call timed by CUDA events between "
    "two torch.cuda.synchronize() (time.perf_counter on the CPU); medians over the rounds",
    "memory": "per timed prefill: torch.cuda.max_memory_allocated() minus torch.cuda.memory_allocated() "
    "before it, the peak reset there; the largest of the rounds (None on the CPU)",
}


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
    """Every variant's turn (``turns[variant]()``: :func:`one_turn`, or decoder_static.py's ``static_turn``), round
    after round, in an order that rotates from round to round; a first round warms up (on CUDA selects and loads its
    kernels; under torch.compile compiles) and is not timed. ``evolving``: the variants whose maps evolve;
    ``compiled``: those that run under torch.compile.

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


def run_paired(length: int, rounds: int, decode_tokens: int, dtype: str, device: str, tiny: bool) -> dict:
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
        # Unset, ea_hf's default per GPU and precision chooses the path (Triton for half precision on Hopper).
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


def per_layer(kept: dict[str, dict], key: str) -> int:
    """``key`` of the rows one layer keeps (:func:`kept_rows`; 0 where none are kept): every evolved layer keeps
    the same shape of rows, so per layer = the first one's."""
    return next(iter(kept.values()))[key] if kept else 0


def paired_cells(paired: dict | None, variant: str) -> dict:
    """A comparison row's figures from the paired process of its N (:func:`run_paired`), or None for each without
    one."""
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
    """The paired timing as Markdown (empty without paired processes); ``device``: the rows of a decoder_gpu.py run
    (:func:`decoder_gpu.device_rows`), with the memory each prefill added, the rows kept per layer and what evolved
    the maps."""
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


def report_settings(args: argparse.Namespace, num_layers: int) -> dict[str, Any]:
    """What every report says of how it was run: the lengths, the decoding, the paired rounds, the threads, the
    dtype, the variants, the inputs, the prefill and the decoding (each script adds its own)."""
    settings = {"lengths": args.lengths, "decode_tokens": args.decode_tokens, "paired_rounds": args.paired_rounds}
    settings |= {"threads": args.threads, "tiny": args.tiny}
    return settings | {"dtype": TORCH_DTYPES[args.dtype], **protocol_settings(num_layers)}


def common_parser(description: str) -> argparse.ArgumentParser:
    """The options every decoder benchmark takes; :func:`finish_parsing` sets the defaults that depend on
    ``--tiny`` and ``--device`` and checks them."""
    parser = argparse.ArgumentParser(description=description)
    add = parser.add_argument
    add("--lengths", type=int, nargs="+", help="context lengths N (default 512 2048; tiny 32 64)")
    add("--decode-tokens", type=int, help="tokens decoded one at a time (default 16; tiny 4)")
    add("--threads", type=int, default=2, help="torch.set_num_threads in every case (default 2)")
    add("--paired-rounds", type=int, help="rounds of the paired timing, every variant in one process per N "
        "(default 5; tiny 2)")  # fmt: skip
    add("--tiny", action="store_true", help="dry run: tiny config, N in {32, 64}, 2 repeats")
    add("--dtype", choices=DTYPES, help="the models' dtype (default fp32 on the CPU, bf16 on CUDA)")
    add("--paired", type=int, metavar="N", help="internal: run the paired timing, print its JSON")
    return parser


def device_arguments(parser: argparse.ArgumentParser) -> None:
    """--device and --out of a run on a device (decoder_gpu.py, decoder_static.py)."""
    parser.add_argument("--device", choices=DEVICES, default="cuda", help="where the models run (default cuda; cpu: "
                        "a dry run, without memory figures)")  # fmt: skip
    parser.add_argument("--out", help="output folder (default bench/results/<gpu name slug>, or bench/results/cpu "
                        "for a dry run)")  # fmt: skip


def finish_parsing(
    parser: argparse.ArgumentParser, args: argparse.Namespace, min_rounds: int = 1
) -> argparse.Namespace:
    """``args`` with the defaults of the lengths, decoded tokens and rounds (``--tiny``'s or the full run's) and of
    the dtype (the device's), checked: positive lengths and threads, at least ``min_rounds`` paired rounds."""
    defaults = ([32, 64], 4, 2) if args.tiny else ([512, 2048], 16, 5)
    args.lengths = args.lengths or defaults[0]
    args.decode_tokens = args.decode_tokens if args.decode_tokens is not None else defaults[1]
    args.paired_rounds = args.paired_rounds if args.paired_rounds is not None else defaults[2]
    args.dtype = args.dtype or DEFAULT_DTYPES[getattr(args, "device", "cpu")]
    if min(args.threads, *args.lengths) < 1:
        parser.error("--threads and --lengths must be positive")
    if args.decode_tokens < 0:
        parser.error("--decode-tokens must be >= 0")
    if args.paired_rounds < min_rounds or (args.paired is not None and (args.paired < 1 or args.paired_rounds < 1)):
        parser.error(f"--paired-rounds must be >= {min_rounds} (>= 1 with --paired), --paired N positive")
    return args


def spawn_paired(script: str | Path, length: int, args: argparse.Namespace, arguments: list[str]) -> dict:
    """The paired timing of N = ``length`` in a fresh process of ``script``: ``--paired length`` and the options
    every decoder benchmark shares, then the script's own ``arguments``."""
    common = ["--paired", str(length), "--paired-rounds", str(args.paired_rounds)]
    common += ["--decode-tokens", str(args.decode_tokens), "--threads", str(args.threads), "--dtype", args.dtype]
    common += ["--tiny"] if args.tiny else []
    return run_child(script, [*common, *arguments], args.threads, f"paired timing N={length}")


def device_output_paths(args: argparse.Namespace, gpu: str | None, stem: str) -> tuple[Path, Path]:
    """(JSON, Markdown) of a run on a device: ``<stem>.*`` under ``--out``, by default in the GPU's folder
    (bench/results/<gpu name slug>, as attention_gpu.py's). On the CPU (a dry run) ``<stem>_dry_run.*``, by default
    under bench/results/cpu; a dtype other than the device's default and the tiny config add a suffix."""
    cuda = args.device == "cuda"
    out = host.gpu_results_folder(args.out, gpu if cuda else None)
    stem += "" if cuda else "_dry_run"
    stem += ("" if args.dtype == DEFAULT_DTYPES[args.device] else f"_{args.dtype}") + ("_tiny" if args.tiny else "")
    return out / f"{stem}.json", out / f"{stem}.md"


@dataclasses.dataclass(frozen=True)
class DeviceRun:
    """A decoder benchmark run on ``--device`` (decoder_gpu.py, decoder_static.py): the paired timing of each N, one
    fresh process of ``script`` each, compared and written as JSON and Markdown. No fresh process per case: their
    RSS says nothing of a GPU, and the allocator's peak, reset before each prefill, measures memory in the paired
    process itself.

    ``benchmark``: what the report says it measured; ``stem``: its files' name (:func:`device_output_paths`);
    ``no_cuda_message``: what it says, exiting with status 2, where ``--device cuda`` finds no GPU; ``paired``:
    one paired timing in this process (the child's work); ``child_arguments``: the script's own options a child
    is given; ``summary``: prints a finished timing; ``comparison``: the report's rows, its Markdown table and the
    script's other keys; ``markdown``: the Markdown file; ``settings``: what the report says of the run beyond
    :func:`report_settings`.
    """

    script: str
    benchmark: str
    stem: str
    no_cuda_message: str
    paired: Callable[[int, argparse.Namespace], dict]
    child_arguments: Callable[[argparse.Namespace], list[str]]
    summary: Callable[[dict], None]
    comparison: Callable[[list[dict]], dict]
    markdown: Callable[[dict], str]
    settings: Callable[[argparse.Namespace], dict]

    def output_paths(self, args: argparse.Namespace, gpu: str | None) -> tuple[Path, Path]:
        """(JSON, Markdown) of this run (:func:`device_output_paths`)."""
        return device_output_paths(args, gpu, self.stem)

    def spawn(self, length: int, args: argparse.Namespace) -> dict:
        """The paired timing of ``length`` in a fresh process of the script."""
        return spawn_paired(self.script, length, args, ["--device", args.device, *self.child_arguments(args)])

    def collect(
        self, args: argparse.Namespace, paired_run: Callable[[int, argparse.Namespace], dict] | None = None
    ) -> dict:
        """The run: the paired timing of each N (``paired_run``; by default :meth:`spawn`), each summarised as it
        finishes, compared, written."""
        elapsed = stopwatch()
        info = host.machine_info(args.threads)
        # machine_info says cuda wherever a GPU is visible; the device is what the run used.
        info["device"], info["batch"] = args.device, 1
        json_path, markdown_path = self.output_paths(args, info["gpu"])
        json_path.parent.mkdir(parents=True, exist_ok=True)
        print(f"machine: {host.machine_line(info)}; {args.dtype}", flush=True)
        timings = []
        for length in args.lengths:
            timings.append((paired_run or self.spawn)(length, args))
            self.summary(timings[-1])
        config = model_config(args.tiny)
        first = timings[0]
        report = {
            **report_head(self.benchmark, args, info),
            **{key: first[key] for key in ("device_name", "torch", "ea_hf_triton")},
            "config": config.to_diff_dict(),
            "parameters": first["parameters"],
            "settings": report_settings(args, config.num_hidden_layers) | {"device": args.device},
            "paired_timing": timings,
            **self.comparison(timings),
        }
        report["settings"] |= self.settings(args) | DEVICE_METHOD
        report["wall_time_s"] = elapsed()
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        markdown_path.write_text(self.markdown(report))
        print()
        print(report["markdown_table"])
        print(f"wall time {report['wall_time_s']:.0f} s; wrote {json_path}, {markdown_path}")
        return report

    def main(self, args: argparse.Namespace) -> None:
        """:meth:`collect`, or with ``--paired N`` one paired timing printed as a result line; with ``--device
        cuda`` and no GPU, ``no_cuda_message`` and exit status 2."""
        import torch

        if args.device == "cuda" and not torch.cuda.is_available():
            print(self.no_cuda_message, file=sys.stderr)
            sys.exit(2)
        if args.paired is not None:
            print_result(self.paired(args.paired, args))
        else:
            self.collect(args)

"""Decoder-only cost of Evolving Attention on the CPU: a random ~125M Llama with eager, sdpa, EA and EA on a quarter
of the layers.

Every (variant, N) case runs in a fresh subprocess of this script (``--case VARIANT N``): it builds the model,
times the prefill ``model(input_ids, use_cache=True)`` and then step-by-step decoding with the returned cache,
measures the peak memory the prefill adds, and inspects the cache for the convolution rows that EA keeps between
decoding steps. Fresh processes on a shared host differ in speed by more than EA's cost (docs/performance.md), so
one more process per N (``--paired N``) builds every variant and times them in turns, round after round: the paired
ratios compare variants that ran side by side. The parent collects the cases, computes the ratios against sdpa and
eager and writes a JSON file and a Markdown report.

    python bench/benchmarks/decoder_cpu.py         # full run: N in {512, 2048}, 3 repeats, 1 warm-up, 16 decoded
                                                   # tokens, and 5 paired rounds per N
    python bench/benchmarks/decoder_cpu.py --tiny  # dry run: tiny config, N in {32, 64}, a few seconds per case

The same model on a GPU: decoder_gpu.py; with a static cache and compiled decoding: decoder_static.py. The model,
the paired timing and the tables they share come from bench/harness/decoder.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # harness/ is in bench/, one folder up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import BENCH_DIR, ea, host, memory  # noqa: E402
from harness.children import print_result, run_child  # noqa: E402
from harness.decoder import (  # noqa: E402
    DEFAULT_DTYPES,
    EA_VARIANTS,
    FULL_CONFIG,
    TINY_CONFIG,
    VARIANTS,
    common_parser,
    evolved_layers,
    finish_parsing,
    human_bytes,
    kept_rows,
    kv_cache_bytes,
    llama,
    model_config,
    paired_cells,
    paired_table,
    per_layer,
    prompt,
    report_head,
    report_settings,
    run_paired,
    spawn_paired,
    timed_decoding,
    variant_label,
)
from harness.models import parameter_count  # noqa: E402
from harness.tables import markdown_table, number, ratio  # noqa: E402
from harness.timing import stopwatch, timed  # noqa: E402

#: How a run measures (the report's settings).
CPU_METHOD = {
    "prefill_no_cache": "EA variants only: model(input_ids, use_cache=False), same warm-up and repeats",
    "memory": "fresh process per case; VmRSS after model construction; peak RSS (VmHWM, reset after "
    "construction) over the prefills; decode peak reset again before decoding",
    "paired": "one more process per N with all variants, timed in turns (a prefill, then decode_tokens "
    "steps) for paired_rounds rounds after an untimed one, the order rotating; medians over the rounds",
}
#: The columns of the Markdown tables: the cost of each case, the rows EA keeps.
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
# Child: one (variant, N) case, or one paired timing.
# --------------------------------------------------------------------------------------------------------------


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


def run_paired_on_cpu(
    length: int, rounds: int, decode_tokens: int, threads: int, tiny: bool, dtype: str = "fp32"
) -> dict:
    """Time every variant on the CPU in this one process, in turns (:func:`harness.decoder.run_paired`): each round
    runs each variant's prefill and then its decoding, in an order that rotates from round to round; a first round
    warms up and is not timed. Returns the times and medians per variant, and the ratios of the medians to eager's
    and sdpa's. The variants run side by side, so that a slow spell of a shared host slows them alike.
    """
    import torch

    torch.set_num_threads(threads)
    return {**run_paired(length, rounds, decode_tokens, dtype, "cpu", tiny), "threads": threads}


def spawn_paired_on_cpu(length: int, args: argparse.Namespace) -> dict:
    """:func:`run_paired_on_cpu` of ``length`` in a fresh process of this script."""
    return spawn_paired(__file__, length, args, [])


def run_paired_in_process(length: int, args: argparse.Namespace) -> dict:
    """:func:`spawn_paired_on_cpu`'s timing in this process (the child's work; tests)."""
    return run_paired_on_cpu(length, args.paired_rounds, args.decode_tokens, args.threads, args.tiny, args.dtype)


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
    paired_run: Callable[[int, argparse.Namespace], dict] = spawn_paired_on_cpu,
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
        "settings": cpu_settings(args, config.num_hidden_layers),
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


def cpu_settings(args: argparse.Namespace, num_layers: int) -> dict:
    """What the report says of how it was run: the cases, their repeats and their waits for a quiet machine."""
    settings = report_settings(args, num_layers) | {"repeats": args.repeats, "warmup": args.warmup}
    settings |= {"quiet_wait_s": args.quiet_wait, "max_other_cores": args.max_other_cores, "retries": args.retries}
    return settings | CPU_METHOD


def build_parser() -> argparse.ArgumentParser:
    """The command line; the defaults of the lengths, repeats, decoded tokens and rounds are set after parsing."""
    parser = common_parser(__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--out", help="output folder (default bench/results; a run to keep goes to bench/results/<machine>)")
    add("--repeats", type=int, help="timed prefills per case (default 3; tiny 2)")
    add("--warmup", type=int, default=1, help="untimed prefills before them (default 1)")
    add("--quiet-wait", type=float, default=300.0, help="before each case, wait up to this many seconds for other "
        "processes to leave the CPU (default 300; 0: do not wait)")  # fmt: skip
    add("--max-other-cores", type=float, default=0.1, help="a case during which other processes used more cores "
        "than this on average is run again (default 0.1)")  # fmt: skip
    add("--retries", type=int, default=1, help="how often a disturbed case is run again (default 1)")
    add("--case", nargs=2, metavar=("VARIANT", "N"), help="internal: run one case, print its JSON")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; ``--tiny`` replaces the lengths and repeats unless they are given explicitly; 0 paired
    rounds: no paired timing."""
    parser = build_parser()
    args = finish_parsing(parser, parser.parse_args(argv), min_rounds=0)
    args.repeats = args.repeats if args.repeats is not None else (2 if args.tiny else 3)
    if args.case:
        if args.case[0] not in VARIANTS:
            parser.error(f"--case expects VARIANT in {VARIANTS}")
        args.case = (args.case[0], int(args.case[1]))
    if args.repeats < 1:
        parser.error("--repeats must be positive")
    if min(args.warmup, args.retries, args.quiet_wait, args.max_other_cores) < 0:
        parser.error("--warmup, --retries, --quiet-wait and --max-other-cores must be >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    """Parent run by default; ``--case VARIANT N`` and ``--paired N`` run one case or one paired timing and print it
    as a result line."""
    args = parse_args(argv)
    if args.case:
        print_result(run_case_in_process(*args.case, args))
    elif args.paired is not None:
        print_result(run_paired_in_process(args.paired, args))
    else:
        collect(args)


if __name__ == "__main__":
    main()

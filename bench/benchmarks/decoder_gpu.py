"""Decoder-only cost of Evolving Attention on a GPU: a random ~125M Llama with eager, sdpa, EA and EA on a quarter of
the layers, in bf16 by default.

The RSS of fresh processes measures nothing on a GPU, so only paired processes run, one per N: every variant built
on the GPU, timed in turns (CUDA events around each prefill and each decoding step), and the peak memory each
prefill adds read from the CUDA allocator. The report gives each variant's prefill time, prefill memory and ms per
decoded token against eager's and sdpa's, and which path evolved the maps (``EA_HF_TRITON=1``: ea_hf's Triton
kernels; else torch operations).

    python bench/benchmarks/decoder_gpu.py --paired-rounds 3        # bench/results/<gpu>/bench_decoder_gpu.*
    python bench/benchmarks/decoder_gpu.py --device cpu --tiny      # the same protocol on the CPU, a dry run

The model, the paired timing and the tables come from bench/harness/decoder.py (decoder_cpu.py's too).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # harness/ is in bench/, one folder up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import ea  # noqa: E402
from harness.children import print_result  # noqa: E402
from harness.decoder import (  # noqa: E402
    DEVICE_METHOD,
    VARIANTS,
    collect_on_device,
    common_parser,
    device_arguments,
    device_output_paths,
    exit_without_cuda,
    finish_parsing,
    paired_cells,
    paired_table,
    per_layer,
    run_paired,
    spawn_paired,
)
from harness.tables import number  # noqa: E402

NO_CUDA_MESSAGE = "decoder_gpu.py: --device cuda, but no CUDA device is available (--device cpu: a CPU dry run)"
#: What the report measured.
BENCHMARK = (
    "Random Llama-style decoder (~125M) on a GPU: prefill time and memory, and decoding latency, of eager vs sdpa vs "
    "ea_hf Evolving Attention (all layers and every 4th layer), side by side"
)


def spawn_paired_on_device(length: int, args: argparse.Namespace) -> dict:
    """The paired timing of ``length`` on ``--device`` in a fresh process of this script."""
    return spawn_paired(__file__, length, args, ["--device", args.device])


def run_paired_in_process(length: int, args: argparse.Namespace) -> dict:
    """:func:`spawn_paired_on_device`'s timing in this process (the child's work; tests)."""
    return run_paired(length, args.paired_rounds, args.decode_tokens, args.dtype, args.device, args.tiny)


def device_rows(timings: list[dict]) -> list[dict]:
    """One row per (N, variant) of a run (:func:`harness.decoder.run_paired` per N): the paired cells, the
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


def device_markdown_report(report: dict) -> str:
    """The Markdown file of a run: what was run, the table and how to read it."""
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


def run_device_timings(
    args: argparse.Namespace, paired_run: Callable[[int, argparse.Namespace], dict] = spawn_paired_on_device
) -> list[dict]:
    """The paired timing of each N, printed as each finishes."""
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


def device_comparison(timings: list[dict]) -> dict:
    """A report's rows and its table."""
    rows = device_rows(timings)
    return {"comparison": rows, "markdown_table": paired_table(rows, device=True)}


def output_paths(args: argparse.Namespace, gpu: str | None) -> tuple[Path, Path]:
    """(JSON, Markdown): ``bench_decoder_gpu.*`` under ``--out`` or bench/results/<gpu name slug>; on the CPU
    (a dry run) ``bench_decoder_gpu_dry_run.*``, by default under bench/results/cpu
    (:func:`harness.decoder.device_output_paths`)."""
    return device_output_paths(args, gpu, "bench_decoder_gpu")


def collect(
    args: argparse.Namespace, paired_run: Callable[[int, argparse.Namespace], dict] = spawn_paired_on_device
) -> dict:
    """The run: the paired timing of each N on ``--device`` (``paired_run``: a fresh process each by default),
    compared, written as JSON and Markdown."""
    timings = functools.partial(run_device_timings, paired_run=paired_run)
    return collect_on_device(
        args, BENCHMARK, output_paths, timings, device_comparison, device_markdown_report, DEVICE_METHOD
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; ``--tiny`` replaces the lengths and the rounds unless they are given explicitly."""
    parser = common_parser(__doc__.split("\n\n")[0])
    device_arguments(parser)
    return finish_parsing(parser, parser.parse_args(argv))


def main(argv: list[str] | None = None) -> None:
    """The run (on ``--device cuda`` exits with status 2 without a GPU); ``--paired N`` runs one paired timing and
    prints it as a result line."""
    args = parse_args(argv)
    exit_without_cuda(args, NO_CUDA_MESSAGE)
    if args.paired is not None:
        print_result(run_paired_in_process(args.paired, args))
    else:
        collect(args)


if __name__ == "__main__":
    main()

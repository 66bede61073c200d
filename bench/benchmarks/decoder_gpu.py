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
import sys
from pathlib import Path

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # harness/ is in bench/, one folder up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import decoder, ea  # noqa: E402
from harness.tables import number  # noqa: E402

NO_CUDA_MESSAGE = "decoder_gpu.py: --device cuda, but no CUDA device is available (--device cpu: a CPU dry run)"
#: What the report measured.
BENCHMARK = (
    "Random Llama-style decoder (~125M) on a GPU: prefill time and memory, and decoding latency, of eager vs sdpa vs "
    "ea_hf Evolving Attention (all layers and every 4th layer), side by side"
)


def device_rows(timings: list[dict]) -> list[dict]:
    """One row per (N, variant) of a run (:func:`harness.decoder.run_paired` per N): the paired cells, the
    memory the prefill added with its ratios, what evolved the maps, and the rows EA kept on the cache."""
    rows = []
    for timing in timings:
        for variant in decoder.VARIANTS:
            kept = timing["kept_rows_after_prefill"][variant]
            rows.append(
                {
                    **decoder.paired_cells(timing, variant),
                    "variant": variant,
                    "n": timing["n"],
                    "evolved_layers": timing["evolved_layers"][variant],
                    "evolution_path": timing["evolution_path"][variant],
                    "prefill_memory_added_mib": timing["prefill_memory_added_mib"][variant],
                    "prefill_memory_over_sdpa": timing["prefill_memory_over_sdpa"][variant],
                    "prefill_memory_over_eager": timing["prefill_memory_over_eager"][variant],
                    "kv_cache_bytes_per_layer": timing["kv_cache_bytes_per_layer"][variant][0],
                    "kept_rows_layers": len(kept),
                    "kept_rows_bytes_per_layer": decoder.per_layer(kept, "bytes"),
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


def print_timing(timing: dict) -> None:
    """A finished paired timing's line per variant, and its time."""
    length = timing["n"]
    for variant in decoder.VARIANTS:
        added_mib = timing["prefill_memory_added_mib"][variant]
        print(
            f"  {variant:<9} N={length:<5} prefill {timing['prefill_median_s'][variant] * 1e3:8.2f} ms "
            f"({timing['prefill_over_eager'][variant]:.3f}x eager)  peak +{number(added_mib, 1)} MiB  decode "
            f"{timing['decode_median_s'][variant] * 1e3:7.2f} ms/token "
            f"({timing['decode_over_eager'][variant]:.3f}x eager)  {timing['evolution_path'][variant] or ''}",
            flush=True,
        )
    print(f"  [N={length}: {timing.get('process_wall_s', timing['measured_wall_s']):.0f} s]", flush=True)


def device_comparison(timings: list[dict]) -> dict:
    """A report's rows and its table."""
    rows = device_rows(timings)
    return {"comparison": rows, "markdown_table": decoder.paired_table(rows, device=True)}


def run_paired_in_process(length: int, args: argparse.Namespace) -> dict:
    """The paired timing of ``length`` on ``--device`` in this process (the child's work; tests)."""
    return decoder.run_paired(length, args.paired_rounds, args.decode_tokens, args.dtype, args.device, args.tiny)


RUN = decoder.DeviceRun(
    script=__file__, benchmark=BENCHMARK, stem="bench_decoder_gpu", no_cuda_message=NO_CUDA_MESSAGE,
    paired=run_paired_in_process, child_arguments=lambda args: [], summary=print_timing, comparison=device_comparison,
    markdown=device_markdown_report, settings=lambda args: {},
)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; ``--tiny`` replaces the lengths and the rounds unless they are given explicitly."""
    parser = decoder.common_parser(__doc__.split("\n\n")[0])
    decoder.device_arguments(parser)
    return decoder.finish_parsing(parser, parser.parse_args(argv))


def main(argv: list[str] | None = None) -> None:
    """The run, or with ``--paired N`` one paired timing (:meth:`harness.decoder.DeviceRun.main`)."""
    RUN.main(parse_args(argv))


if __name__ == "__main__":
    main()

"""Fast generation with Evolving Attention, as transformers documents it: a random ~125M Llama with a static cache,
each of eager, sdpa and EA decoding as it is and with ``torch.compile(model.forward, fullgraph=True,
mode="reduce-overhead")`` (CUDA graphs), side by side in one process per N.

The report holds each against plain (sdpa) decoding run alike, counts the graphs each compiled, checks that
compiled decoding gives the tokens decoded without compiling, and says whether EA meets fast generation's targets
(compiled decoding within 1.10x of plain compiled, the prefill within 1.3x of plain).

    python bench/benchmarks/decoder_static.py --lengths 512                             # <gpu>/bench_decoder_static.*
    python bench/benchmarks/decoder_static.py --device cpu --tiny --compile-backend eager  # a dry run on the CPU

The model, the paired timing and the rows kept come from bench/harness/decoder.py (decoder_gpu.py's too).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # harness/ is in bench/, one folder up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import decoder, ea, memory  # noqa: E402
from harness.models import parameter_count  # noqa: E402
from harness.tables import markdown_table, number, ratio  # noqa: E402
from harness.timing import timed  # noqa: E402

NO_CUDA_MESSAGE = "decoder_static.py: --device cuda, but no CUDA device is available (--device cpu: a CPU dry run)"
#: The attentions timed with a static cache, each as it is and with its decoding step compiled (the variant
#: ``<attention>-compile``); PLAIN, the unpatched model's default attention, is what EA is held against.
ATTENTIONS = ("eager", "sdpa", "ea")
PLAIN = "sdpa"
COMPILED_SUFFIX = "-compile"
#: Fast generation's targets, (figure, variant): the most it may cost against plain run alike.
TARGETS = {("decode", "ea-compile"): 1.10, ("prefill", "ea"): 1.3}
#: What the report measured.
BENCHMARK = (
    "Random Llama-style decoder (~125M) with a static cache: prefill and decoding per token of plain and Evolving "
    "Attention models, each as they are and compiled"
)


def compiled_name(attention: str) -> str:
    """The variant of ``attention`` whose decoding step runs under torch.compile."""
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
    kept, kv_bytes = decoder.kept_rows(cache), decoder.kv_cache_bytes(cache)
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
    """The paired timing of N = ``length`` in this process: each of ``--attentions`` built in
    ``--dtype`` on ``--device``, its turns (:func:`static_turn`) as it is and with its decoding step compiled
    (``--compile-mode``, ``--compile-backend``), side by side for ``--paired-rounds`` rounds after one that warms
    up and compiles. Medians, ratios to plain (sdpa) decoding as it is and compiled, and the graphs each compiled."""
    ea.import_ea_hf()
    models = {attention: decoder.llama(attention, args.tiny, args.dtype, args.device) for attention in args.attentions}
    config = models[PLAIN].config
    input_ids = decoder.prompt(config.vocab_size, length, args.device)
    turns = {}
    for attention, model in models.items():
        forward = compiled_forward(model, args.compile_mode, args.compile_backend)
        turns[attention] = functools.partial(static_turn, model, model, input_ids, args.decode_tokens, args.device)
        turns[compiled_name(attention)] = functools.partial(
            static_turn, model, forward, input_ids, args.decode_tokens, args.device
        )
    evolving = {name for name in turns if name.removesuffix(COMPILED_SUFFIX) == "ea"}
    compiled = {name for name in turns if name.endswith(COMPILED_SUFFIX)}
    timing = decoder.paired_turns(turns, args.paired_rounds, evolving, compiled)
    return {
        "n": length,
        "rounds": args.paired_rounds,
        "decode_tokens": args.decode_tokens,
        "tiny": args.tiny,
        "compile": {"mode": args.compile_mode, "backend": args.compile_backend, "fullgraph": True},
        **decoder.where_it_ran(args.device, args.dtype),
        "parameters": parameter_count(models[PLAIN]),
        **decoder.with_medians(timing, (PLAIN, compiled_name(PLAIN))),
    }


def static_rows(timings: list[dict]) -> list[dict]:
    """One row per (N, variant): its medians, each against plain (sdpa) decoding compiled alike
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
    for (what, variant), limit in TARGETS.items():
        for row in rows:
            if row["variant"] == variant:
                value = row[f"{what}_over_plain"]
                checks.append({"what": what, "variant": variant, "n": row["n"], "ratio": value, "limit": limit,
                               "met": value is not None and value <= limit})  # fmt: skip
    return checks


def static_table(rows: list[dict]) -> str:
    """The rows as Markdown."""
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
    """The Markdown file: what was run, the table, the targets."""
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


def print_timing(timing: dict) -> None:
    """A finished paired timing's line per variant."""
    for row in static_rows([timing]):
        print(
            f"  {row['variant']:<14} N={row['n']:<5} prefill {row['prefill_ms']:8.2f} ms  decode "
            f"{row['decode_ms_per_token']:7.2f} ms/token ({number(row['decode_over_plain'], 3)}x plain, "
            f"{number(row['decode_over_as_is'], 3)}x as is)  graphs {row['graphs_compiled']}",
            flush=True,
        )


def static_comparison(timings: list[dict]) -> dict:
    """A report's rows, its targets and its table."""
    rows = static_rows(timings)
    return {"comparison": rows, "targets": static_targets(rows), "markdown_table": static_table(rows)}


def compile_arguments(args: argparse.Namespace) -> list[str]:
    """The options a child is given beside the common ones: the attentions and how to compile."""
    return [
        "--attentions",
        *args.attentions,
        "--compile-mode",
        args.compile_mode,
        "--compile-backend",
        args.compile_backend,
    ]


def compile_settings(args: argparse.Namespace) -> dict:
    """What the report says of the attentions and how they were compiled."""
    return {"attentions": args.attentions, "compile_mode": args.compile_mode, "compile_backend": args.compile_backend}


RUN = decoder.DeviceRun(
    script=__file__, benchmark=BENCHMARK, stem="bench_decoder_static", no_cuda_message=NO_CUDA_MESSAGE,
    paired=run_static_paired, child_arguments=compile_arguments, summary=print_timing, comparison=static_comparison,
    markdown=static_markdown_report, settings=compile_settings,
)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; ``--tiny`` replaces the lengths and the rounds unless they are given explicitly."""
    parser = decoder.common_parser(__doc__.split("\n\n")[0])
    decoder.device_arguments(parser)
    add = parser.add_argument
    add("--attentions", nargs="+", choices=ATTENTIONS, default=list(ATTENTIONS),
        help=f"the attentions (default all; {PLAIN} and ea at least)")  # fmt: skip
    add("--compile-mode", default="reduce-overhead", help="torch.compile's mode with inductor (default "
        "reduce-overhead: CUDA graphs)")  # fmt: skip
    add("--compile-backend", default="inductor", help="torch.compile's backend (default inductor; the CPU's dry "
        "run: eager)")  # fmt: skip
    args = decoder.finish_parsing(parser, parser.parse_args(argv))
    if not {PLAIN, "ea"} <= set(args.attentions):
        parser.error(f"--attentions must include {PLAIN} and ea")
    return args


def main(argv: list[str] | None = None) -> None:
    """The run, or with ``--paired N`` one paired timing (:meth:`harness.decoder.DeviceRun.main`)."""
    RUN.main(parse_args(argv))


if __name__ == "__main__":
    main()

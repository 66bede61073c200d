"""Side-by-side benchmark: BERT-Base with eager attention, with sdpa, and with Evolving Attention (ea_hf).

Every (variant, N, mode) case runs in a fresh subprocess of this script (``--case VARIANT N MODE``), which
builds the model, times the case and reports its own peak memory as one JSON line on stdout; the parent
collects the cases, computes the ratios against eager, writes a JSON file, a PNG plot and a Markdown table.

    python bench/benchmarks/attention_cpu.py                     # full run: N in {128, 512}, 5 repeats, 2 warm-ups
    python bench/benchmarks/attention_cpu.py --quick             # smoke test: N = 64, 2 repeats, 1 warm-up

See bench/README.md for what each figure means. Timing, memory, the result lines and the machine's description
come from bench/harness.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # harness/ is in bench/, one folder up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import BENCH_DIR, is_cuda  # noqa: E402
from harness.children import print_result, run_child  # noqa: E402
from harness.ea import EA_ALPHA, EA_BETA, counted_kernel_calls, evolution_path, import_ea_hf  # noqa: E402
from harness.host import HostActivity, host_activity, machine_info, machine_line, utc_now  # noqa: E402
from harness.memory import MIB, current_rss_mib, gpu_peak_bytes, process_peak_rss_mib, reset_gpu_peak, step_memory_mib  # noqa: E402
from harness.models import build_model, parameter_count, random_batch  # noqa: E402
from harness.tables import markdown_table, number, passes, ratio, target_cell  # noqa: E402
from harness.timing import Timed, alternating, stopwatch, summary, timed  # noqa: E402

VARIANTS = ("eager", "sdpa", "ea")
#: The variants of the compiled row: eager attention and EA, both through torch.compile.
COMPILED_VARIANTS = ("eager", "ea")
MODES = ("inference", "training")
LABELS = {"eager": "eager", "sdpa": "sdpa", "ea": "EA"}
#: Targets (issue 18): (metric, mode, N) -> the largest acceptable EA/eager ratio. Memory is the training
#: step's: the peak above the loaded model (activations and gradients), not the total RSS.
TARGETS = {
    ("time", "inference", 512): 1.10,
    ("time", "training", 128): 1.05,
    ("time", "training", 512): 1.12,
    ("memory", "training", 128): 1.1,
    ("memory", "training", 512): 1.2,
}
#: Default batch size per sequence length (the issue's shapes).
DEFAULT_BATCHES = {128: 8, 512: 2}
#: The compiled rows: where the core keeps S and P (N = 128) and where a compiled step recomputes them (N = 512).
DEFAULT_COMPILED = [("128", "training"), ("512", "training")]
#: Steps whose memory the compiled row measures per variant (the largest is reported, as for the table).
MEMORY_STEPS = 3
#: The fewest warm-up steps of a compiled model: they compile its forward (and backward), and none is timed.
COMPILED_WARMUP = 2
#: The variants a profile compares (``--profile``), and how many of its operators it reports per variant.
PROFILED_VARIANTS = ("eager", "ea")
PROFILE_ROWS = 25
#: Independent sets of maps the kernel timing cycles through, so that each call finds its maps out of cache (as
#: in a training step, where a layer's maps were written a whole layer earlier): at N = 512, batch 2, 4 sets of 4
#: maps of 24 MiB, several times a last-level cache.
KERNEL_MAP_SETS = 4
#: The maps of one kernel call: S, A_prev, the incoming gradient and the next layer's gradient added to it.
KERNEL_MAPS = ("scores", "previous", "grad", "addend")
#: The table's columns (:func:`comparison_table`) and their alignment.
TABLE_HEADER = (
    "N", "batch", "mode", "eager ms", "sdpa ms", "EA ms", "EA/eager time", "EA/eager time, each process",
    "time target", "EA/sdpa time", "EA/eager time, separate processes", "eager step MiB", "EA step MiB",
    "EA/eager step memory", "memory target", "eager peak MiB", "EA peak MiB", "EA/eager total RSS",
)  # fmt: skip
COMPILED_HEADER = (
    "N", "batch", "mode", "compiled eager ms", "compiled EA ms", "EA/eager time, both compiled",
    "compiled eager step MiB", "compiled EA step MiB", "EA/eager step memory, both compiled",
)  # fmt: skip


# --------------------------------------------------------------------------------------------------------------
# Child: one (variant, N, mode) case in its own process.
# --------------------------------------------------------------------------------------------------------------


def bert(variant: str, device: Any, dropout: float = 0.0) -> Any:
    """BERT-Base (transformers.BertConfig defaults) with random weights, fp32, its attention and hidden dropout
    ``dropout`` (off by default: train and eval then compute the same thing; BERT's own default is 0.1)."""
    import torch
    from transformers import BertConfig, BertModel

    config = BertConfig(hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return build_model(BertModel, config, variant, device=device, dtype=torch.float32)


def bert_step(model: Any, inputs: dict[str, Any], mode: str) -> Callable[[], None]:
    """One step of ``model`` on ``inputs``: a forward under ``no_grad`` (inference), or a forward and the backward
    of ``last_hidden_state.float().pow(2).mean()`` (training)."""
    import torch

    def step() -> None:
        if mode == "inference":
            with torch.no_grad():
                model(**inputs)
        else:
            model(**inputs).last_hidden_state.float().pow(2).mean().backward()

    return step


@dataclasses.dataclass
class Case:
    """A built case: the model and its step, where it runs, and the masks its first attention layer was given
    (an all-ones mask may be dropped), recorded by ``hook`` during the first step."""

    model: Any
    step: Callable[[], None]
    device: Any
    seen_masks: list[str]
    hook: Any


def build_case(variant: str, length: int, mode: str, batch: int, threads: int, dropout: float) -> Case:
    """The model of one case on the GPU where there is one, in train or eval mode, its step and a random batch."""
    import torch

    import_ea_hf()  # in every variant, so that all children carry the same libraries
    torch.set_num_threads(threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = bert(variant, device, dropout)
    model.train(mode == "training")  # with --dropout 0 (the default) train and eval compute the same thing
    seen_masks: list[str] = []

    def record_mask(module: Any, args: tuple, kwargs: dict) -> None:
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        seen_masks.append("none" if mask is None else f"{mask.dtype} {tuple(mask.shape)}")

    hook = model.encoder.layer[0].attention.self.register_forward_pre_hook(record_mask, with_kwargs=True)
    inputs = random_batch(model.config.vocab_size, batch, length, device)
    return Case(model, bert_step(model, inputs, mode), device, seen_masks, hook)


def time_case(case: Case, warmup: int, repeats: int) -> list[Timed]:
    """The case's timed steps after ``warmup`` untimed ones, gradients set to None before each (untimed)."""
    runs = []
    for index in range(warmup + repeats):
        case.model.zero_grad(set_to_none=True)
        run = timed(case.step, case.device)
        if index == 0:
            case.hook.remove()
        if index >= warmup:
            runs.append(run)
    return runs


def memory_before_case(device: Any) -> tuple[float, float]:
    """(memory now, its peak so far) in MiB, the model and inputs built and nothing run: on CUDA what the
    allocator holds (its peak reset here), on the CPU the RSS and the process's peak RSS."""
    if is_cuda(device):
        before = reset_gpu_peak(device) / MIB
        return before, before
    return current_rss_mib(), process_peak_rss_mib()


def measure_case(device: Any, before_mib: float, peak_before_mib: float) -> dict:
    """The case's memory: the peak over the whole case, against what was there before it."""
    if is_cuda(device):
        peak_mib = gpu_peak_bytes(device) / MIB
        source = "torch.cuda.max_memory_allocated (peak of the case; before = memory_allocated after setup)"
    else:
        peak_mib = process_peak_rss_mib()
        source = "ru_maxrss of a fresh process (before = VmRSS after model creation)"
    return {
        "memory_source": source,
        "before_mib": before_mib,
        "peak_before_case_mib": peak_before_mib,
        "peak_mib": peak_mib,
        "increment_mib": peak_mib - before_mib,
        "case_raised_peak": peak_mib > peak_before_mib,
    }


def host_figures(runs: list[Timed], threads: int, host: HostActivity) -> dict:
    """The CPU seconds of the timed steps and what the rest of the machine did meanwhile."""
    times, cpu_times = [run.seconds for run in runs], [run.cpu_s for run in runs]
    return {
        # CPU seconds of this process per timed repetition; cpu/wall well below `threads` means it was starved.
        "cpu_times_s": cpu_times,
        "cpu_over_wall": statistics.fmean(c / t for c, t in zip(cpu_times, times, strict=True)),
        "loadavg_1min_before_after": [host.loadavg_before[0], host.loadavg_after[0]],
        # Machine-wide CPU seconds used by everything except this process during warm-ups + repetitions, and
        # hypervisor steal: both near 0 when the case had the machine to itself.
        "other_processes_cpu_s": host.other_cpu_s,
        "steal_s": host.steal_s,
    }


def run_case(
    variant: str, length: int, mode: str, repeats: int, warmup: int, batch: int, threads: int, dropout: float = 0.0
) -> dict:
    """One (variant, N, mode) case in this process (meant to be a fresh one): its times and its peak memory."""
    case = build_case(variant, length, mode, batch, threads, dropout)
    before_mib, peak_before_mib = memory_before_case(case.device)
    with host_activity() as host, counted_kernel_calls() as calls:
        runs = time_case(case, warmup, repeats)
    times = [run.seconds for run in runs]
    return {
        "variant": variant,
        # What computed the evolution: ea_hf's fused CPU kernel or torch operations (GPU, no C++ compiler).
        "evolution_path": evolution_path(variant == "ea", calls),
        "n": length,
        "mode": mode,
        "dropout": dropout,
        "batch": batch,
        "threads": threads,
        "device": case.device.type,
        "attn_implementation": case.model.config._attn_implementation,
        "attention_mask_seen_by_attention": case.seen_masks[0] if case.seen_masks else "not recorded",
        "parameters": parameter_count(case.model),
        "warmup": warmup,
        "repeats": repeats,
        "times_s": times,
        **summary(times),
        **host_figures(runs, threads, host),
        **measure_case(case.device, before_mib, peak_before_mib),
    }


@dataclasses.dataclass
class Prepared:
    """Models of several variants sharing one random batch, each with its step, and where they run."""

    models: dict[str, Any]
    steps: dict[str, Callable[[], None]]
    device: Any

    def zero_grad(self, variant: str) -> None:
        """Gradients of ``variant``'s model set to None: before each step, outside the timed region."""
        self.models[variant].zero_grad(set_to_none=True)

    def timed_step(self, variant: str) -> Timed:
        """One step of ``variant``, its gradients set to None first (untimed)."""
        self.zero_grad(variant)
        return timed(self.steps[variant], self.device)


def prepared_models(
    variants: tuple[str, ...], length: int, mode: str, batch: int, threads: int, compiled: bool, dropout: float = 0.0
) -> Prepared:
    """The models of ``variants`` (each through ``torch.compile`` if ``compiled``) in train or eval mode, and
    their steps on the shared random batch."""
    import torch

    torch.set_num_threads(threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    models = {v: bert(v, device, dropout) for v in variants}
    inputs = random_batch(next(iter(models.values())).config.vocab_size, batch, length, device)
    for model in models.values():
        model.train(mode == "training")
    if compiled:
        models = {v: torch.compile(model) for v, model in models.items()}
    return Prepared(models, {v: bert_step(model, inputs, mode) for v, model in models.items()}, device)


def run_paired(
    length: int,
    mode: str,
    repeats: int,
    warmup: int,
    batch: int,
    threads: int,
    min_seconds: float = 0.0,
    compiled: bool = False,
    dropout: float = 0.0,
) -> dict:
    """The three variants in one process, one step of each in turn (the order rotating), so that slow and
    fast spells of the machine hit them alike: the time ratios of the table. At least ``repeats`` timed steps
    each, more until the timed steps took ``min_seconds`` (short cases would otherwise sample a few seconds
    of the machine's drift). Memory comes from the separate processes of :func:`run_case`.

    ``compiled``: eager and EA only, each through ``torch.compile`` (inductor); the warm-up steps, at least two,
    include the compilation of forward (and backward). Their memory comes from :func:`run_compiled_memory`."""
    variants = COMPILED_VARIANTS if compiled else VARIANTS
    prepared = prepared_models(variants, length, mode, batch, threads, compiled, dropout)
    warmup = max(warmup, COMPILED_WARMUP) if compiled else warmup
    runs = alternating(prepared.steps, prepared.device, repeats, warmup, min_seconds, before=prepared.zero_grad)
    return {
        "n": length,
        "mode": mode,
        "dropout": dropout,
        "batch": batch,
        "compiled": compiled,
        "repeats": len(runs[variants[0]]),
        "min_seconds": min_seconds,
        "warmup": warmup,
        "times_s": {v: [run.seconds for run in runs[v]] for v in variants},
        "minor_faults": {v: [run.minor_faults for run in runs[v]] for v in variants},
    }


def operator_times(step: Callable[[], Any]) -> dict[str, tuple[float, int]]:
    """Where one call of ``step`` spends its time, per operator (torch's profiler, CPU): name -> (self
    milliseconds, calls). An operator's self time is its calling thread's wall time inside it, also where it runs
    on several threads, so the operators of a step add up to about its wall time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        step()
    return {event.key: (event.self_cpu_time_total / 1e3, event.count) for event in profiler.key_averages()}


def profile_rows(samples: list[dict[str, tuple[float, int]]]) -> list[dict]:
    """The mean over steps (:func:`operator_times` each) of each operator's self milliseconds and calls: the
    :data:`PROFILE_ROWS` operators with the most time of their own."""
    totals: dict[str, list[float]] = {}
    for sample in samples:
        for name, (milliseconds, calls) in sample.items():
            total = totals.setdefault(name, [0.0, 0.0])
            total[0] += milliseconds
            total[1] += calls
    rows = [
        {"name": name, "self_ms_per_step": milliseconds / len(samples), "calls_per_step": calls / len(samples)}
        for name, (milliseconds, calls) in totals.items()
    ]
    return sorted(rows, key=lambda row: row["self_ms_per_step"], reverse=True)[:PROFILE_ROWS]


def run_profile(
    length: int, mode: str, warmup: int, repeats: int, batch: int, threads: int, dropout: float = 0.0
) -> dict:
    """Where eager's and EA's steps go on this host (``--profile N MODE``): both models in one process, one step
    of each in turn (as the paired timing, so that the host's drift hits both alike), each step profiled on its
    own, ``repeats`` steps of each after the warm-ups. For the machines that lack a full run: the pieces EA adds
    (its forward and backward nodes, whose own time is mostly the CPU kernel, and the recomputed S and P) show
    how a host's EA overhead differs from another's."""
    prepared = prepared_models(PROFILED_VARIANTS, length, mode, batch, threads, False, dropout)
    for _ in range(warmup):
        for variant in PROFILED_VARIANTS:
            prepared.timed_step(variant)
    samples: dict[str, list] = {variant: [] for variant in PROFILED_VARIANTS}
    # Each profiled step's seconds and minor page faults: a step whose maps land on fresh pages spends its first
    # touches in whichever operator writes them first (see "minor page faults" in bench/README.md).
    measured: dict[str, list[Timed]] = {variant: [] for variant in PROFILED_VARIANTS}
    for _ in range(repeats):
        for variant in PROFILED_VARIANTS:
            samples[variant].append(operator_times(lambda v=variant: measured[v].append(prepared.timed_step(v))))
    return {
        "n": length,
        "mode": mode,
        "dropout": dropout,
        "batch": batch,
        "steps": repeats,
        "profile": {variant: profile_rows(samples[variant]) for variant in PROFILED_VARIANTS},
        "times_s": {variant: [run.seconds for run in runs] for variant, runs in measured.items()},
        "minor_faults": {variant: [run.minor_faults for run in runs] for variant, runs in measured.items()},
    }


def run_kernel(
    length: int, batch: int, repeats: int, threads: int, heads: int = 12, builds: Sequence[str] = ()
) -> dict:
    """The fused CPU kernel alone (``--kernel N``), at BERT-Base's head count and the benchmark's settings
    (3x3, alpha = beta = 0.2): the forward of a training step (in place, with its gate) and its backward (the
    gradient written over the incoming one, A_prev's added as it is read, one map for both gradients), each the
    median of ``repeats`` calls after one warm-up, the maps out of cache. Against the whole step, it tells how a
    host's EA overhead divides between the kernel and the rest (the profile, ``--profile``, gives the kernel's
    time inside a step, with whatever it shares the caches with).

    ``builds``: other builds of the kernel to time against the default one, each a string of compiler flags
    added to the usual ones (``--kernel-build=-DEA_HF_PREFETCH_LOCALITY=3``), the builds' calls alternating on
    the same maps (``builds`` in the result, by flags)."""
    import torch

    import_ea_hf()
    from ea_hf.ops.cpu import evolution as cpu

    torch.set_num_threads(threads)
    if not cpu.kernel_available():
        raise RuntimeError("no C++ compiler: the fused CPU kernel cannot be built on this machine")
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(heads, heads, 3, 3, generator=generator) * (EA_BETA / (3 * heads))
    sets = [
        {name: torch.randn((batch, heads, length, length), generator=generator) for name in KERNEL_MAPS}
        for _ in range(KERNEL_MAP_SETS)
    ]
    libraries = {"": cpu.cpu_kernel(), **{flags: cpu.build_library(*flags.split()) for flags in builds}}
    times: dict[str, dict[str, list[float]]] = {flags: {"forward": [], "backward": []} for flags in libraries}
    bias = torch.zeros(heads)
    for repeat in range(repeats + 1):
        for index, (flags, library) in enumerate(libraries.items()):
            maps = sets[(repeat * len(libraries) + index) % KERNEL_MAP_SETS]
            with cpu.using_library(library):
                forward, backward = kernel_passes(maps, weight, bias)
            if repeat:  # (the first round warms up)
                times[flags]["forward"].append(forward)
                times[flags]["backward"].append(backward)
    medians = {
        flags: {f"{direction}_ms": 1e3 * statistics.median(seconds) for direction, seconds in kernel.items()}
        for flags, kernel in times.items()
    }
    result = {"n": length, "batch": batch, "heads": heads, "calls": repeats, **medians.pop("")}
    return {**result, "builds": medians} if builds else result


def kernel_passes(maps: dict[str, Any], weight: Any, bias: Any) -> tuple[float, float]:
    """(forward seconds, backward seconds) of one training step's kernel calls on ``maps``, with the library in
    use: the forward in place with its gate, the backward written over the incoming gradient."""
    from ea_hf.modeling.step import EvolutionStep, GradientIn, StepMaps
    from ea_hf.ops.cpu import evolution as cpu

    step = EvolutionStep(EA_ALPHA, EA_BETA, context_rows=1)
    inputs = StepMaps(maps["scores"], maps["previous"], None)
    incoming = GradientIn(maps["grad"], maps["addend"], spent=True)  # written over the incoming one
    forward = timed(lambda: cpu.evolve(step, inputs, weight, bias, in_place=True, gate=True))
    gate = forward.output[1]
    backward = timed(lambda: cpu.backward(step, inputs, incoming, gate, weight, shared_map=True))
    return forward.seconds, backward.seconds


def memory_bandwidth(threads: int, mib: int = 256, repeats: int = 5) -> dict:
    """This host's memory bandwidth with ``threads`` threads (GB/s, the best of ``repeats``): a copy between two
    arrays of ``mib`` MiB (bytes read plus written) and a sum of one (read). The kernel streams its maps; the
    matmuls around it mostly do not."""
    import torch

    torch.set_num_threads(threads)
    source = torch.ones(mib * 262144)
    target = torch.empty_like(source)
    transfers = {"copy": (lambda: target.copy_(source), 2 * source.nbytes), "read": (source.sum, source.nbytes)}
    result = {}
    for name, (run, nbytes) in transfers.items():
        run()
        best = min(timed(run).seconds for _ in range(repeats))
        result[f"{name}_gb_s"] = nbytes / best / 1e9
    return result


def run_compiled_memory(
    variant: str, length: int, mode: str, warmup: int, batch: int, threads: int, dropout: float = 0.0
) -> dict:
    """The step memory of one compiled model alone in a fresh process (the compiled row's memory columns):
    at least two warm-up steps (the compilation), then :data:`MEMORY_STEPS` steps measured by
    :func:`harness.memory.step_memory_mib`. Alone, because the heap a second compiled model leaves behind moves
    what a step takes from the kernel."""
    prepared = prepared_models((variant,), length, mode, batch, threads, True, dropout)
    for _ in range(max(warmup, COMPILED_WARMUP)):
        prepared.timed_step(variant)
    memory = []
    for _ in range(MEMORY_STEPS):
        prepared.zero_grad(variant)  # the last step's gradients belong to no step
        memory.append(step_memory_mib(prepared.steps[variant], prepared.device))
    return {"variant": variant, "n": length, "mode": mode, "batch": batch, "step_memory_mib": memory}


# --------------------------------------------------------------------------------------------------------------
# Parent: spawn the cases, collect, compare, write.
# --------------------------------------------------------------------------------------------------------------


def spawn(internal: list[str], args: argparse.Namespace, what: str, length: int) -> dict:
    """Run this script with an internal mode (--case, --paired...) in a fresh process; return its JSON."""
    arguments = [*internal, "--rounds", str(args.rounds), "--paired-seconds", str(args.paired_seconds)]
    arguments += ["--repeats", str(args.repeats), "--warmup", str(args.warmup), "--batch", str(batch_of(args, length))]
    arguments += ["--threads", str(args.threads), "--dropout", str(args.dropout)]
    return run_child(__file__, arguments, args.threads, what)


def spawn_case(variant: str, length: int, mode: str, args: argparse.Namespace) -> dict:
    return spawn(["--case", variant, str(length), mode], args, f"case {variant} N={length} {mode}", length)


def batch_of(args: argparse.Namespace, length: int) -> int:
    """The batch size of sequence length ``length``: ``--batches`` (one per length, or one for all), else the
    default of that length, else 1 (also for a ``--compiled`` length outside ``--lengths``)."""
    if args.batches and len(args.batches) == 1:
        return args.batches[0]
    if args.batches and length in args.lengths:
        return args.batches[args.lengths.index(length)]
    return DEFAULT_BATCHES.get(length, 1)


def paired_medians(timing: dict, variants: tuple[str, ...] = VARIANTS) -> dict[str, float]:
    """The median step time (s) of each variant in one paired process's result (:func:`run_paired`)."""
    return {v: statistics.median(timing["times_s"][v]) for v in variants}


def compiled_row(timing: dict, memory: dict[str, dict] | None = None) -> dict:
    """The compiled row: medians of compiled eager and compiled EA steps (``timing``, :func:`run_paired`) and
    their ratio, and the step memory of each (``memory``: variant -> its :func:`run_compiled_memory` result; the
    largest of its measured steps) and its ratio (``None`` without ``memory``)."""
    medians = paired_medians(timing, COMPILED_VARIANTS)
    memory = {v: max(memory[v]["step_memory_mib"]) if memory else None for v in COMPILED_VARIANTS}
    return {
        "n": timing["n"],
        "batch": timing["batch"],
        "mode": timing["mode"],
        "eager_compiled_median_ms": medians["eager"] * 1e3,
        "ea_compiled_median_ms": medians["ea"] * 1e3,
        "ea_over_eager_compiled_time": medians["ea"] / medians["eager"],
        "eager_compiled_step_mib": memory["eager"],
        "ea_compiled_step_mib": memory["ea"],
        "ea_over_eager_compiled_step_memory": ratio(memory["ea"], memory["eager"]),
        "steps": timing["repeats"],
    }


def compiled_table(rows: list[dict]) -> str:
    """The compiled rows as Markdown (no final newline)."""
    cells = [
        [str(row["n"]), str(row["batch"]), row["mode"], number(row["eager_compiled_median_ms"], 1)]
        + [number(row["ea_compiled_median_ms"], 1), number(row["ea_over_eager_compiled_time"], 3)]
        + [number(row.get("eager_compiled_step_mib"), 0), number(row.get("ea_compiled_step_mib"), 0)]
        + [number(row.get("ea_over_eager_compiled_step_memory"), 3)]
        for row in rows
    ]
    return markdown_table(COMPILED_HEADER, "rrl" + "r" * 6, cells)


def merge_rounds(rounds: list[dict]) -> dict:
    """One case's figures over its rounds (fresh processes): every timed repetition pooled for the median and
    the minimum, the highest peak memory (and the lowest starting point)."""
    times = [t for r in rounds for t in r["times_s"]]
    peak = max(rounds, key=lambda r: r["peak_mib"])
    before = min(r["before_mib"] for r in rounds)
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "peak_mib": peak["peak_mib"],
        "before_mib": before,
        "increment_mib": peak["peak_mib"] - before,
    }


def compare(
    results: list[dict], paired: list[dict], lengths: list[int], batches: dict[int, int] | None = None
) -> list[dict]:
    """One row per (N, mode): time medians and ratios from the paired runs, peaks and memory ratios from the
    separate processes (rounds pooled; their time ratios are kept too, as ``*_separate``).

    A (N, mode) may have several paired runs, each a fresh process (one per round): the time ratio is then the
    median over the processes of each process's ratio of medians, and the ms columns the median of the
    processes' medians. A process as a whole runs some percent faster or slower than the next (the allocator's
    history decides where large maps come from, and so the page faults of each variant): one process's ratio is
    one sample of that, and the median of several is not at the mercy of one. Each process's ratio is kept too
    (``*_over_eager_time_per_process``)."""
    paired_by_key: dict[tuple, list[dict]] = {}
    for r in paired:
        paired_by_key.setdefault((r["n"], r["mode"]), []).append(r)
    by_key: dict[tuple, list[dict]] = {}
    for r in results:
        by_key.setdefault((r["variant"], r["n"], r["mode"]), []).append(r)
    cases = {key: merge_rounds(rounds) for key, rounds in by_key.items()}
    rows = []
    for length in lengths:
        for mode in MODES:
            row = {"n": length, "batch": (batches or {}).get(length), "mode": mode}
            row |= comparison_cells({v: cases[(v, length, mode)] for v in VARIANTS}, paired_by_key[(length, mode)])
            for metric, ratio_key in (("time", "ea_over_eager_time"), ("memory", "ea_over_eager_memory_increment")):
                row[f"ea_{metric}_target"] = TARGETS.get((metric, mode, length))
                row[f"ea_{metric}_pass"] = passes(row[ratio_key], row[f"ea_{metric}_target"])
            rows.append(row)
    return rows


def comparison_cells(cases: dict[str, dict], processes: list[dict]) -> dict:
    """One (N, mode)'s figures: each variant's (:func:`merge_rounds` of its separate processes, and the paired
    ``processes``) and the ratios of sdpa's and EA's to eager's."""
    times = {v: [t for p in processes for t in p["times_s"][v]] for v in VARIANTS}
    # Absent from runs before they were recorded.
    faults = {v: [f for p in processes for f in p.get("minor_faults", {}).get(v, [])] for v in VARIANTS}
    process_medians = [paired_medians(p) for p in processes]
    medians = {v: statistics.median(m[v] for m in process_medians) for v in VARIANTS}
    eager = cases["eager"]
    row: dict[str, Any] = {}
    for v in VARIANTS:
        row[f"{v}_median_ms"] = medians[v] * 1e3
        row[f"{v}_minor_faults_per_step_median"] = statistics.median(faults[v]) if faults[v] else None
        row[f"{v}_median_ms_separate"] = cases[v]["median_s"] * 1e3
        row[f"{v}_peak_mib"] = cases[v]["peak_mib"]
        row[f"{v}_increment_mib"] = cases[v]["increment_mib"]
    for v in ("sdpa", "ea"):
        per_process = [m[v] / m["eager"] for m in process_medians]
        row[f"{v}_over_eager_time"] = statistics.median(per_process)
        row[f"{v}_over_eager_time_per_process"] = per_process
        row[f"{v}_over_eager_time_min"] = min(times[v]) / min(times["eager"])
        # Each step against the eager step next to it, then the median of those ratios.
        row[f"{v}_over_eager_time_paired_median"] = statistics.median(
            a / b for p in processes for a, b in zip(p["times_s"][v], p["times_s"]["eager"], strict=True)
        )
        row[f"{v}_over_eager_time_separate"] = cases[v]["median_s"] / eager["median_s"]
        row[f"{v}_over_eager_peak_memory"] = cases[v]["peak_mib"] / eager["peak_mib"]
        row[f"{v}_over_eager_memory_increment"] = ratio(cases[v]["increment_mib"], eager["increment_mib"])
    return row


def comparison_table(rows: list[dict]) -> str:
    """The comparison rows (:func:`compare`) as Markdown."""
    cells = [
        [
            str(r["n"]),
            "-" if r.get("batch") is None else str(r["batch"]),
            r["mode"],
            f"{r['eager_median_ms']:.1f}",
            f"{r['sdpa_median_ms']:.1f}",
            f"{r['ea_median_ms']:.1f}",
            f"{r['ea_over_eager_time']:.3f}",
            " / ".join(f"{value:.3f}" for value in sorted(r.get("ea_over_eager_time_per_process", []))) or "-",
            target_cell(r["ea_time_target"], r["ea_time_pass"]),
            number(ratio(r["ea_median_ms"], r["sdpa_median_ms"]), 3),
            f"{r['ea_over_eager_time_separate']:.3f}",
            f"{r['eager_increment_mib']:.0f}",
            f"{r['ea_increment_mib']:.0f}",
            number(r["ea_over_eager_memory_increment"], 3),
            target_cell(r["ea_memory_target"], r["ea_memory_pass"]),
            f"{r['eager_peak_mib']:.0f}",
            f"{r['ea_peak_mib']:.0f}",
            f"{r['ea_over_eager_peak_memory']:.3f}",
        ]
        for r in rows
    ]
    return markdown_table(TABLE_HEADER, "rrl" + "r" * 15, cells) + "\n"


def plot(rows: list[dict], info: dict, path: Path) -> None:
    """Both ratios against eager, per (N, mode), with the targets, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [f"N={r['n']}, batch {r.get('batch') or '-'}\n{r['mode']}" for r in rows]
    memory_label = "step memory (peak above the loaded model)"
    figure, axes = plt.subplots(1, 2, figsize=(max(11.0, 2.4 * len(rows) + 3), 4.8))
    panels = (("time", "time", "median time / eager"), ("memory", "memory_increment", f"{memory_label} / eager"))
    for axis, (metric, key, ylabel) in zip(axes, panels, strict=True):
        plot_panel(axis, rows, metric, key)
        axis.set_xticks(list(range(len(rows))), groups)
        axis.set_ylabel(ylabel)
        axis.set_title(f"{metric} ratio against eager (lower is better)")
    figure.suptitle("BERT-Base: eager vs sdpa vs Evolving Attention", fontsize=10)
    figure.text(0.5, 0.005, machine_line(info), ha="center", fontsize=7, color="#555555")
    figure.tight_layout(rect=(0, 0.03, 1, 0.97))
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_panel(axis: Any, rows: list[dict], metric: str, key: str, width: float = 0.38) -> None:
    """One panel of :func:`plot`: sdpa's and EA's bars, EA's targets and the line of eager."""
    positions = list(range(len(rows)))
    for offset, variant, colour in ((-width / 2, "sdpa", "#7f9fbf"), (width / 2, "ea", "#d9822b")):
        values = [r[f"{variant}_over_eager_{key}"] or 0.0 for r in rows]
        label = f"{LABELS[variant]} / eager"
        bars = axis.bar([p + offset for p in positions], values, width, label=label, color=colour)
        axis.bar_label(bars, fmt="%.2f", fontsize=8, padding=2)
    target_label = "EA target (at most)"
    for p, r in zip(positions, rows, strict=True):
        target = r[f"ea_{metric}_target"]
        if target is not None:
            axis.hlines(target, p, p + width, colors="#b22222", linestyles="--", linewidth=1.8, label=target_label)
            target_label = None
    axis.axhline(1.0, color="black", linewidth=0.8)
    top = max(max(r[f"ea_over_eager_{key}"] or 0.0, r[f"sdpa_over_eager_{key}"] or 0.0) for r in rows)
    axis.set_ylim(0, max(top, 1.35) * 1.25)  # room for the one-row legend above the tallest bar's label
    axis.legend(loc="upper center", ncols=3, fontsize=8)


def run_rounds(args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """(the separate processes' cases, the paired processes' timings) of every (N, mode) and round. Each round:
    one paired process (its share of --paired-seconds), then each variant alone; rounds interleave, so that a slow
    spell of the machine hits all of them alike."""
    results, paired = [], []
    for length in args.lengths:
        for mode in MODES:
            for round_index in range(args.rounds):
                timing = spawn(["--paired", str(length), mode], args, f"paired timing N={length} {mode}", length)
                timing["round"] = round_index
                paired.append(timing)
                print(paired_line(timing, round_index, args.rounds), flush=True)
                for variant in VARIANTS:
                    result = spawn_case(variant, length, mode, args)
                    result["round"] = round_index
                    results.append(result)
                    print(case_line(result, round_index, args.rounds), flush=True)
    return results, paired


def paired_line(timing: dict, round_index: int, rounds: int) -> str:
    """The printed line of a paired process."""
    medians = paired_medians(timing)
    return (
        f"  paired N={timing['n']:<4} {timing['mode']:<9} round {round_index + 1}/{rounds} medians "
        + "  ".join(f"{LABELS[v]} {medians[v] * 1e3:.1f} ms" for v in VARIANTS)
        + f" (EA/eager {medians['ea'] / medians['eager']:.3f}); minor faults per step (median) "
        + "  ".join(f"{LABELS[v]} {statistics.median(timing['minor_faults'][v]):.0f}" for v in VARIANTS)
        + f"  [{timing['process_wall_s']:.0f} s]"
    )


def case_line(result: dict, round_index: int, rounds: int) -> str:
    """The printed line of a separate process's case."""
    return (
        f"  {LABELS[result['variant']]:<5} N={result['n']:<4} {result['mode']:<9} round {round_index + 1}/{rounds} "
        f"median {result['median_s'] * 1e3:8.1f} ms  "
        f"peak {result['peak_mib']:7.0f} MiB (before {result['before_mib']:.0f} MiB)  "
        f"cpu/wall {result['cpu_over_wall']:.2f}  other {result['other_processes_cpu_s']:.1f} s  "
        f"[{result['process_wall_s']:.0f} s]"
    )


def run_compiled_rows(args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """(the compiled rows, each compiled model's memory process) of every ``--compiled`` (N, mode)."""
    compiled, compiled_memory = [], []
    for length, mode in args.compiled:
        timing = spawn(["--compiled-timing", str(length), mode], args, f"compiled timing N={length} {mode}", length)
        memory = {
            v: spawn(["--compiled-memory", v, str(length), mode], args, f"compiled {v} memory N={length}", length)
            for v in COMPILED_VARIANTS
        }
        compiled.append(compiled_row(timing, memory))
        compiled_memory += memory.values()
        row = compiled[-1]
        print(
            f"  compiled N={length:<4} {mode:<9} EA/eager time {row['ea_over_eager_compiled_time']:.3f}  step memory "
            + "  ".join(
                f"{LABELS[v]} " + " / ".join(f"{m:.0f}" for m in memory[v]["step_memory_mib"]) + " MiB"
                for v in COMPILED_VARIANTS
            )
            + f" (EA/eager {row['ea_over_eager_compiled_step_memory']:.3f})  [{timing['process_wall_s']:.0f} s]",
            flush=True,
        )
    return compiled, compiled_memory


def report_settings(args: argparse.Namespace, batches: dict[int, int]) -> dict:
    """What the report says of how it was run."""
    return {
        "lengths": args.lengths,
        "modes": list(MODES),
        "variants": {
            "eager": 'BertModel(BertConfig()), attn_implementation="eager"',
            "sdpa": 'BertModel(BertConfig()), attn_implementation="sdpa"',
            "ea": f"ea_hf.patch(BertModel(BertConfig()), alpha={EA_ALPHA}, beta={EA_BETA}) "
            '(attn_implementation="evolving_attention", kernel 3)',
        },
        "batch": batches,
        "compiled": "eager and EA each through torch.compile (inductor, default options), paired like the "
        "table's times; warm-up steps (at least 2) include the compilation. Step memory: each compiled model "
        "alone in a fresh process, after its warm-up steps, the largest of 3 steps (see step_memory_mib; "
        "compiled_memory)",
        "threads": args.threads,
        "repeats": args.repeats,
        "rounds": args.rounds,
        "paired_seconds": args.paired_seconds,
        "warmup": args.warmup,
        "dtype": "float32",
        "dropout": args.dropout,
        "inputs": "random input_ids, all-ones attention_mask",
        "training_step": "model.train(); forward; loss = last_hidden_state.float().pow(2).mean(); backward "
        "(gradients set to None before every repetition, outside the timed region)",
        "timing": "time.perf_counter around one step (CUDA events on a GPU). The table's times and time ratios: the "
        "three models in one process, one step of each in turn (order rotating), at least repeats steps each after "
        "the warm-ups and more until the timed steps took paired_seconds / rounds; one such process per round; "
        "per process the medians and their ratio, and in the table the median over the processes (each "
        "process's ratio in *_over_eager_time_per_process). Also reported (*_separate): "
        "each variant alone in fresh processes, rounds interleaved, repetitions pooled. Each paired step's "
        "minor page faults (getrusage ru_minflt) are kept too (paired_timing[].minor_faults, and their median "
        "per step in the comparison rows)",
        "memory": "each case in a fresh subprocess; CPU: peak RSS (ru_maxrss) of that process, before = VmRSS "
        "after model creation; CUDA: torch.cuda.max_memory_allocated; the highest peak over the rounds",
        "quick": args.quick,
    }


def main_parent(args: argparse.Namespace) -> None:
    """The whole run: every case and paired process, the compiled rows; the JSON, Markdown and PNG written."""
    elapsed = stopwatch()
    info = machine_info(args.threads)
    batches = {length: batch_of(args, length) for length in args.lengths}
    info["batch"] = batches
    stem = f"bench_{info['device']}{'_quick' if args.quick else ''}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / f"{stem}.json", out / f"{stem}.png"
    markdown_path = Path(args.markdown) if args.markdown else out / f"{stem}.md"
    print(f"machine: {machine_line(info)}", flush=True)
    results, paired = run_rounds(args)
    rows = compare(results, paired, args.lengths, batches)
    table = comparison_table(rows)
    compiled, compiled_memory = run_compiled_rows(args)
    if compiled:
        table += "\nBoth compiled (torch.compile, inductor):\n\n" + compiled_table(compiled) + "\n"
    report = {
        "benchmark": "BERT-Base (BertConfig defaults, random weights, fp32): eager vs sdpa vs ea_hf Evolving Attention",
        "created": utc_now(),
        "machine": info,
        "machine_line": machine_line(info),
        "settings": report_settings(args, batches),
        "targets": [{"metric": m, "mode": mode, "n": n, "max_ea_over_eager": t} for (m, mode, n), t in TARGETS.items()],
        "cases": results,
        "paired_timing": paired,
        "comparison": rows,
        "compiled": compiled,
        "compiled_memory": compiled_memory,
        "markdown_table": table,
        "wall_time_s": elapsed(),
    }
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    markdown_path.parent.mkdir(parents=True, exist_ok=True)
    markdown_path.write_text(table)
    plot(rows, info, png_path)
    print()
    print(table)
    print(f"wall time {report['wall_time_s']:.0f} s; wrote {json_path}, {png_path}, {markdown_path}")


def build_parser() -> argparse.ArgumentParser:
    """The options of a whole run, and of the internal and quick modes (:func:`add_modes`)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--out", default=str(BENCH_DIR / "results"), help="output folder (default bench/results; a run to keep goes "
        "to bench/results/<machine>)")  # fmt: skip
    add("--lengths", type=int, nargs="+", default=[128, 512], help="sequence lengths N")
    add("--repeats", type=int, default=5, help="timed repetitions per process (default 5)")
    add("--rounds", type=int, default=3, help="fresh processes per case, interleaved across the variants (default 3)")
    add("--paired-seconds", type=float, default=300.0, help="paired timing: keep stepping until the timed steps of "
        "all variants took this long, in all: each of the rounds' processes takes its share (default 300; with "
        "fewer steps the host's noise moves a ratio more)")  # fmt: skip
    add("--warmup", type=int, default=2, help="untimed warm-up runs per case")
    add("--batches", type=int, nargs="+", help="batch size per length in --lengths, or one for all (default: 8 at "
        "N=128, 2 at N=512, else 1)")  # fmt: skip
    add("--compiled", nargs=2, action="append", metavar=("N", "MODE"), help="also time compiled eager against "
        "compiled EA (and their step memory) at this length and mode; repeat for more rows (default: 128 training "
        "and 512 training)")  # fmt: skip
    add("--no-compiled", dest="compiled", action="store_const", const=[], help="skip them")
    add("--threads", type=int, default=2, help="torch.set_num_threads in every case")
    add("--dropout", type=float, default=0.0, help="attention and hidden dropout of the BERT models (default 0, "
        "which the targets are measured at; BERT fine-tuning's own default is 0.1, what users pay with "
        "it)")  # fmt: skip
    add("--quick", action="store_true", help="smoke test: N=64, 2 repeats, 1 warm-up")
    add("--markdown", metavar="PATH", help="also write the Markdown table here (default: in --out)")
    add_modes(parser)
    return parser


def add_modes(parser: argparse.ArgumentParser) -> None:
    """The internal modes (a child's work) and the quick ones that print one result line."""
    add = parser.add_argument
    add("--case", nargs=3, metavar=("VARIANT", "N", "MODE"), help="internal: run one case and print it as JSON")
    add("--paired", nargs=2, metavar=("N", "MODE"), help="internal: run the paired timing")
    add("--compiled-timing", nargs=2, metavar=("N", "MODE"), help="internal: run the compiled paired timing")
    add("--compiled-memory", nargs=3, metavar=("VARIANT", "N", "MODE"), help="internal: measure the step memory "
        "of one compiled model")  # fmt: skip
    add("--batch", type=int, default=1, help="internal: the batch size of a child process")
    add("--profile", nargs=2, metavar=("N", "MODE"), help="print where eager's and EA's steps spend their time, "
        "per operator (torch profiler), as JSON; --repeats steps each after --warmup")  # fmt: skip
    add("--kernel", type=int, metavar="N", help="print the fused CPU kernel's forward and backward milliseconds "
        "alone at N (--batch, --repeats calls) and the host's memory bandwidth, as JSON")  # fmt: skip
    add("--kernel-build", action="append", default=[], metavar="FLAGS", help="with --kernel: also time the kernel "
        "built with these compiler flags added (repeatable; several flags in one string, separated by spaces), its "
        "calls alternating with the default build's; the flags start with a dash, so give them after '=': "
        "--kernel-build=-DEA_HF_PREFETCH_LOCALITY=3")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options, checked; ``--quick`` replaces the lengths, repeats, warm-ups and rounds."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.repeats, args.warmup, args.rounds, args.paired_seconds = [64], 2, 1, 1, 0.0
        args.compiled = []
    if args.case:
        variant, length, mode = args.case
        if variant not in VARIANTS or mode not in MODES:
            parser.error(f"--case expects VARIANT in {VARIANTS} and MODE in {MODES}")
        args.case = (variant, int(length), mode)
    if args.compiled_memory and (
        args.compiled_memory[0] not in COMPILED_VARIANTS or args.compiled_memory[2] not in MODES
    ):
        parser.error(f"--compiled-memory expects VARIANT in {COMPILED_VARIANTS} and MODE in {MODES}")
    if args.profile and args.profile[1] not in MODES:
        parser.error(f"--profile expects N and MODE in {MODES}")
    if args.compiled is None:
        args.compiled = DEFAULT_COMPILED
    if any(mode not in MODES for _, mode in args.compiled):
        parser.error(f"--compiled expects N and MODE in {MODES}")
    args.compiled = [(int(length), mode) for length, mode in args.compiled]
    if args.batches and len(args.batches) not in (1, len(args.lengths)):
        parser.error("--batches takes one batch size per length in --lengths, or one for all")
    if not 0.0 <= args.dropout < 1.0:
        parser.error("--dropout is a probability in [0, 1)")
    if min(args.repeats, args.rounds, args.batch, args.threads, *(args.batches or [1])) < 1 or args.warmup < 0:
        parser.error("--repeats, --rounds, --batch and --threads must be positive, --warmup non-negative")
    return args


def internal_result(args: argparse.Namespace) -> dict | None:
    """The result of an internal or quick mode, None for a whole run."""
    if args.case:
        variant, length, mode = args.case
        return run_case(variant, length, mode, args.repeats, args.warmup, args.batch, args.threads, args.dropout)
    if args.paired or args.compiled_timing:
        compiled = bool(args.compiled_timing)
        length, mode = int((args.compiled_timing or args.paired)[0]), (args.compiled_timing or args.paired)[1]
        # A paired process of one of the rounds gets its share of the seconds; the compiled timing, half of them.
        seconds = args.paired_seconds / (2 if compiled else args.rounds)
        settings = (args.repeats, args.warmup, args.batch, args.threads, seconds, compiled, args.dropout)
        return run_paired(length, mode, *settings)
    if args.profile:
        length, mode = int(args.profile[0]), args.profile[1]
        return run_profile(length, mode, args.warmup, args.repeats, args.batch, args.threads, args.dropout)
    if args.kernel:
        kernel = run_kernel(args.kernel, args.batch, args.repeats, args.threads, builds=args.kernel_build)
        return {**kernel, **memory_bandwidth(args.threads)}
    if args.compiled_memory:
        variant, length, mode = args.compiled_memory
        return run_compiled_memory(variant, int(length), mode, args.warmup, args.batch, args.threads, args.dropout)
    return None


def main(argv: list[str] | None = None) -> None:
    """A whole run by default; an internal or quick mode prints its result line."""
    args = parse_args(argv)
    result = internal_result(args)
    if result is None:
        main_parent(args)
    else:
        print_result(result)


if __name__ == "__main__":
    main()

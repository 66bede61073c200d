"""Side-by-side benchmark: BERT-Base with eager attention, with sdpa, and with Evolving Attention (ea_hf).

Every (variant, N, mode) case runs in a fresh subprocess of this script (``--case VARIANT N MODE``), which
builds the model, times the case and reports its own peak memory as one JSON line on stdout; the parent
collects the cases, computes the ratios against eager, writes a JSON file, a PNG plot and a Markdown table.

    python bench/bench_attention.py                     # full run: N in {128, 512}, 5 repeats, 2 warm-ups
    python bench/bench_attention.py --quick             # smoke test: N = 64, 2 repeats, 1 warm-up

See bench/README.md for what each figure means.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import datetime
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
VARIANTS = ("eager", "sdpa", "ea")
#: The variants of the compiled row: eager attention and EA, both through torch.compile.
COMPILED_VARIANTS = ("eager", "ea")
MODES = ("inference", "training")
LABELS = {"eager": "eager", "sdpa": "sdpa", "ea": "EA"}
EA_ALPHA = 0.2
EA_BETA = 0.2
#: Line prefix of a child's result on stdout (anything else a library prints there is ignored).
RESULT_PREFIX = "BENCH_RESULT "
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
MIB = 1024.0 * 1024.0
#: Steps whose memory the compiled row measures per variant (the largest is reported, as for the table).
MEMORY_STEPS = 3
#: The fewest warm-up steps of a compiled model: they compile its forward (and backward), and none is timed.
COMPILED_WARMUP = 2


# --------------------------------------------------------------------------------------------------------------
# Child: one (variant, N, mode) case in its own process.
# --------------------------------------------------------------------------------------------------------------


def status_mib(field: str) -> float:
    """A memory field of this process's /proc/self/status (``VmRSS``, ``VmHWM``: kB there), in MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def current_rss_mib() -> float:
    """Resident set size of this process now (VmRSS), in MiB."""
    return status_mib("VmRSS")


def system_cpu_seconds() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine since boot, from the first line of /proc/stat."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return float("nan"), float("nan")
    fields += [0] * (8 - len(fields))
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    hertz = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / hertz, steal / hertz


def minor_faults() -> int:
    """Minor page faults of this process so far: first touches of memory the allocator got fresh from the
    kernel. On this kind of VM each costs microseconds, and how many a step takes depends on the heap's state
    (glibc returns freed memory at the top of its heap to the kernel), so they are reported beside the times."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (VmHWM, and with it ru_maxrss) to its current RSS; False if not possible
    (Linux >= 4.0: writing 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def step_memory_mib(step, device) -> float:
    """What one call of ``step`` adds to memory at its peak, in MiB, measured in a process that has run steps
    before (the compiled row, whose warm-up steps compile the model). On CPU: the peak RSS during the step
    (VmHWM, reset through ``/proc/self/clear_refs``) above the RSS before it, after glibc has returned its free
    heap to the kernel (``malloc_trim``), so that memory freed by earlier steps does not hide what this one
    takes. On CUDA: ``max_memory_allocated`` above ``memory_allocated`` (untested: no GPU here)."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / MIB
    ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    if not reset_peak_rss():
        raise RuntimeError("step memory needs a resettable peak RSS (Linux /proc/self/clear_refs)")
    before = current_rss_mib()
    step()
    return status_mib("VmHWM") - before


def build_model(variant: str, device, dropout: float = 0.0):
    """BERT-Base (transformers.BertConfig defaults) with random weights, fp32, its attention and hidden dropout
    ``dropout`` (off by default: train and eval then compute the same thing; BERT's own default is 0.1)."""
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)  # same BERT weights for every variant
    config = BertConfig(hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    model = BertModel(config)
    model.set_attn_implementation("sdpa" if variant == "sdpa" else "eager")
    if variant == "ea":
        import ea_hf

        model = ea_hf.patch(model, alpha=EA_ALPHA, beta=EA_BETA)
    return model.to(device=device, dtype=torch.float32)


def run_case(
    variant: str, length: int, mode: str, repeats: int, warmup: int, batch: int, threads: int, dropout: float = 0.0
) -> dict:
    import torch

    try:  # import in every variant so that all children carry the same libraries
        import ea_hf  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(REPO_ROOT))
        import ea_hf  # noqa: F401

    torch.set_num_threads(threads)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")

    model = build_model(variant, device, dropout)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=generator).to(device)
    attention_mask = torch.ones(batch, length, dtype=torch.long, device=device)

    # What the attention function of layer 0 is actually given as its mask (an all-ones mask may be dropped).
    seen_masks: list[str] = []

    def record_mask(module, args, kwargs):
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        seen_masks.append("none" if mask is None else f"{mask.dtype} {tuple(mask.shape)}")

    hook = model.encoder.layer[0].attention.self.register_forward_pre_hook(record_mask, with_kwargs=True)

    if mode == "inference":
        model.eval()
    else:
        model.train()  # with --dropout 0 (the default) train and eval compute the same thing

    def step() -> None:
        if mode == "inference":
            with torch.no_grad():
                model(input_ids=input_ids, attention_mask=attention_mask)
        else:
            output = model(input_ids=input_ids, attention_mask=attention_mask)
            loss = output.last_hidden_state.float().pow(2).mean()
            loss.backward()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    # Memory before the case: the model and inputs exist, nothing has run yet.
    sync()
    if cuda:
        # GPU path: kept simple and NOT tested here (the benchmark machine has no GPU).
        torch.cuda.reset_peak_memory_stats()
        before_mib = torch.cuda.memory_allocated() / MIB
        peak_before_mib = before_mib
    else:
        before_mib = current_rss_mib()
        peak_before_mib = peak_rss_mib()

    load_before = os.getloadavg()
    busy_before, steal_before = system_cpu_seconds()
    own_before = time.process_time()
    times, cpu_times = [], []
    for index in range(warmup + repeats):
        model.zero_grad(set_to_none=True)
        sync()
        cpu_start = time.process_time()
        start = time.perf_counter()
        step()
        sync()
        elapsed = time.perf_counter() - start
        cpu_elapsed = time.process_time() - cpu_start
        if index == 0:
            hook.remove()
        if index >= warmup:
            times.append(elapsed)
            cpu_times.append(cpu_elapsed)
    load_after = os.getloadavg()
    busy_after, steal_after = system_cpu_seconds()
    own_cpu = time.process_time() - own_before

    if cuda:
        peak_mib = torch.cuda.max_memory_allocated() / MIB
        memory_source = "torch.cuda.max_memory_allocated (peak of the case; before = memory_allocated after setup)"
    else:
        peak_mib = peak_rss_mib()
        memory_source = "ru_maxrss of a fresh process (before = VmRSS after model creation)"
    from ea_hf.ops import cpu as kernels

    return {
        "variant": variant,
        # What computed the evolution: ea_hf's fused CPU kernel or torch operations (GPU, no C++ compiler).
        "evolution_path": (
            None
            if variant != "ea"
            else "ea_hf CPU kernel"
            if device.type == "cpu" and kernels.cpu_kernel() is not None
            else "torch operations"
        ),
        "n": length,
        "mode": mode,
        "dropout": dropout,
        "batch": batch,
        "threads": threads,
        "device": device.type,
        "attn_implementation": model.config._attn_implementation,
        "attention_mask_seen_by_attention": seen_masks[0] if seen_masks else "not recorded",
        "parameters": sum(p.numel() for p in model.parameters()),
        "warmup": warmup,
        "repeats": repeats,
        "times_s": times,
        "median_s": statistics.median(times),
        "min_s": min(times),
        "mean_s": statistics.fmean(times),
        "stdev_s": statistics.stdev(times) if len(times) > 1 else 0.0,
        # CPU seconds of this process per timed repetition; cpu/wall well below `threads` means it was starved.
        "cpu_times_s": cpu_times,
        "cpu_over_wall": statistics.fmean(c / t for c, t in zip(cpu_times, times, strict=True)),
        "loadavg_1min_before_after": [load_before[0], load_after[0]],
        # Machine-wide CPU seconds used by everything except this process during warm-ups + repetitions, and
        # hypervisor steal: both near 0 when the case had the machine to itself (/proc/stat, 10 ms resolution).
        "other_processes_cpu_s": max(0.0, (busy_after - busy_before) - own_cpu),
        "steal_s": steal_after - steal_before,
        "memory_source": memory_source,
        "before_mib": before_mib,
        "peak_before_case_mib": peak_before_mib,
        "peak_mib": peak_mib,
        "increment_mib": peak_mib - before_mib,
        "case_raised_peak": peak_mib > peak_before_mib,
    }


def prepared_models(
    variants: tuple[str, ...], length: int, mode: str, batch: int, threads: int, compiled: bool, dropout: float = 0.0
):
    """The models of ``variants`` (each through ``torch.compile`` if ``compiled``) in train or eval mode, and
    ``step(model) -> (seconds, minor page faults)``: one inference or training step of a model on the shared
    random batch, gradients set to ``None`` first (outside the timed region)."""
    import torch

    torch.set_num_threads(threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    models = {v: build_model(v, device, dropout) for v in variants}
    vocab_size = next(iter(models.values())).config.vocab_size
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab_size, (batch, length), generator=generator).to(device)
    attention_mask = torch.ones(batch, length, dtype=torch.long, device=device)
    for model in models.values():
        model.train(mode == "training")
    if compiled:
        models = {v: torch.compile(model) for v, model in models.items()}

    def step(model) -> tuple[float, int]:
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        faults = minor_faults()
        start = time.perf_counter()
        if mode == "inference":
            with torch.no_grad():
                model(input_ids=input_ids, attention_mask=attention_mask)
        else:
            model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state.float().pow(2).mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, minor_faults() - faults

    return models, step, device


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
    models, step, _ = prepared_models(variants, length, mode, batch, threads, compiled, dropout)
    if compiled:
        warmup = max(warmup, COMPILED_WARMUP)
    times: dict[str, list[float]] = {v: [] for v in variants}
    faults: dict[str, list[int]] = {v: [] for v in variants}
    index = 0
    while index < warmup + repeats or sum(map(sum, times.values())) < min_seconds:
        order = variants[index % len(variants) :] + variants[: index % len(variants)]
        for variant in order:
            elapsed, step_faults = step(models[variant])
            if index >= warmup:
                times[variant].append(elapsed)
                faults[variant].append(step_faults)
        index += 1
    return {
        "n": length,
        "mode": mode,
        "dropout": dropout,
        "batch": batch,
        "compiled": compiled,
        "repeats": index - warmup,
        "min_seconds": min_seconds,
        "warmup": warmup,
        "times_s": times,
        "minor_faults": faults,
    }


#: The variants a profile compares (``--profile``), and how many of its operators it reports per variant.
PROFILED_VARIANTS = ("eager", "ea")
PROFILE_ROWS = 25


def operator_times(step) -> dict[str, tuple[float, int]]:
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
    models, step, _ = prepared_models(PROFILED_VARIANTS, length, mode, batch, threads, False, dropout)
    for _ in range(warmup):
        for model in models.values():
            step(model)
    samples: dict[str, list] = {variant: [] for variant in models}
    # Each profiled step's seconds and minor page faults: a step whose maps land on fresh pages spends its first
    # touches in whichever operator writes them first (see "minor page faults" in bench/README.md).
    measured: dict[str, list] = {variant: [] for variant in models}
    for _ in range(repeats):
        for variant, model in models.items():
            samples[variant].append(
                operator_times(lambda model=model, variant=variant: measured[variant].append(step(model)))
            )
    return {
        "n": length,
        "mode": mode,
        "dropout": dropout,
        "batch": batch,
        "steps": repeats,
        "profile": {variant: profile_rows(samples[variant]) for variant in models},
        "times_s": {variant: [seconds for seconds, _ in steps] for variant, steps in measured.items()},
        "minor_faults": {variant: [faults for _, faults in steps] for variant, steps in measured.items()},
    }


#: Independent sets of maps the kernel timing cycles through, so that each call finds its maps out of cache (as
#: in a training step, where a layer's maps were written a whole layer earlier): 4 sets of 4 maps of 24 MiB at
#: N = 512, batch 2, several times any last-level cache of the hosts measured.
KERNEL_MAP_SETS = 4


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

    from ea_hf.modeling.step import EvolutionStep, GradientIn, StepMaps
    from ea_hf.ops import cpu

    torch.set_num_threads(threads)
    step = EvolutionStep(EA_ALPHA, EA_BETA, context_rows=1)
    if not cpu.kernel_available():
        raise RuntimeError("no C++ compiler: the fused CPU kernel cannot be built on this machine")
    generator = torch.Generator().manual_seed(0)
    shape = (batch, heads, length, length)
    weight = torch.randn(heads, heads, 3, 3, generator=generator) * (EA_BETA / (3 * heads))
    bias = torch.zeros(heads)
    sets = [
        {name: torch.randn(shape, generator=generator) for name in ("scores", "previous", "grad", "addend")}
        for _ in range(KERNEL_MAP_SETS)
    ]
    libraries = {"": cpu.cpu_kernel(), **{flags: cpu.build_library(*flags.split()) for flags in builds}}
    times = {flags: {"forward": [], "backward": []} for flags in libraries}
    call = 0
    for repeat in range(repeats + 1):
        for flags, library in libraries.items():
            maps = sets[call % KERNEL_MAP_SETS]
            call += 1
            with cpu.using_library(library):
                inputs = StepMaps(maps["scores"], maps["previous"], None)
                incoming = GradientIn(maps["grad"], maps["addend"], spent=True)  # written over the incoming one
                start = time.perf_counter()
                _, gate = cpu.evolve(step, inputs, weight, bias, in_place=True, gate=True)
                forward = time.perf_counter() - start
                start = time.perf_counter()
                cpu.backward(step, inputs, incoming, gate, weight, shared_map=True)
                backward = time.perf_counter() - start
            if repeat:  # (the first round warms up)
                times[flags]["forward"].append(forward)
                times[flags]["backward"].append(backward)
    medians = {
        flags: {f"{pass_}_ms": 1e3 * statistics.median(seconds) for pass_, seconds in passes.items()}
        for flags, passes in times.items()
    }
    result = {"n": length, "batch": batch, "heads": heads, "calls": repeats, **medians.pop("")}
    return {**result, "builds": medians} if builds else result


def memory_bandwidth(threads: int, mib: int = 256, repeats: int = 5) -> dict:
    """This host's memory bandwidth with ``threads`` threads (GB/s, the best of ``repeats``): a copy between two
    arrays of ``mib`` MiB (bytes read plus written) and a sum of one (read). The kernel streams its maps; the
    matmuls around it mostly do not."""
    import torch

    torch.set_num_threads(threads)
    source = torch.ones(mib * 262144)
    target = torch.empty_like(source)
    passes = {"copy": (lambda: target.copy_(source), 2 * source.nbytes), "read": (source.sum, source.nbytes)}
    result = {}
    for name, (run, nbytes) in passes.items():
        run()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - start)
        result[f"{name}_gb_s"] = nbytes / best / 1e9
    return result


def run_compiled_memory(
    variant: str, length: int, mode: str, warmup: int, batch: int, threads: int, dropout: float = 0.0
) -> dict:
    """The step memory of one compiled model alone in a fresh process (the compiled row's memory columns):
    at least two warm-up steps (the compilation), then :data:`MEMORY_STEPS` steps measured by
    :func:`step_memory_mib`. Alone, because the heap a second compiled model leaves behind moves what a step
    takes from the kernel (1.05x against 1.34x EA/eager at N = 512 for the same code, alone and together)."""
    models, step, device = prepared_models((variant,), length, mode, batch, threads, True, dropout)
    model = models[variant]
    for _ in range(max(warmup, COMPILED_WARMUP)):
        step(model)
    memory = []
    for _ in range(MEMORY_STEPS):
        model.zero_grad(set_to_none=True)  # the last step's gradients belong to no step
        memory.append(step_memory_mib(lambda: step(model), device))
    return {"variant": variant, "n": length, "mode": mode, "batch": batch, "step_memory_mib": memory}


# --------------------------------------------------------------------------------------------------------------
# Parent: spawn the cases, collect, compare, write.
# --------------------------------------------------------------------------------------------------------------


def spawn_case(variant: str, length: int, mode: str, args: argparse.Namespace) -> dict:
    return spawn(["--case", variant, str(length), mode], args, f"case {variant} N={length} {mode}", length)


def spawn(internal: list[str], args: argparse.Namespace, what: str, length: int) -> dict:
    """Run this script with an internal mode (--case or --paired) in a fresh process; return its JSON."""
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        *internal,
        "--rounds",
        str(args.rounds),
        "--paired-seconds",
        str(args.paired_seconds),
        "--repeats",
        str(args.repeats),
        "--warmup",
        str(args.warmup),
        "--batch",
        str(batch_of(args, length)),
        "--threads",
        str(args.threads),
        "--dropout",
        str(args.dropout),
    ]
    return run_result_process(command, args.threads, what)


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
    header = ["N", "batch", "mode", "compiled eager ms", "compiled EA ms", "EA/eager time, both compiled"]
    header += ["compiled eager step MiB", "compiled EA step MiB", "EA/eager step memory, both compiled"]
    lines = [table_row(header), "|" + "|".join(["---:"] * 2 + ["---"] + ["---:"] * 6) + "|"]
    for row in rows:
        cells = [str(row["n"]), str(row["batch"]), row["mode"], number(row["eager_compiled_median_ms"], 1)]
        cells += [number(row["ea_compiled_median_ms"], 1), number(row["ea_over_eager_compiled_time"], 3)]
        cells += [number(row.get("eager_compiled_step_mib"), 0), number(row.get("ea_compiled_step_mib"), 0)]
        cells += [number(row.get("ea_over_eager_compiled_step_memory"), 3)]
        lines.append(table_row(cells))
    return "\n".join(lines)


def run_result_process(command: list[str], threads: int, what: str) -> dict:
    """Run ``command`` (a benchmark script in an internal mode) with ``threads`` OpenMP/MKL threads; return the
    JSON of its last result line, with the process's wall time added."""
    env = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[name] = str(threads)
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    wall = time.perf_counter() - start
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise RuntimeError(f"{what} failed (exit code {done.returncode})")
    result = json.loads(lines[-1][len(RESULT_PREFIX) :])
    result["process_wall_s"] = wall
    return result


def machine_info(threads: int) -> dict:
    import torch
    import transformers

    processor = platform.processor()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            names = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
        if names:
            processor = names[0]
    except OSError:
        pass
    cuda = torch.cuda.is_available()
    return {
        "platform": platform.platform(),
        "processor": processor,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpus_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
        # The C library's allocator decides how many fresh pages a step touches (see "minor page faults").
        "libc": " ".join(platform.libc_ver()),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": threads,
        "device": "cuda" if cuda else "cpu",
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
    }


def machine_line(info: dict) -> str:
    device = info["gpu"] if info["device"] == "cuda" else f"{info['device']}, {info['threads']} threads"
    return (
        f"{info['processor'] or info['machine']} ({info['cpu_count']} CPUs), {info['platform']}, "
        f"Python {info['python']}, torch {info['torch']}, transformers {info['transformers']}, {device}"
    )


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
    by_key = {key: merge_rounds(rounds) for key, rounds in by_key.items()}
    rows = []
    for length in lengths:
        for mode in MODES:
            cases = {v: by_key[(v, length, mode)] for v in VARIANTS}
            processes = paired_by_key[(length, mode)]
            times = {v: [t for p in processes for t in p["times_s"][v]] for v in VARIANTS}
            # Absent from runs before they were recorded.
            faults = {v: [f for p in processes for f in p.get("minor_faults", {}).get(v, [])] for v in VARIANTS}
            process_medians = [paired_medians(p) for p in processes]
            medians = {v: statistics.median(m[v] for m in process_medians) for v in VARIANTS}
            eager = cases["eager"]
            row = {"n": length, "batch": (batches or {}).get(length), "mode": mode}
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
                row[f"{v}_over_eager_memory_increment"] = (
                    cases[v]["increment_mib"] / eager["increment_mib"] if eager["increment_mib"] > 0 else None
                )
            for metric, ratio_key in (("time", "ea_over_eager_time"), ("memory", "ea_over_eager_memory_increment")):
                target = TARGETS.get((metric, mode, length))
                row[f"ea_{metric}_target"] = target
                value = row[ratio_key]
                row[f"ea_{metric}_pass"] = None if target is None or value is None else value <= target
            rows.append(row)
    return rows


def number(value: float | None, digits: int) -> str:
    """A table cell: the value with ``digits`` decimals, or "-"."""
    return "-" if value is None else f"{value:.{digits}f}"


def table_row(cells: list[str]) -> str:
    """One row of a Markdown table."""
    return "| " + " | ".join(cells) + " |"


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, None where either is missing or the denominator is not positive."""
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def target_cell(target: float | None, passed: bool | None) -> str:
    if target is None:
        return "-"
    return f"<= {target:g} {'pass' if passed else 'FAIL'}"


def markdown_table(rows: list[dict]) -> str:
    header = [
        "N",
        "batch",
        "mode",
        "eager ms",
        "sdpa ms",
        "EA ms",
        "EA/eager time",
        "EA/eager time, each process",
        "time target",
        "EA/sdpa time",
        "EA/eager time, separate processes",
        "eager step MiB",
        "EA step MiB",
        "EA/eager step memory",
        "memory target",
        "eager peak MiB",
        "EA peak MiB",
        "EA/eager total RSS",
    ]
    lines = [table_row(header), "|" + "|".join(["---:"] * 2 + ["---"] + ["---:"] * 15) + "|"]
    for r in rows:
        cells = [
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
        lines.append(table_row(cells))
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], info: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [f"N={r['n']}, batch {r.get('batch') or '-'}\n{r['mode']}" for r in rows]
    positions = list(range(len(rows)))
    width = 0.38
    memory_label = "step memory (peak above the loaded model)"
    figure, axes = plt.subplots(1, 2, figsize=(max(11.0, 2.4 * len(rows) + 3), 4.8))
    panels = (("time", "time", "median time / eager"), ("memory", "memory_increment", f"{memory_label} / eager"))
    for axis, (metric, key, ylabel) in zip(axes, panels, strict=True):
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
        axis.set_xticks(positions, groups)
        axis.set_ylabel(ylabel)
        axis.set_title(f"{metric} ratio against eager (lower is better)")
        top = max(max(r[f"ea_over_eager_{key}"] or 0.0, r[f"sdpa_over_eager_{key}"] or 0.0) for r in rows)
        axis.set_ylim(0, max(top, 1.35) * 1.25)  # room for the one-row legend above the tallest bar's label
        axis.legend(loc="upper center", ncols=3, fontsize=8)
    figure.suptitle("BERT-Base: eager vs sdpa vs Evolving Attention", fontsize=10)
    figure.text(0.5, 0.005, machine_line(info), ha="center", fontsize=7, color="#555555")
    figure.tight_layout(rect=(0, 0.03, 1, 0.97))
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main_parent(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    info = machine_info(args.threads)
    batches = {length: batch_of(args, length) for length in args.lengths}
    info["batch"] = batches
    device = info["device"]
    suffix = "_quick" if args.quick else ""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / f"bench_{device}{suffix}.json"
    png_path = out / f"bench_{device}{suffix}.png"
    markdown_path = Path(args.markdown) if args.markdown else out / f"bench_{device}{suffix}.md"
    print(f"machine: {machine_line(info)}", flush=True)

    results, paired = [], []
    for length in args.lengths:
        for mode in MODES:
            # Each round: one paired process (its share of --paired-seconds), then each variant alone; rounds
            # interleave, so that a slow spell of the machine hits all of them alike.
            for round_index in range(args.rounds):
                timing = spawn(["--paired", str(length), mode], args, f"paired timing N={length} {mode}", length)
                timing["round"] = round_index
                paired.append(timing)
                medians = paired_medians(timing)
                print(
                    f"  paired N={length:<4} {mode:<9} round {round_index + 1}/{args.rounds} medians "
                    + "  ".join(f"{LABELS[v]} {medians[v] * 1e3:.1f} ms" for v in VARIANTS)
                    + f" (EA/eager {medians['ea'] / medians['eager']:.3f}); minor faults per step (median) "
                    + "  ".join(f"{LABELS[v]} {statistics.median(timing['minor_faults'][v]):.0f}" for v in VARIANTS)
                    + f"  [{timing['process_wall_s']:.0f} s]",
                    flush=True,
                )
                for variant in VARIANTS:
                    result = spawn_case(variant, length, mode, args)
                    result["round"] = round_index
                    results.append(result)
                    print(
                        f"  {LABELS[variant]:<5} N={length:<4} {mode:<9} round {round_index + 1}/{args.rounds} "
                        f"median {result['median_s'] * 1e3:8.1f} ms  "
                        f"peak {result['peak_mib']:7.0f} MiB (before {result['before_mib']:.0f} MiB)  "
                        f"cpu/wall {result['cpu_over_wall']:.2f}  other {result['other_processes_cpu_s']:.1f} s  "
                        f"[{result['process_wall_s']:.0f} s]",
                        flush=True,
                    )
    rows = compare(results, paired, args.lengths, batches)
    table = markdown_table(rows)
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
    if compiled:
        table += "\nBoth compiled (torch.compile, inductor):\n\n" + compiled_table(compiled) + "\n"
    wall = time.perf_counter() - start
    report = {
        "benchmark": "BERT-Base (BertConfig defaults, random weights, fp32): eager vs sdpa vs ea_hf Evolving Attention",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": info,
        "machine_line": machine_line(info),
        "settings": {
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
            "timing": "time.perf_counter around one step. The table's times and time ratios: the three models in "
            "one process, one step of each in turn (order rotating), at least repeats steps each after the "
            "warm-ups and more until the timed steps took paired_seconds / rounds; one such process per round; "
            "per process the medians and their ratio, and in the table the median over the processes (each "
            "process's ratio in *_over_eager_time_per_process). Also reported (*_separate): "
            "each variant alone in fresh processes, rounds interleaved, repetitions pooled. Each paired step's "
            "minor page faults (getrusage ru_minflt) are kept too (paired_timing[].minor_faults, and their median "
            "per step in the comparison rows)",
            "memory": "each case in a fresh subprocess; CPU: peak RSS (ru_maxrss) of that process, before = VmRSS "
            "after model creation; CUDA: torch.cuda.max_memory_allocated; the highest peak over the rounds",
            "quick": args.quick,
        },
        "targets": [{"metric": m, "mode": mode, "n": n, "max_ea_over_eager": t} for (m, mode, n), t in TARGETS.items()],
        "cases": results,
        "paired_timing": paired,
        "comparison": rows,
        "compiled": compiled,
        "compiled_memory": compiled_memory,
        "markdown_table": table,
        "wall_time_s": wall,
    }
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    markdown_path.parent.mkdir(parents=True, exist_ok=True)
    markdown_path.write_text(table)
    plot(rows, info, png_path)
    print()
    print(table)
    print(f"wall time {wall:.0f} s; wrote {json_path}, {png_path}, {markdown_path}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        default=str(BENCH_DIR / "results"),
        help="output folder (default bench/results; a run to keep goes to bench/results/<machine>)",
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512], help="sequence lengths N")
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions per process (default 5)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="fresh processes per case, interleaved across the variants (default 3)"
    )
    parser.add_argument(
        "--paired-seconds",
        type=float,
        default=300.0,
        help="paired timing: keep stepping until the timed steps of all variants took this long, in all: each of "
        "the rounds' processes takes its share (default 300: about 30 steps of each at the training sizes, 10 a "
        "process; with fewer, the host's noise moves a ratio by 1 to 2 %%)",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed warm-up runs per case")
    parser.add_argument(
        "--batches",
        type=int,
        nargs="+",
        help="batch size per length in --lengths, or one for all (default: 8 at N=128, 2 at N=512, else 1)",
    )
    parser.add_argument(
        "--compiled",
        nargs=2,
        action="append",
        metavar=("N", "MODE"),
        help="also time compiled eager against compiled EA (and their step memory) at this length and mode; "
        "repeat for more rows (default: 128 training and 512 training)",
    )
    parser.add_argument(
        "--compiled-timing", nargs=2, metavar=("N", "MODE"), help="internal: run the compiled paired timing"
    )
    parser.add_argument(
        "--compiled-memory",
        nargs=3,
        metavar=("VARIANT", "N", "MODE"),
        help="internal: measure the step memory of one compiled model",
    )
    parser.add_argument("--no-compiled", dest="compiled", action="store_const", const=[], help="skip them")
    parser.add_argument("--batch", type=int, default=1, help="internal: the batch size of a child process")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads in every case")
    parser.add_argument(
        "--dropout",
        type=float,
        default=0.0,
        help="attention and hidden dropout of the BERT models (default 0, which the targets are measured at; BERT "
        "fine-tuning's own default is 0.1, what users pay with it)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke test: N=64, 2 repeats, 1 warm-up")
    parser.add_argument("--markdown", metavar="PATH", help="also write the Markdown table here (default: in --out)")
    parser.add_argument(
        "--case", nargs=3, metavar=("VARIANT", "N", "MODE"), help="internal: run one case and print it as JSON"
    )
    parser.add_argument("--paired", nargs=2, metavar=("N", "MODE"), help="internal: run the paired timing")
    parser.add_argument(
        "--profile",
        nargs=2,
        metavar=("N", "MODE"),
        help="print where eager's and EA's steps spend their time, per operator (torch profiler), as JSON; "
        "--repeats steps each after --warmup",
    )
    parser.add_argument(
        "--kernel",
        type=int,
        metavar="N",
        help="print the fused CPU kernel's forward and backward milliseconds alone at N (--batch, --repeats "
        "calls) and the host's memory bandwidth, as JSON",
    )
    parser.add_argument(
        "--kernel-build",
        action="append",
        default=[],
        metavar="FLAGS",
        help="with --kernel: also time the kernel built with these compiler flags added (repeatable; several flags "
        "in one string, separated by spaces), its calls alternating with the default build's; the flags start "
        "with a dash, so give them after '=': --kernel-build=-DEA_HF_PREFETCH_LOCALITY=3",
    )
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


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.case:
        variant, length, mode = args.case
        result = run_case(variant, length, mode, args.repeats, args.warmup, args.batch, args.threads, args.dropout)
        print(RESULT_PREFIX + json.dumps(result), flush=True)
    elif args.paired or args.compiled_timing:
        compiled = bool(args.compiled_timing)
        length, mode = int((args.compiled_timing or args.paired)[0]), (args.compiled_timing or args.paired)[1]
        # A paired process of one of the rounds gets its share of the seconds; the compiled timing, half of them.
        seconds = args.paired_seconds / (2 if compiled else args.rounds)
        result = run_paired(
            length, mode, args.repeats, args.warmup, args.batch, args.threads, seconds, compiled, args.dropout
        )
        print(RESULT_PREFIX + json.dumps(result), flush=True)
    elif args.profile:
        length, mode = int(args.profile[0]), args.profile[1]
        result = run_profile(length, mode, args.warmup, args.repeats, args.batch, args.threads, args.dropout)
        print(RESULT_PREFIX + json.dumps(result), flush=True)
    elif args.kernel:
        kernel = run_kernel(args.kernel, args.batch, args.repeats, args.threads, builds=args.kernel_build)
        result = {**kernel, **memory_bandwidth(args.threads)}
        print(RESULT_PREFIX + json.dumps(result), flush=True)
    elif args.compiled_memory:
        variant, length, mode = args.compiled_memory
        result = run_compiled_memory(variant, int(length), mode, args.warmup, args.batch, args.threads, args.dropout)
        print(RESULT_PREFIX + json.dumps(result), flush=True)
    else:
        main_parent(args)


if __name__ == "__main__":
    main()

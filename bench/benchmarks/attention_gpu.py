"""GPU benchmark of Evolving Attention: BERT-Base with eager, sdpa, and EA on torch operations, on the Triton kernels
and under torch.compile, side by side, with times, peak GPU memory and proof of which kernel ran.

Every case (variant, N, batch, dtype, mode) builds a BertForSequenceClassification afresh with the same random
weights, runs ``--warmup`` untimed steps and ``--repeats`` timed ones (CUDA events, synchronised) and reads the peak
of ``torch.cuda.max_memory_allocated`` over the timed steps. Calls of the Triton kernels' ``correlate`` /
``backward`` are counted per case, so an ``ea-triton`` case that fell back to torch operations shows 0. A separate
check runs ``ea-torch`` and ``ea-triton`` on one model and the same inputs and records how far their outputs and
gradients differ. The JSON and the Markdown table are rewritten after every case, and ``--resume`` skips the cases
that a previous, interrupted run with the same settings finished, so a run can be split over several commands.

    python bench/benchmarks/attention_gpu.py             # on a CUDA GPU: N=512 batch 8 and N=2048 batch 2, bf16, fp32
    python bench/benchmarks/attention_gpu.py --dtypes bf16  # a subset (also --variants, --modes, --cases N:BATCH ...)
    python bench/benchmarks/attention_gpu.py --resume    # finish an interrupted run (same settings, same --out)
    python bench/benchmarks/attention_gpu.py --isolate   # every case in a fresh process (slower; survives CUDA faults)
    python bench/benchmarks/attention_gpu.py --dry-run   # no GPU needed: tiny BERT on CPU

The dry run (``--tiny`` is the same) uses a 2-layer BERT (hidden 32, 2 heads), N = 16 and 24 with batch 2, fp32,
1 warm-up and 2 timed steps, ``time.perf_counter`` times and no memory figures (null); ``ea-triton`` runs the Triton
kernels in Triton's interpreter (``TRITON_INTERPRET=1``) and the compiled variants use the ``eager`` backend.

Outputs: ``bench/results/<gpu name slug>/bench_gpu.json`` and ``.md`` (e.g. ``bench/results/nvidia-h100-80gb-hbm3/``;
``bench/results/cpu/bench_gpu_dry_run.*`` for the dry run), or under ``--out DIR``. Without CUDA and without
``--dry-run`` the script exits with status 2. Timing, memory, kernel-call counters, the result-line protocol and
target cells come from bench/harness.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # harness/ is in bench/, one folder up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import ea, is_cuda, memory  # noqa: E402
from harness.children import print_result, run_child  # noqa: E402
from harness.cli import parse_case  # noqa: E402
from harness.host import gpu_results_folder, machine_info, machine_line, utc_now, versions  # noqa: E402
from harness.models import BERT_BASE_CONFIG, build_model, parameter_count, random_batch, torch_dtype  # noqa: E402
from harness.tables import markdown_table, number, passes, ratio, target_cell  # noqa: E402
from harness.timing import stopwatch, summary, timed  # noqa: E402

VARIANTS = ("eager", "sdpa", "ea-torch", "ea-triton", "ea-torch-nhwc", "ea-compile", "ea-triton-compile")
EA_VARIANTS = ("ea-torch", "ea-triton", "ea-torch-nhwc", "ea-compile", "ea-triton-compile")
#: The EA variants on the Triton kernels (``EA_HF_TRITON=1``), and those under ``torch.compile``.
TRITON_VARIANTS = ("ea-triton", "ea-triton-compile")
COMPILED_VARIANTS = ("ea-compile", "ea-triton-compile")
#: The torch path's channels-last candidate (``EA_HF_CHANNELS_LAST=1``): the convolutions on maps whose heads are
#: padded to a multiple of 8, stored NHWC.
CHANNELS_LAST_VARIANTS = ("ea-torch-nhwc",)
#: The paths ea_hf can take on CUDA without the user compiling: the candidates for its default (:func:`default_choice`).
#: ``ea-torch`` is the reference the others are checked against.
DEFAULT_CANDIDATES = ("ea-torch", "ea-triton", "ea-torch-nhwc")
CHECKED_CANDIDATES = ("ea-triton", "ea-torch-nhwc")
#: What each candidate's cases must show they evolved on (``evolution_path``): a case that fell back is not counted.
CANDIDATE_PATHS = {
    "ea-torch": "torch operations",
    "ea-triton": "Triton kernels",
    "ea-torch-nhwc": "torch operations, channels-last",
}
MODES = ("inference", "training")
DTYPES = ("bf16", "fp32")
#: (N, batch) of the full run; the dry run's tiny cases stand in for them, in this order.
FULL_CASES = ((512, 8), (2048, 2))
DRY_RUN_CASES = ((16, 2), (24, 2))
#: Targets from the issue, for every EA variant against eager: the training step's time per N (the dry run's
#: cases carry the targets of the full case they stand in for), and the peak memory of every case.
TIME_TARGETS = {512: 1.15, 2048: 1.25}
MEMORY_TARGET = 1.2
#: BERT-Base (transformers.BertConfig defaults) except for the position table, which must reach N = 2048.
FULL_CONFIG = BERT_BASE_CONFIG
#: Two heads: the interpreted Triton kernels cost about heads^2 (every output head reads every head).
DRY_RUN_CONFIG = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}
#: ea-torch vs a candidate (ea-triton, ea-torch-nhwc): largest acceptable output difference (absolute; outputs are
#: LayerNorm'ed, so of order 1) and gradient difference (relative to the largest gradient), per dtype.
AGREEMENT_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}
GRADIENT_TOLERANCE = {"fp32": 1e-3, "bf16": 5e-2}
OPTIMIZERS = ("none", "sgd", "adamw")
TABLE_HEADER = (
    "N", "batch", "dtype", "mode", "variant", "median ms", "x eager", "x sdpa", "counted GB", "GB/s", "peak MiB",
    "above loaded MiB", "peak x eager", "peak x sdpa", "Triton calls/step", "time target", "memory target", "notes",
)  # fmt: skip
AGREEMENT_HEADER = (
    "N", "batch", "dtype", "candidate", "no_grad output max abs diff", "training output max abs diff",
    "gradient max rel diff", "path calls (candidate / ea-torch)", "agree",
)  # fmt: skip
NO_CUDA_MESSAGE = "attention_gpu.py: no CUDA device available; run it on a GPU, or use --dry-run for the CPU dry run"
#: A case's GPU memory figures on the CPU, where none are measured.
CPU_MEMORY = {
    "memory_source": "not measured on CPU: the GPU memory figures are null",
    "loaded_mib": None,
    "peak_mib": None,
    "above_loaded_mib": None,
}


# --------------------------------------------------------------------------------------------------------------
# One case: build, step, time, measure, count kernel calls.
# --------------------------------------------------------------------------------------------------------------


def variant_path(variant: str) -> str | None:
    """The path ``variant`` evolves its maps on (:func:`harness.ea.path_environment`); None without EA."""
    if variant in TRITON_VARIANTS:
        return "triton"
    if variant in CHANNELS_LAST_VARIANTS:
        return ea.CHANNELS_LAST_PATH
    return "torch" if variant in EA_VARIANTS else None


@contextlib.contextmanager
def kernel_settings(variant: str, device_type: str) -> Iterator[dict[str, int]]:
    """For the duration of a case: the variant's environment, the interpreter's Triton tiles (CPU only), and
    counters on the fused kernels' entry points (yielded); everything is put back afterwards."""
    path = variant_path(variant)
    with ea.evolution_on(path, device_type, ea.DRY_RUN_TILES), ea.counted_kernel_calls() as counts:
        yield counts


def bert_classifier(variant: str, config: dict, dtype: Any, device: Any) -> Any:
    """A BertForSequenceClassification (2 labels) with the same random weights for every variant (and the same EA
    kernels for every EA one), dropout off, in ``dtype`` on ``device``.

    A classification head rather than attention_cpu.py's bare BertModel: its training loss,
    ``last_hidden_state.pow(2).mean()``, is 1 for any input at initialisation (LayerNorm with unit weight and zero
    bias), so its gradients are rounding noise; the cross-entropy of the head gives real ones for the agreement
    check at the cost of a 768 x 2 layer.
    """
    from transformers import BertConfig, BertForSequenceClassification

    # problem_type given: transformers sets it on the first call otherwise, and torch.compile recompiles for that.
    config = BertConfig(
        **config,
        num_labels=2,
        problem_type="single_label_classification",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    attention = "ea" if variant in EA_VARIANTS else variant
    return build_model(BertForSequenceClassification, config, attention, device=device, dtype=dtype)


def output_checksum(output: Any) -> float:
    """A float64 fingerprint of an output (the logits): its entries weighted by cos(index), so that changes which
    cancel in a plain sum still show."""
    import torch

    flat = output.detach().double().flatten()
    return float((flat * torch.cos(torch.arange(flat.numel(), dtype=torch.float64, device=flat.device))).sum())


def compile_counters() -> Any:
    from torch._dynamo.utils import counters

    return counters


def unique_graphs() -> int:
    """The graphs dynamo has compiled since its counters were last cleared."""
    return compile_counters()["stats"].get("unique_graphs", 0)


@dataclasses.dataclass
class Case:
    """A case as it runs: how far it got (``stage``: build, first step, step, done), its model and step, and what
    the GPU allocator held once they were built (None on the CPU)."""

    stage: str = "build"
    model: Any = None
    step: Callable[[], Any] | None = None
    loaded_bytes: int | None = None


def build_case(case: Case, variant: str, length: int, batch: int, mode: str, dtype_name: str, settings: Any) -> dict:
    """Build the case's model (compiled for the compiled variants), its inputs and its step into ``case``; return
    the model's parameters and attention implementation."""
    import torch

    device = torch.device("cpu" if settings.dry_run else "cuda")
    config = DRY_RUN_CONFIG if settings.dry_run else FULL_CONFIG
    model = bert_classifier(variant, config, torch_dtype(dtype_name), device)
    inputs = random_batch(config["vocab_size"], batch, length, device, labels=2)
    features = {name: inputs[name] for name in ("input_ids", "attention_mask")}
    model.train(mode == "training")  # dropout probabilities are 0: train and eval compute the same
    compiled = variant in COMPILED_VARIANTS
    forward = torch.compile(model, backend=settings.compile_backend) if compiled else model
    optimizer = None
    if mode == "training" and settings.optimizer != "none":
        factory = torch.optim.AdamW if settings.optimizer == "adamw" else torch.optim.SGD
        optimizer = factory(model.parameters(), lr=1e-5)

    def step() -> Any:
        if mode == "inference":
            with torch.no_grad():
                return forward(**features).logits
        loss = forward(**inputs).loss
        loss.backward()
        if optimizer is not None:
            optimizer.step()
        return loss.detach()

    case.model, case.step, case.loaded_bytes = model, step, memory.gpu_allocated_bytes(device)
    return {"parameters": parameter_count(model), "attn_implementation": model.config._attn_implementation}


def time_case(case: Case, mode: str, settings: Any, device: Any, compile_info: dict | None) -> dict:
    """The case's steps: ``--warmup`` untimed, then ``--repeats`` timed; the first step's seconds (compilation and
    Triton's JIT, if any, included) and loss, the timed steps' seconds and their summary, and for inference the
    last output's checksum. The GPU allocator's peak is reset when the warm-ups end (compiling is in them)."""
    run, first, times, wall_times = None, {}, [], []
    graphs_after_warmup = 0
    for index in range(settings.warmup + settings.repeats):
        case.stage = "first step" if index == 0 else "step"
        case.model.zero_grad(set_to_none=True)
        run = None  # the previous output must not add to this step's peak
        if index == settings.warmup:
            graphs_after_warmup = unique_graphs() if compile_info is not None else 0
            memory.reset_gpu_peak(device)
        run = timed(case.step, device)
        if index == 0:
            first["first_step_s"] = run.seconds
            if mode == "training":
                first["first_loss"] = float(run.output)  # before any optimizer step: same for every variant
        if index >= settings.warmup:
            times.append(run.seconds)
            wall_times.append(run.wall_s)
    case.stage = "done"
    if compile_info is not None:
        # A guard that fails on every call would put compilation into the timed steps: make it visible.
        compile_info["graphs_compiled_in_timed_steps"] = unique_graphs() - graphs_after_warmup
    figures = {**first, "times_s": times, "wall_times_s": wall_times, **summary(times)}
    if mode == "inference":
        figures["output_checksum"] = output_checksum(run.output)
    return figures


def measure_case(case: Case, device: Any) -> dict:
    """The GPU memory of the timed steps: the allocator's peak over them, and above what it held once the model
    and inputs were on the GPU."""
    peak, loaded = memory.gpu_peak_bytes(device) / memory.MIB, case.loaded_bytes / memory.MIB
    return {
        "memory_source": "torch.cuda.max_memory_allocated over the timed steps; loaded = memory_allocated with the "
        "model and inputs on the GPU, before the first step",
        "loaded_mib": loaded,
        "peak_mib": peak,
        "above_loaded_mib": peak - loaded,
        "peak_reserved_mib": memory.gpu_reserved_peak_bytes(device) / memory.MIB,
    }


def start_compile(settings: Any) -> dict:
    """A compiled case's record, dynamo reset and its counters cleared: no graphs or guards carried over from
    another case, and its compilation counted from scratch."""
    import torch

    torch._dynamo.reset()
    compile_counters().clear()
    return {"backend": settings.compile_backend, "mode": "default", "failed": False, "error": None}


def finish_compile(compile_info: dict) -> None:
    """What dynamo did in the case (graph breaks and their reasons, graphs, frames) into ``compile_info``; dynamo
    reset for the next case."""
    import torch

    stats = compile_counters()
    compile_info["graph_breaks"] = sum(stats["graph_break"].values())
    compile_info["graph_break_reasons"] = {
        break_reason(reason): count for reason, count in stats["graph_break"].most_common(8)
    }
    compile_info["unique_graphs"] = stats["stats"].get("unique_graphs", 0)
    compile_info["dynamo_stats"] = dict(stats["stats"])
    # Frames not "ok" ran uncompiled: a failed capture, or a frame past dynamo's recompile limit.
    compile_info["frames"] = dict(stats["frames"])
    torch._dynamo.reset()


def record_error(result: dict, compile_info: dict | None, error: Exception, stage: str) -> None:
    """A failed case's error and stage into ``result``; a compiler's error, or any but running out of memory in
    the first step (which compiles), is a failed compile."""
    import torch

    result.update(status="error", error=f"{type(error).__name__}: {error}"[:2000], failed_at=stage)
    compiler_error = type(error).__module__.startswith(("torch._dynamo", "torch._inductor"))
    out_of_memory = isinstance(error, torch.cuda.OutOfMemoryError)
    if compile_info is not None and (compiler_error or (stage == "first step" and not out_of_memory)):
        compile_info.update(failed=True, error=result["error"])


def case_head(variant: str, length: int, batch: int, mode: str, dtype_name: str, device: Any) -> dict[str, Any]:
    """The first fields of a case's result: what it is, where it runs, how it is timed."""
    cuda = is_cuda(device)
    return {
        "variant": variant,
        "n": length,
        "batch": batch,
        "mode": mode,
        "dtype": dtype_name,
        "device": device.type,
        "status": "ok",
        "error": None,
        "environment": ea.path_environment(variant_path(variant), device.type),
        "timing": "torch.cuda.Event around each step, synchronised" if cuda else "time.perf_counter (CPU)",
    }


def run_case(variant: str, length: int, batch: int, mode: str, dtype_name: str, settings: argparse.Namespace) -> dict:
    """Time and measure one case in this process (:func:`build_case`, :func:`time_case`, :func:`measure_case`);
    errors (out of memory, a failed compile) are recorded in the result instead of raised, so one broken case does
    not end a long GPU run."""
    import torch

    ea.import_ea_hf()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    device = torch.device("cpu" if settings.dry_run else "cuda")
    result = case_head(variant, length, batch, mode, dtype_name, device)
    compile_info = start_compile(settings) if variant in COMPILED_VARIANTS else None
    memory.release_gpu_memory(device)
    if is_cuda(device):
        result["allocated_before_build_mib"] = memory.reset_gpu_peak(device) / memory.MIB
    case, elapsed = Case(), stopwatch()
    with kernel_settings(variant, device.type) as counts:
        try:
            result.update(build_case(case, variant, length, batch, mode, dtype_name, settings))
            result.update(time_case(case, mode, settings, device, compile_info))
            result.update(measure_case(case, device) if is_cuda(device) else {})
        except Exception as error:  # recorded: the run goes on with the next case
            record_error(result, compile_info, error, case.stage)
        finally:
            kernel_calls = dict(counts)
            case = None
            if compile_info is not None:
                finish_compile(compile_info)
            memory.release_gpu_memory(device)
    result.setdefault("median_s", None)
    result |= {} if is_cuda(device) else CPU_MEMORY
    result.setdefault("peak_mib", None)
    result.setdefault("above_loaded_mib", None)
    result |= kernel_figures(variant, kernel_calls, settings)
    result |= {
        "compile": compile_info,
        "case_wall_s": elapsed(),
        "warmup": settings.warmup,
        "repeats": settings.repeats,
    }
    return result


def kernel_figures(variant: str, kernel_calls: dict[str, int], settings: Any) -> dict:
    """A case's kernel calls, per step, and the path they prove."""
    calls = ea.triton_calls(kernel_calls)
    return {
        "kernel_calls": kernel_calls,
        "triton_calls": calls,
        "triton_calls_per_step": calls / (settings.warmup + settings.repeats),
        "ran_on_triton": calls > 0,
        "evolution_path": ea.evolution_path(variant in EA_VARIANTS, kernel_calls, variant in COMPILED_VARIANTS),
    }


def counted_step_bytes(variant: str, length: int, batch: int, mode: str, dtype_name: str, dry_run: bool) -> dict:
    """The bytes of the case's step as bench/harness/bytes.py counts them on the meta device (the path CUDA takes,
    every aten op's inputs and outputs, a fused operator's declared bytes): its BERT of the same dimensions, N,
    batch, dtype and mode (a bare BertModel whose training loss is its last hidden state's mean square, where the
    case trains a 2-label head: a few KB apart). None for the variants the counter does not count (sdpa, whose
    fused kernel it cannot see, and the compiled ones, whose fusions it cannot see), or where counting failed."""
    from harness import bytes as counter

    if variant not in counter.VARIANTS:
        return {"counted_bytes": None, "largest_ops": None, "bytes_source": f"{variant}: not counted"}
    case = counter.ByteCase("bert", mode, length, batch, {"bf16": "bfloat16", "fp32": "float32"}[dtype_name])
    try:
        count = counter.count_case(case, variant, DRY_RUN_CONFIG if dry_run else FULL_CONFIG)
    except Exception as error:  # recorded: a count that fails leaves the case's times standing
        return {"counted_bytes": None, "largest_ops": None, "bytes_source": f"count failed: {error}"[:500]}
    return {
        "counted_bytes": count.total,
        "largest_ops": dict(count.largest(5)),
        "bytes_source": "bench/harness/bytes.py on the meta device",
    }


def break_reason(reason: str) -> str:
    """The headline and the explanation of a dynamo graph-break reason, without its hints and links."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    return " ".join(lines[:2])[:240]


def check_run(model: Any, inputs: dict, variant: str, device: Any) -> tuple[dict, dict[str, int]]:
    """One path's outputs of ``model`` on ``inputs`` (the logits and last hidden state, no_grad and with autograd)
    and its parameter gradients of the training loss, and the kernel calls it made."""
    import torch

    def outputs(output: Any) -> Any:
        """The logits and the last hidden state, side by side as one float32 vector per batch element."""
        return torch.cat([output.logits.float(), output.hidden_states[-1].float().flatten(1)], dim=1).detach()

    with kernel_settings(variant, device.type) as counts:
        with torch.no_grad():
            inference = outputs(model(**inputs, output_hidden_states=True))
        model.zero_grad(set_to_none=True)
        trained = model(**inputs, output_hidden_states=True)
        trained.loss.backward()
        gradients = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"inference": inference, "output": outputs(trained), "grads": gradients}, dict(counts)


def differences(reference: dict, candidate: dict) -> dict:
    """The largest differences of the outputs and gradients of two :func:`check_run` results."""
    if reference["grads"].keys() != candidate["grads"].keys():
        raise RuntimeError("ea-torch and the candidate gave gradients to different parameters")
    gradient_diff = max((reference["grads"][k] - candidate["grads"][k]).abs().max().item() for k in candidate["grads"])
    gradient_scale = max(g.abs().max().item() for g in reference["grads"].values())
    return {
        "max_abs_output": reference["inference"].abs().max().item(),
        "inference_max_abs_diff": (reference["inference"] - candidate["inference"]).abs().max().item(),
        "training_output_max_abs_diff": (reference["output"] - candidate["output"]).abs().max().item(),
        "gradient_max_abs_diff": gradient_diff,
        "gradient_max_abs": gradient_scale,
        "gradient_max_rel_diff": gradient_diff / gradient_scale if gradient_scale > 0 else 0.0,
        "parameters_with_gradients": len(candidate["grads"]),
    }


def path_calls(check: dict, variant: str) -> int:
    """The calls in a check that prove ``variant`` ran its candidate's path: the Triton kernels', or the
    channels-last candidate's (``{variant}_triton_calls`` / ``{variant}_channels_last_calls``)."""
    kind = "channels_last" if check.get("candidate") in CHANNELS_LAST_VARIANTS else "triton"
    return check[f"{variant}_{kind}_calls"]


def agree(check: dict, dtype_name: str) -> bool:
    """Whether a check's differences are within the tolerances, the candidate ran on its path and ea-torch did
    not."""
    output_ok = max(check["inference_max_abs_diff"], check["training_output_max_abs_diff"]) <= (
        AGREEMENT_TOLERANCE[dtype_name] * (1.0 if dtype_name == "fp32" else check["max_abs_output"])
    )
    return (
        output_ok
        and check["gradient_max_rel_diff"] <= GRADIENT_TOLERANCE[dtype_name]
        and path_calls(check, check["candidate"]) > 0
        and path_calls(check, "ea-torch") == 0
    )


def run_check(
    length: int, batch: int, dtype_name: str, settings: argparse.Namespace, candidate: str = "ea-triton"
) -> dict:
    """ea-torch against ``candidate`` (:data:`CHECKED_CANDIDATES`) on one model (same weights) and the same inputs:
    the largest differences of the no_grad logits and last hidden state, of the same with autograd, and of the
    parameter gradients of the training loss (the cross-entropy of the classification head)."""
    import torch

    ea.import_ea_hf()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    device = torch.device("cpu" if settings.dry_run else "cuda")
    config = DRY_RUN_CONFIG if settings.dry_run else FULL_CONFIG
    result: dict[str, Any] = {
        "n": length, "batch": batch, "dtype": dtype_name, "candidate": candidate, "status": "ok", "error": None,
    }  # fmt: skip
    # TF32 convolutions would make the torch path differ from the fp32 kernels by TF32 rounding, not by a bug.
    tf32 = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    runs: dict[str, dict] = {}
    try:
        model = bert_classifier("ea-torch", config, torch_dtype(dtype_name), device)
        inputs = random_batch(config["vocab_size"], batch, length, device, labels=2)
        model.eval()
        for variant in ("ea-torch", candidate):
            runs[variant], calls = check_run(model, inputs, variant, device)
            result[f"{variant}_triton_calls"] = ea.triton_calls(calls)
            result[f"{variant}_channels_last_calls"] = ea.channels_last_calls(calls)
            result[f"{variant}_cpu_kernel_calls"] = ea.cpu_kernel_calls(calls)
        result.update(differences(runs["ea-torch"], runs[candidate]))
        result["agree"] = agree(result, dtype_name)
    except Exception as error:  # recorded like a failed case
        result.update(status="error", error=f"{type(error).__name__}: {error}"[:2000], agree=False)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
        runs.clear()
        model = None
        memory.release_gpu_memory(device)
    result["tolerance"] = {"output": AGREEMENT_TOLERANCE[dtype_name], "gradient_rel": GRADIENT_TOLERANCE[dtype_name]}
    return result


# --------------------------------------------------------------------------------------------------------------
# The run: plan the cases, run them (here or in fresh processes), compare, write.
# --------------------------------------------------------------------------------------------------------------


def child_arguments(args: argparse.Namespace) -> list[str]:
    """The options a ``--case`` / ``--check`` child needs to run as this process would."""
    return [
        *(["--dry-run"] if args.dry_run else []),
        *["--repeats", str(args.repeats), "--warmup", str(args.warmup)],
        *["--compile-backend", args.compile_backend, "--optimizer", args.optimizer],
        *(["--threads", str(args.threads)] if args.threads else []),
    ]


def spawn(internal: list[str], args: argparse.Namespace, what: str) -> dict:
    """Run this script in an internal mode in a fresh process; a child that dies (a CUDA fault, a crash) is
    recorded as an error rather than ending the run."""
    try:
        return run_child(__file__, [*internal, *child_arguments(args)], args.threads or os.cpu_count() or 1, what)
    except RuntimeError as error:
        return {"status": "error", "error": f"{error} (its output is on stderr)"}


def spawn_case(variant: str, length: int, batch: int, mode: str, dtype: str, args: argparse.Namespace) -> dict:
    internal = ["--case", variant, str(length), str(batch), mode, dtype]
    result = spawn(internal, args, f"case {variant} N={length} {mode} {dtype}")
    result.update(variant=variant, n=length, batch=batch, mode=mode, dtype=dtype)
    return result


def spawn_check(length: int, batch: int, dtype: str, args: argparse.Namespace, candidate: str) -> dict:
    internal = ["--check", str(length), str(batch), dtype, candidate]
    result = spawn(internal, args, f"check {candidate} N={length} {dtype}")
    result.update(n=length, batch=batch, dtype=dtype, candidate=candidate)
    return result


def stands_for(length: int, dry_run: bool) -> int:
    """The N whose targets apply: the dry run's tiny N stand in for the full cases, in order."""
    if dry_run:
        return dict(zip((n for n, _ in DRY_RUN_CASES), (n for n, _ in FULL_CASES), strict=True)).get(length, length)
    return length


def compare(cases: list[dict], dry_run: bool) -> list[dict]:
    """One row per case, in the order run, with its ratios to the eager and sdpa cases of the same (N, batch,
    dtype, mode) and the targets of the EA variants."""
    by_key = {(c["n"], c["batch"], c["dtype"], c["mode"], c["variant"]): c for c in cases}
    rows = []
    for case in cases:
        group = (case["n"], case["batch"], case["dtype"], case["mode"])
        eager, sdpa = by_key.get((*group, "eager"), {}), by_key.get((*group, "sdpa"), {})
        evolving = case["variant"] in EA_VARIANTS
        row = {
            "n": case["n"],
            "batch": case["batch"],
            "dtype": case["dtype"],
            "mode": case["mode"],
            "variant": case["variant"],
            "status": case.get("status"),
            "error": case.get("error"),
            "median_ms": None if case.get("median_s") is None else case["median_s"] * 1e3,
            "peak_mib": case.get("peak_mib"),
            "above_loaded_mib": case.get("above_loaded_mib"),
            "time_over_eager": ratio(case.get("median_s"), eager.get("median_s")),
            "time_over_sdpa": ratio(case.get("median_s"), sdpa.get("median_s")),
            "counted_gb": None if case.get("counted_bytes") is None else case["counted_bytes"] / 1e9,
            "achieved_gb_s": achieved_bandwidth(case),
            "peak_over_eager": ratio(case.get("peak_mib"), eager.get("peak_mib")),
            "peak_over_sdpa": ratio(case.get("peak_mib"), sdpa.get("peak_mib")),
            "above_loaded_over_eager": ratio(case.get("above_loaded_mib"), eager.get("above_loaded_mib")),
            "triton_calls_per_step": case.get("triton_calls_per_step"),
            "ran_on_triton": case.get("ran_on_triton"),
            "evolution_path": case.get("evolution_path"),
            "time_target": TIME_TARGETS.get(stands_for(case["n"], dry_run))
            if evolving and case["mode"] == "training"
            else None,
            "memory_target": MEMORY_TARGET if evolving else None,
        }
        row["time_pass"] = passes(row["time_over_eager"], row["time_target"])
        row["memory_pass"] = passes(row["peak_over_eager"], row["memory_target"])
        rows.append(row)
    return rows


def precision_of(dtype_name: str) -> str:
    """The precision a case's dtype belongs to (``"float32"`` or ``"half"``), as ea_hf chooses its default per
    precision (``ea_hf.ops.triton.common.precision``)."""
    return "float32" if dtype_name == "fp32" else "half"


def default_choice(rows: list[dict], checks: list[dict], precision: str) -> dict:
    """The rule that sets ea_hf's default path on CUDA for maps of one ``precision`` (``"half"``: bf16 and fp16;
    ``"float32"``) from the decision table: the fastest correct candidate.

    Only the table's cases and checks of that precision count. The candidates are :data:`DEFAULT_CANDIDATES`. One is
    correct where every case of it in the table (``rows``, as :func:`compare` gives them) ran without error on its
    own path (:data:`CANDIDATE_PATHS`: a case that fell back measured another path) and, for all but the reference
    ``ea-torch``, it has agreement checks against ea-torch (``checks``) and every one agrees. Of the correct ones, the
    fastest has the least geometric mean of its time over eager across the cases (N, batch, dtype, mode) in which
    every correct candidate has one. Without such a case, or without a correct candidate, the default stays
    ``ea-torch``.

    Example:
        >>> def row(variant, ratio):
        ...     return {"n": 512, "batch": 8, "dtype": "bf16", "mode": "training", "variant": variant, "status": "ok",
        ...             "time_over_eager": ratio, "evolution_path": CANDIDATE_PATHS[variant]}
        >>> rows = [row("ea-torch", 2.0), row("ea-triton", 1.8), row("ea-torch-nhwc", 1.9)]
        >>> checks = [{"dtype": "bf16", "candidate": "ea-triton", "status": "ok", "agree": False},
        ...           {"dtype": "bf16", "candidate": "ea-torch-nhwc", "status": "ok", "agree": True}]
        >>> choice = default_choice(rows, checks, "half")
        >>> choice["default"], choice["excluded"]
        ('ea-torch-nhwc', {'ea-triton': 'disagrees with ea-torch in an agreement check'})
        >>> default_choice(rows, checks, "float32")["default"]  # no fp32 case: the reference
        'ea-torch'
    """
    rows = [row for row in rows if precision_of(row["dtype"]) == precision]
    checks = [check for check in checks if precision_of(check["dtype"]) == precision]
    excluded = {}
    for candidate in DEFAULT_CANDIDATES:
        own = [row for row in rows if row["variant"] == candidate]
        failed = [r for r in own if r["status"] != "ok" or r.get("evolution_path") != CANDIDATE_PATHS[candidate]]
        own_checks = [check for check in checks if check.get("candidate", "ea-triton") == candidate]
        if not own:
            excluded[candidate] = "not in the table"
        elif failed:
            excluded[candidate] = f"{len(failed)} of its cases failed or ran on another path"
        elif candidate != "ea-torch" and not own_checks:
            excluded[candidate] = "no agreement check against ea-torch"
        elif not all(check.get("status") == "ok" and check.get("agree") for check in own_checks):
            excluded[candidate] = "disagrees with ea-torch in an agreement check"
    correct = [candidate for candidate in DEFAULT_CANDIDATES if candidate not in excluded]
    ratios: dict[tuple, dict[str, float]] = {}
    for row in rows:
        if row["variant"] in correct and row.get("time_over_eager") is not None:
            ratios.setdefault((row["n"], row["batch"], row["dtype"], row["mode"]), {})[row["variant"]] = row[
                "time_over_eager"
            ]
    compared = {group: times for group, times in ratios.items() if set(times) == set(correct)}
    geomeans = {
        candidate: math.exp(sum(math.log(times[candidate]) for times in compared.values()) / len(compared))
        for candidate in correct
        if compared
    }
    return {
        "precision": precision,
        "rule": "the fastest correct candidate: the least geometric mean of time over eager, over the cases of this "
        "precision every correct candidate ran, among those whose cases ran on their path and that agree with "
        "ea-torch",
        "default": min(geomeans, key=geomeans.get) if geomeans else "ea-torch",
        "correct": correct,
        "excluded": excluded,
        "cases_compared": len(compared),
        "geomean_time_over_eager": geomeans,
        "fastest_by_case": [
            {"n": n, "batch": batch, "dtype": dtype, "mode": mode, "fastest": min(times, key=times.get)}
            for (n, batch, dtype, mode), times in compared.items()
        ],
    }


def default_choices(rows: list[dict], checks: list[dict]) -> dict[str, dict]:
    """:func:`default_choice` for each precision: what a GPU session's table says ea_hf's default on that GPU
    should be (``ea_hf.ops.triton.common.TRITON_BY_DEFAULT`` follows it)."""
    return {precision: default_choice(rows, checks, precision) for precision in ("half", "float32")}


def decision_table(reports: list[dict]) -> dict:
    """One GPU's decision table from a session's reports (one per N, as ``sessions/gpu_session.sh`` writes them):
    the candidates' rows and the agreement checks of them all, the GPU, its compute capability and versions, and the
    rule's verdict per precision (:func:`default_choices`). Committed as ``bench/results/<gpu>/decision_table.json``,
    it is what ``ea_hf.ops.triton.common.TRITON_BY_DEFAULT`` must follow for that GPU's compute capability (a test
    checks it).

    Example:
        >>> row = {"n": 512, "batch": 8, "dtype": "bf16", "mode": "training", "variant": "ea-torch", "status": "ok",
        ...        "time_over_eager": 2.0, "evolution_path": "torch operations"}
        >>> report = {"gpu": "NVIDIA H200", "machine": {"gpu_capability": [9, 0]}, "versions": {},
        ...           "comparison": [row, dict(row, variant="eager")], "agreement": []}
        >>> table = decision_table([report])
        >>> table["capability"], len(table["comparison"]), table["default_choice"]["half"]["default"]
        ([9, 0], 1, 'ea-torch')
    """
    if not reports:
        raise ValueError("a decision table needs at least one report")
    where = {(report["gpu"], tuple(report["machine"].get("gpu_capability") or ())) for report in reports}
    if len(where) != 1:
        raise ValueError(f"the reports come from more than one GPU: {sorted(where)}")
    ((gpu, capability),) = where
    rows = [row for report in reports for row in report["comparison"] if row["variant"] in DEFAULT_CANDIDATES]
    checks = [check for report in reports for check in report["agreement"]]
    return {
        "about": "The decision table of ea_hf's default path on CUDA for this GPU (bench/benchmarks/attention_gpu.py "
        "--decision-table): the candidates' cases and agreement checks, and the rule's verdict per precision.",
        "gpu": gpu,
        "capability": list(capability) or None,  # None: a CPU dry run's, no GPU's
        "versions": reports[0]["versions"],
        "comparison": rows,
        "agreement": checks,
        "default_choice": default_choices(rows, checks),
    }


def choice_text(choices: dict[str, dict]) -> str:
    """:func:`default_choices`' verdicts as Markdown, one line per precision."""
    lines = []
    for precision, choice in choices.items():
        means = ", ".join(f"`{name}` {mean:.3f}x" for name, mean in choice["geomean_time_over_eager"].items())
        excluded = "; ".join(f"`{name}`: {why}" for name, why in choice["excluded"].items())
        lines.append(
            f"- {precision} maps: **default on CUDA by this table: `{choice['default']}`.** Geometric mean of time "
            f"over eager over {choice['cases_compared']} case(s): {means or 'none'}. Excluded: {excluded or 'none'}."
        )
    rule = next(iter(choices.values()))["rule"] if choices else ""
    return f"Rule, per precision: {rule}.\n\n" + "\n".join(lines) + "\n"


def achieved_bandwidth(case: dict) -> float | None:
    """A case's counted bytes over its median step time, in GB/s (None without either)."""
    moved, seconds = case.get("counted_bytes"), case.get("median_s")
    return None if moved is None or not seconds else moved / seconds / 1e9


def notes(row: dict, case: dict) -> str:
    parts = []
    if row["variant"] in TRITON_VARIANTS and row["status"] == "ok" and not row["ran_on_triton"]:
        parts.append("FELL BACK to torch operations (0 Triton calls)")
    if (
        row["variant"] in CHANNELS_LAST_VARIANTS
        and row["status"] == "ok"
        and row["evolution_path"] != (CANDIDATE_PATHS[row["variant"]])
    ):
        parts.append("FELL BACK to the default layout (no channels-last calls)")
    compiled = case.get("compile")
    if compiled:
        if compiled.get("failed"):
            parts.append("compile FAILED")
        if compiled.get("graphs_compiled_in_timed_steps"):
            parts.append(f"RECOMPILED in timed steps ({compiled['graphs_compiled_in_timed_steps']} graphs)")
        breaks, frames = compiled.get("graph_breaks"), compiled.get("frames") or {}
        uncompiled = frames.get("total", 0) - frames.get("ok", 0)
        parts.append(
            f"{compiled['backend']}, {breaks} graph breaks, {uncompiled} frames run uncompiled, "
            f"first step {case.get('first_step_s', 0):.1f} s"
        )
    if row["error"]:
        parts.append(row["error"].split("\n")[0][:120].replace("|", "/"))
    return "; ".join(parts)


def cases_table(rows: list[dict], cases: list[dict]) -> str:
    """The comparison rows (:func:`compare`) and the notes of their cases as Markdown."""
    cells = [
        [str(row["n"]), str(row["batch"]), row["dtype"], row["mode"], row["variant"], number(row["median_ms"], 2)]
        + [number(row["time_over_eager"], 3), number(row["time_over_sdpa"], 3), number(row["counted_gb"], 3)]
        + [number(row["achieved_gb_s"], 2), number(row["peak_mib"], 0)]
        + [number(row["above_loaded_mib"], 0), number(row["peak_over_eager"], 3), number(row["peak_over_sdpa"], 3)]
        + [number(row["triton_calls_per_step"], 1), target_cell(row["time_target"], row["time_pass"])]
        + [target_cell(row["memory_target"], row["memory_pass"]), notes(row, case)]
        for row, case in zip(rows, cases, strict=True)
    ]
    return markdown_table(TABLE_HEADER, "rrlll" + "r" * 10 + "lll", cells) + "\n"


def agreement_table(checks: list[dict]) -> str:
    """The agreement checks as Markdown; a failed check's row gives its error."""
    cells = []
    for check in checks:
        candidate = check.get("candidate", "ea-triton")
        head = [str(check["n"]), str(check["batch"]), check["dtype"], candidate]
        if check.get("status") != "ok":
            error = (check.get("error") or "").split("\n")[0][:120].replace("|", "/")
            cells.append([*head, "-", "-", "-", "-", f"ERROR: {error}"])
            continue
        cells.append(
            [*head, f"{check['inference_max_abs_diff']:.2e}", f"{check['training_output_max_abs_diff']:.2e}"]
            + [
                f"{check['gradient_max_rel_diff']:.2e}",
                f"{path_calls(check, candidate)} / {path_calls(check, 'ea-torch')}",
            ]
            + ["yes" if check["agree"] else "NO"]
        )
    return markdown_table(AGREEMENT_HEADER, "rrllrrrrl", cells) + "\n"


def markdown_report(report: dict) -> str:
    """The Markdown file: what was run, the tables and how to read them."""
    settings, library = report["settings"], report["versions"]
    dry = settings["dry_run"]
    intro = (
        f"{report['machine_line']}, triton {library['triton']}"
        + (f", CUDA {library['cuda']}" if library["cuda"] else "")
        + f". {report['model']}, random weights (seed 0), dropout "
        f"0; random input_ids, all-ones attention mask. EA: `ea_hf.patch(model, alpha={ea.EA_ALPHA}, "
        f"beta={ea.EA_BETA})` "
        "(3x3 kernel, every layer); `ea-torch` evolves with torch operations, `ea-triton` with the Triton kernels "
        "(`EA_HF_TRITON=1`), `ea-torch-nhwc` with torch operations whose convolutions run on channels-last maps with "
        "the heads padded to a multiple of 8 (`EA_HF_CHANNELS_LAST=1`), `ea-compile` and `ea-triton-compile` are "
        "those models under `torch.compile` (backend "
        f"`{settings['compile_backend']}`, default mode; the Triton kernels and the fused attention tail run as torch "
        "operators). inference = forward (logits) under `torch.no_grad()`; "
        "training = forward with labels, `loss.backward()` (cross-entropy of the 2-label head)"
        + (f", `{settings['optimizer']}` step" if settings["optimizer"] != "none" else ", no optimizer step")
        + f". Median of {settings['repeats']} steps after {settings['warmup']} warm-up step(s). "
    )
    if dry:
        intro += (
            "\n\n**Dry run on CPU**: tiny BERT, times from `time.perf_counter` (meaningless as GPU figures), GPU "
            "memory not measured (null, shown as -), Triton kernels run by Triton's interpreter "
            "(`TRITON_INTERPRET=1`). The tiny N carry the targets of the full cases they stand in for."
        )
    else:
        intro += (
            "Times from CUDA events; peak = `torch.cuda.max_memory_allocated()` over the timed steps; above loaded = "
            "peak minus `memory_allocated()` with the model and inputs on the GPU. TF32 as torch's defaults (cuDNN "
            "convolutions of the fp32 cases may use it, matmuls do not)."
        )
    targets = (
        f"Targets (EA variants against eager): training step at most {TIME_TARGETS[512]}x at N = 512 and "
        f"{TIME_TARGETS[2048]}x at N = 2048; peak memory at most {MEMORY_TARGET}x. *Triton calls/step*: calls of "
        "`ea_hf.ops.triton.evolution.correlate` + `backward` per step (warm-ups included; compiled, the backward "
        "runs as an operator and only `correlate` is counted); an `ea-triton` row with 0 fell back to torch "
        "operations. *Counted GB*: the bytes of the step by `bench/harness/bytes.py` on the meta device (every aten "
        "op's inputs and outputs, views excluded; the fused operators' declared bytes; not counted for sdpa and the "
        "compiled variants); *GB/s*: those bytes over the median step, the achieved bandwidth."
    )
    return (
        f"# Evolving Attention on GPU: eager vs sdpa vs EA (torch, Triton, torch.compile)\n\n{intro}\n\n{targets}\n\n"
        f"{report['markdown_table']}\n"
        "## ea-torch vs each candidate on the same weights and inputs\n\n"
        f"Tolerances: outputs {AGREEMENT_TOLERANCE} (absolute for fp32, relative to the largest output for bf16), "
        f"gradients {GRADIENT_TOLERANCE} relative to the largest gradient; TF32 off during the check.\n\n"
        f"{report['markdown_agreement']}\n"
        "## The default on CUDA\n\n"
        f"{choice_text(report['default_choice'])}"
    )


def output_paths(args: argparse.Namespace, gpu: str | None) -> tuple[Path, Path]:
    """(JSON, Markdown): ``bench_gpu.*`` under ``--out`` or bench/results/<gpu name slug>; the dry run's are
    ``bench_gpu_dry_run.*``, by default under bench/results/cpu."""
    out = gpu_results_folder(args.out, None if args.dry_run else gpu)
    stem = "bench_gpu_dry_run" if args.dry_run else "bench_gpu"
    return out / f"{stem}.json", out / f"{stem}.md"


def settings_key(args: argparse.Namespace) -> dict:
    """What must be equal for a previous run's cases to be reused by ``--resume``."""
    return {
        "dry_run": args.dry_run,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "compile_backend": args.compile_backend,
        "optimizer": args.optimizer,
    }


def previous_results(path: Path, args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """(cases, checks) of an earlier run at ``path`` that finished without error, for ``--resume``."""
    if not args.resume or not path.exists():
        return [], []
    previous = json.loads(path.read_text())
    if previous.get("settings_key") != settings_key(args):
        print(f"--resume: {path} was made with other settings; running every case again", flush=True)
        return [], []
    ok = [c for c in previous.get("cases", []) if c.get("status") == "ok"]
    return ok, [c for c in previous.get("agreement", []) if c.get("status") == "ok"]


def case_key(case: dict) -> tuple:
    return case["n"], case["batch"], case["dtype"], case["mode"], case["variant"]


def check_key(check: dict) -> tuple:
    return check["n"], check["batch"], check["dtype"], check.get("candidate", "ea-triton")


def case_order(key: tuple) -> tuple:
    """Cases by N, batch, dtype, mode and variant, and checks by N, batch, dtype and candidate, in the order of
    DTYPES, MODES and VARIANTS."""
    length, batch, dtype, *rest = key
    order = [length, batch, DTYPES.index(dtype)]
    if len(rest) == 2:
        order += [MODES.index(rest[0]), VARIANTS.index(rest[1])]
    elif rest:
        order.append(VARIANTS.index(rest[0]))
    return tuple(order)


def report_head(args: argparse.Namespace, info: dict) -> dict:
    """What the report says before its cases: the benchmark, model, machine, versions and settings."""
    return {
        "benchmark": "BERT-Base: eager vs sdpa vs Evolving Attention (torch operations, Triton kernels, torch.compile)",
        "created": utc_now(),
        "model": "BertForSequenceClassification (2 labels), "
        + ("tiny config (dry run)" if args.dry_run else "BERT-Base dimensions (110M)"),
        "config": DRY_RUN_CONFIG if args.dry_run else FULL_CONFIG,
        "machine": info,
        "machine_line": machine_line(info),
        "gpu": info["gpu"],
        "versions": versions(),
        "settings_key": settings_key(args),
        "settings": {
            **settings_key(args),
            "cases": [list(case) for case in args.cases],
            "dtypes": args.dtypes,
            "modes": args.modes,
            "variants": args.variants,
            "threads": args.threads,
            "isolate": args.isolate,
            "ea": {"alpha": ea.EA_ALPHA, "beta": ea.EA_BETA, "kernel_size": ea.EA_KERNEL_SIZE},
            "dry_run_tiles": ea.DRY_RUN_TILES if args.dry_run else None,
            "tf32": "defaults (cudnn.allow_tf32 on, matmul off) in the cases; off in the agreement check",
        },
        "targets": {"training_time_over_eager": TIME_TARGETS, "peak_memory_over_eager": MEMORY_TARGET},
    }


def run_cases(args: argparse.Namespace, case_results: dict[tuple, dict], write: Callable[[], None]) -> None:
    """Every planned case not in ``case_results`` (here, or in a fresh process with ``--isolate``) into it, the
    files rewritten after each."""
    for (length, batch), dtype, mode, variant in (
        (case, dtype, mode, variant)
        for case in args.cases
        for dtype in args.dtypes
        for mode in args.modes
        for variant in args.variants
    ):
        key = (length, batch, dtype, mode, variant)
        if key in case_results:
            result = case_results[key]
        elif args.isolate:
            result = spawn_case(variant, length, batch, mode, dtype, args)
        else:
            result = run_case(variant, length, batch, mode, dtype, args)
        if "counted_bytes" not in result:  # the achieved bandwidth's bytes, counted here (no GPU needed)
            result |= counted_step_bytes(variant, length, batch, mode, dtype, args.dry_run)
        case_results[key] = result
        write()
        median = result.get("median_s")
        print(
            f"  {variant:<10} N={length:<5} batch {batch} {dtype} {mode:<9} "
            + ("ERROR " + (result.get("error") or "").split("\n")[0][:160] if result.get("status") != "ok" else "")
            + (f"median {median * 1e3:9.2f} ms" if median is not None else "")
            + (f"  peak {result['peak_mib']:.0f} MiB" if result.get("peak_mib") is not None else "")
            + (f"  Triton calls {result.get('triton_calls')}" if variant in EA_VARIANTS else ""),
            flush=True,
        )


def run_checks(args: argparse.Namespace, check_results: dict[tuple, dict], write: Callable[[], None]) -> None:
    """The agreement check of every (N, batch, dtype, candidate) not in ``check_results`` into it, the files
    rewritten after each: ea-torch against each of :data:`CHECKED_CANDIDATES` that runs beside it, and none with
    ``--no-check``."""
    candidates = [c for c in CHECKED_CANDIDATES if c in args.variants]
    if "ea-torch" not in args.variants or args.no_check:
        return
    for (length, batch), dtype, candidate in (
        (case, dtype, candidate) for case in args.cases for dtype in args.dtypes for candidate in candidates
    ):
        key = (length, batch, dtype, candidate)
        check = check_results.get(key)
        if check is None:
            run = spawn_check if args.isolate else run_check
            check = run(length, batch, dtype, args, candidate)
        check_results[key] = check
        write()
        print(
            f"  check ea-torch vs {candidate} N={length} {dtype}: "
            + (
                f"output diff {check['inference_max_abs_diff']:.2e}, gradient rel diff "
                f"{check['gradient_max_rel_diff']:.2e}, agree {check['agree']}"
                if check.get("status") == "ok"
                else f"ERROR {check.get('error')}"
            ),
            flush=True,
        )


def collect(args: argparse.Namespace) -> dict:
    """Run every planned case and check (here, or each in a fresh process with ``--isolate``), rewriting the JSON
    and Markdown after each one; return the report."""
    elapsed = stopwatch()
    info = machine_info(args.threads or 0)
    info["device"] = "cpu" if args.dry_run else "cuda"
    if not args.dry_run:
        import torch

        info["gpu_capability"] = list(torch.cuda.get_device_capability(0))
        info["gpu_memory_mib"] = torch.cuda.get_device_properties(0).total_memory / memory.MIB
    json_path, markdown_path = output_paths(args, info["gpu"])
    json_path.parent.mkdir(parents=True, exist_ok=True)
    done_cases, done_checks = previous_results(json_path, args)
    print(f"machine: {machine_line(info)}", flush=True)
    report = report_head(args, info)
    # Keyed results, the previous run's first (--resume): a run split over several commands, or over subsets
    # (--dtypes bf16, then --dtypes fp32 --resume), ends with every case in one file, also when it is cut off.
    case_results = {case_key(c): dict(c, reused_from_previous_run=True) for c in done_cases}
    check_results = {check_key(c): dict(c, reused_from_previous_run=True) for c in done_checks}

    def write() -> None:
        cases = [case_results[key] for key in sorted(case_results, key=case_order)]
        checks = [check_results[key] for key in sorted(check_results, key=case_order)]
        rows = compare(cases, args.dry_run)
        report.update(
            cases=cases,
            comparison=rows,
            agreement=checks,
            markdown_table=cases_table(rows, cases),
            markdown_agreement=agreement_table(checks),
            default_choice=default_choices(rows, checks),
            wall_time_s=elapsed(),
        )
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        markdown_path.write_text(markdown_report(report))

    run_cases(args, case_results, write)
    run_checks(args, check_results, write)
    write()
    print()
    print(report["markdown_table"])
    print(report["markdown_agreement"])
    print(choice_text(report["default_choice"]))
    print(f"wall time {report['wall_time_s']:.0f} s; wrote {json_path}, {markdown_path}")
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; ``--dry-run`` changes the defaults of the cases, dtypes, repeats and threads."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--dry-run", "--tiny", action="store_true", help="tiny BERT on CPU, no GPU needed")
    add("--out", help="output folder (default bench/results/<gpu name slug>, or .../cpu dry)")
    add("--cases", type=parse_case, nargs="+", help="N:BATCH pairs (default 512:8 2048:2; dry 16:2 24:2)")
    add("--dtypes", nargs="+", choices=DTYPES, help="default bf16 fp32 (dry run: fp32)")
    add("--modes", nargs="+", choices=MODES, default=list(MODES))
    add("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    add("--repeats", type=int, help="timed steps per case (default 10; dry run 2)")
    add("--warmup", type=int, help="untimed steps before them (default 3; dry run 1)")
    add("--compile-backend", help="torch.compile backend of the compiled variants (default inductor; dry run eager: "
        "dynamo's graph capture only, as inductor's C++ build of even a tiny BERT is slow on a CPU; aot_eager also "
        "traces the backward)")  # fmt: skip
    add("--optimizer", choices=OPTIMIZERS, default="none", help="training step's optimizer (none)")
    add("--threads", type=int, help="torch.set_num_threads (default: torch's; dry run 1)")
    add("--isolate", action="store_true", help="run every case and check in a fresh process")
    add("--resume", action="store_true", help="reuse the finished cases of the output JSON")
    add("--no-check", action="store_true", help="skip the agreement checks of ea-torch against the candidates")
    add("--decision-table", nargs="+", metavar=("OUT", "REPORT"), help="merge a session's reports (JSON) into the "
        "GPU's decision table at OUT (decision_table.json) and print its verdicts; runs nothing")  # fmt: skip
    internal = parser.add_mutually_exclusive_group()
    internal.add_argument("--case", nargs=5, metavar=("VARIANT", "N", "BATCH", "MODE", "DTYPE"), help="internal: "
                          "run one case")  # fmt: skip
    internal.add_argument("--check", nargs=4, metavar=("N", "BATCH", "DTYPE", "CANDIDATE"), help="internal: run "
                          "one check")  # fmt: skip
    args = parser.parse_args(argv)
    dry = args.dry_run
    args.cases = args.cases or list(DRY_RUN_CASES if dry else FULL_CASES)
    args.dtypes = args.dtypes or (["fp32"] if dry else list(DTYPES))
    args.repeats = args.repeats if args.repeats is not None else (2 if dry else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if dry else 3)
    args.compile_backend = args.compile_backend or ("eager" if dry else "inductor")
    args.threads = args.threads if args.threads is not None else (1 if dry else None)
    if args.repeats < 1 or args.warmup < 0 or (args.threads is not None and args.threads < 1):
        parser.error("--repeats and --threads must be positive, --warmup non-negative")
    if args.case:
        variant, length, batch, mode, dtype = args.case
        if variant not in VARIANTS or mode not in MODES or dtype not in DTYPES:
            parser.error(f"--case expects VARIANT in {VARIANTS}, MODE in {MODES}, DTYPE in {DTYPES}")
        args.case = (variant, int(length), int(batch), mode, dtype)
    if args.decision_table is not None and len(args.decision_table) < 2:
        parser.error("--decision-table expects OUT and at least one REPORT")
    if args.check:
        length, batch, dtype, candidate = args.check
        if dtype not in DTYPES or candidate not in CHECKED_CANDIDATES:
            parser.error(f"--check expects DTYPE in {DTYPES}, CANDIDATE in {CHECKED_CANDIDATES}")
        args.check = (int(length), int(batch), dtype, candidate)
    return args


def main(argv: list[str] | None = None) -> None:
    """The whole run by default; ``--case`` / ``--check`` run one case or check and print it as a result line."""
    args = parse_args(argv)
    if args.decision_table:
        out, *paths = map(Path, args.decision_table)
        table = decision_table([json.loads(path.read_text()) for path in paths])
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(table, indent=2) + "\n")
        print(choice_text(table["default_choice"]) + f"wrote {out}")
        return
    if args.dry_run:
        # Before torch (transformers imports triton through torch._dynamo): Triton then starts interpreted.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE, file=sys.stderr)
        sys.exit(2)
    if args.case:
        print_result(run_case(*args.case, args))
    elif args.check:
        length, batch, dtype, candidate = args.check
        print_result(run_check(length, batch, dtype, args, candidate))
    else:
        collect(args)


if __name__ == "__main__":
    main()

"""One evolution step on a GPU: the Triton kernels against the torch operations, and a sweep of the kernels' tiles.

Where ``attention_gpu.py`` times whole models, this times the step alone (mix, mask, the H x H x k x k convolution,
ReLU, blend; and its backward), on the maps of one BERT-Base layer: what a tile or a kernel change buys, in a
minute of GPU time. Per case (dtype, N, batch, centred or causal kernel) it records the median time (CUDA events)
of the forward step out of place (as in training), in place (as in inference) and of forward plus backward, on
the Triton kernels and on torch operations, and how far the Triton result is from the torch one (float64, on
the same inputs). ``--sweep`` also times the Triton step under each configuration (tiles, warps, stages) on each
kernel's list (``CONFIGS`` of the kernels' module, which autotune searches on a GPU), one kernel at a time, the
others on their first. ``--liger`` also times, per centred case, Liger-Kernel's Multi-Token
Attention (``LigerMultiTokenAttention``: a convolution over attention maps, the nearest published peer of the step)
forward plus backward on the same maps, in turns with the step's forward plus backward on both paths, and records
the ratios EA / Liger and what each computes (``LIGER_COMPUTES``, ``EA_COMPUTES``); where liger_kernel cannot be
imported the report says why and the run goes on without it (``bench/sessions/fetch_wheels.sh`` brings its wheel).

    python bench/benchmarks/triton_kernels.py            # on a CUDA GPU: fp32 and bf16, N=512 batch 8, N=2048 batch 2
    python bench/benchmarks/triton_kernels.py --sweep --dtypes fp32
    python bench/benchmarks/triton_kernels.py --liger --dtypes bf16 --cases 512:8
    python bench/benchmarks/triton_kernels.py --dry-run  # no GPU: tiny maps on CPU in Triton's interpreter

Writes ``bench/results/<gpu name slug>/triton_kernels.json`` (``--out DIR`` elsewhere; the dry run writes
``bench/results/cpu/triton_kernels_dry_run.json``). Why maps are float32 in whole models: the attention core
evolves half-precision models' maps in float32 (``ea_hf.modeling.attention_core.full_precision``).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # harness/ is in bench/, one folder up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import ea  # noqa: E402
from harness.cli import parse_case  # noqa: E402
from harness.host import gpu_results_folder, utc_now, versions  # noqa: E402
from harness.models import TORCH_DTYPES, torch_dtype  # noqa: E402
from harness.timing import alternating, median_seconds, stopwatch  # noqa: E402
from harness.traffic import evolution_traffic  # noqa: E402

HEADS = 12
FULL_CASES = ((512, 8), (2048, 2))
DRY_RUN_CASES = ((13, 2),)
#: evolve()'s modes and the names of their times.
MODES = {"forward": "forward", "in_place": "forward_in_place", "backward": "forward_backward"}
#: The modes of the step the sweep times for each kernel (its first mode chooses it): the correlation runs in the
#: forward step, out of place and in place; the gradients' kernels in forward plus backward.
SWEEP_MODES = {
    "correlate": ("forward", "in_place"),
    "input_grad": ("backward",),
    "weight_grad": ("backward",),
}
#: How far a swept configuration's step may be from torch operations' in float64 (largest error relative to the largest
#: value) to be chosen by ``--tune``: the accuracy rule of the kernels' tests for each dtype.
TUNE_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2, "fp16": 1e-2}
#: Where ``--liger`` finds Liger-Kernel's Multi-Token Attention module (the import its README shows).
LIGER_CLASS = ("liger_kernel.transformers", "LigerMultiTokenAttention")
#: What each side of the Liger comparison computes, recorded beside the times: the two do different work on maps
#: of one shape, so the ratio is of two steps of one layer's attention maps, not of one computation.
LIGER_COMPUTES = (
    "LigerMultiTokenAttention(12, 12, 3, padding=1, bias=True, sparse=False) on scores [B, 12, N, N], weight and "
    "bias in the maps' dtype: forward, a causal mask (-1e9 above the diagonal, Triton), softmax over the keys "
    "(Triton), a centred 3x3 conv2d with bias (cuDNN), zeros above the diagonal (Triton); backward, the mask, "
    "conv_transpose2d and conv2d_weight (cuDNN), the bias sum and the softmax backward (torch operations), the "
    "mask: gradients of the scores, the weight and the bias"
)
EA_COMPUTES = (
    "ea_hf's evolution step alone (evolve_convolution, the centred 3x3 kernel): A_in = lerp(S, A_prev, alpha), "
    "A_logit = beta * ReLU(conv(A_in * keep) + bias) + (1 - beta) * A_in, with keep a key-padding mask; no "
    "softmax (the attention core's softmax follows the step); backward: gradients of S, A_prev, the weight and "
    "the bias. It reads two maps (S, A_prev) where Liger reads one, and writes two map gradients where Liger "
    "writes one"
)
NO_CUDA_MESSAGE = "triton_kernels.py: no CUDA device available; run it on a GPU, or use --dry-run for the CPU dry run"


def step_inputs(dtype_name: str, length: int, batch: int, causal: bool, device: str) -> dict[str, Any]:
    """S, A_prev, the upstream gradient, a key-padding mask (the last 37 columns of element 0, or a third of
    them for short maps) and a random kernel, seeded."""
    import torch

    generator = torch.Generator().manual_seed(0)
    dtype = torch_dtype(dtype_name)

    def randn(*shape: int, scale: float = 1.0) -> Any:
        return (torch.randn(*shape, generator=generator) * scale).to(device)

    scores, previous, upstream = (randn(batch, HEADS, length, length).to(dtype) for _ in range(3))
    keep = torch.ones(batch, 1, 1, length, dtype=dtype, device=device)
    keep[0, ..., length - min(37, length // 3) :] = 0
    weight = randn(HEADS, HEADS, 2 if causal else 3, 3, scale=0.3)
    return {"scores": scores, "previous": previous, "upstream": upstream, "keep": keep, "weight": weight,
            "bias": randn(HEADS, scale=0.1), "causal": causal}  # fmt: skip


def evolve(inputs: dict[str, Any], mode: str, cast: Callable[[Any], Any] | None = None) -> tuple[Any, list[Any]]:
    """The step through ``evolve_convolution`` (the registered kernels decide the path). ``mode``: ``in_place``
    (no autograd: A_logit over a copy of S, as in inference; the copy is part of the call), ``forward`` (autograd
    on, so out of place with the gate kept, as in training) or ``backward`` (that and the backward pass, which
    returns the gradients of S, A_prev, the weight and the bias). ``cast`` converts the inputs first."""
    import torch

    from ea_hf.modeling import convolution
    from ea_hf.modeling.step import EvolutionStep, StepMaps

    given = {name: cast(value) if cast and torch.is_tensor(value) else value for name, value in inputs.items()}
    grad = mode != "in_place"
    scores = given["scores"].detach().requires_grad_() if grad else given["scores"].clone()
    previous, weight, bias = (given[name].detach().requires_grad_(grad) for name in ("previous", "weight", "bias"))
    step = EvolutionStep(ea.EA_ALPHA, ea.EA_BETA, context_rows=1, causal=given["causal"])
    with torch.set_grad_enabled(grad):
        output = convolution.evolve_convolution(step, StepMaps(scores, previous, given["keep"]), weight, bias)
    if mode != "backward":
        return output, []
    output.backward(given["upstream"])
    return output.detach(), [scores.grad, previous.grad, weight.grad, bias.grad]


def relative_error(got: Any, want: Any) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).abs().max() / want.abs().max()).item()


def time_paths(inputs: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    """The median milliseconds of every mode of the step on each path, the Triton kernels and torch operations."""
    device = "cpu" if args.dry_run else "cuda"
    times = {}
    for path, kernels in (("triton", [ea.triton_kernels()]), ("torch", [])):
        with ea.fused_kernels(kernels):
            for mode, name in MODES.items():
                step = functools.partial(evolve, inputs, mode)
                times[f"{path}_{name}_ms"] = 1000 * median_seconds(step, device, args.repeats, args.warmup)
    return times


def path_errors(inputs: dict[str, Any]) -> dict[str, float]:
    """The Triton step's output and gradients against torch operations' in float64, each its largest error
    relative to the largest value.

    Relative to the largest value: a ReLU gate that float32 and float64 open differently (an output within rounding
    of 0) moves single gradient entries by a weight times the upstream gradient, so at large N the map gradients'
    maximum error is that of a few flipped gates, not of the kernels' arithmetic."""
    with ea.fused_kernels([ea.triton_kernels()]):
        got, got_grads = evolve(inputs, "backward")
    with ea.fused_kernels([]):
        want, want_grads = evolve(inputs, "backward", cast=lambda t: t.double())
    errors = [relative_error(a, b) for a, b in zip([got, *got_grads], [want, *want_grads], strict=True)]
    return dict(zip(["output", "scores", "previous", "weight", "bias"], errors, strict=True))


def run_case(dtype: str, length: int, batch: int, causal: bool, args: argparse.Namespace) -> dict:
    """Times of both paths and the Triton step's error against torch operations in float64."""
    inputs = step_inputs(dtype, length, batch, causal, "cpu" if args.dry_run else "cuda")
    case: dict[str, Any] = {"dtype": dtype, "n": length, "batch": batch, "causal": causal, "heads": HEADS}
    case |= time_paths(inputs, args)
    case["relative_errors"] = path_errors(inputs)
    # The bandwidth each path achieved on the least bytes the step must move (bench/harness/traffic.py).
    traffic = evolution_traffic(batch, HEADS, length, dtype)
    for path in ("triton", "torch"):
        case[f"{path}_forward_gb_s"] = traffic.forward_bytes / case[f"{path}_forward_ms"] / 1e6
        both = traffic.forward_bytes + traffic.backward_bytes
        case[f"{path}_forward_backward_gb_s"] = both / case[f"{path}_forward_backward_ms"] / 1e6
    for name in MODES.values():
        case[f"{name}_triton_over_torch"] = case[f"triton_{name}_ms"] / case[f"torch_{name}_ms"]
    return case


def load_liger() -> tuple[Any, dict[str, Any]]:
    """(Liger-Kernel's ``LigerMultiTokenAttention`` class or None, what the report says of it: whether it could be
    imported, and why not, or its class and version)."""
    import importlib
    import importlib.metadata

    module_name, class_name = LIGER_CLASS
    try:
        liger_class = getattr(importlib.import_module(module_name), class_name)
    except Exception as error:  # not installed, or its import fails (a triton or transformers it does not know)
        return None, {"available": False, "reason": f"{type(error).__name__}: {str(error)[:300]}"}
    try:
        version = importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        version = None
    return liger_class, {
        "available": True,
        "class": f"{liger_class.__module__}.{liger_class.__qualname__}",
        "version": version,
    }


def compare_liger(liger_class: Any, dtype: str, length: int, batch: int, args: argparse.Namespace) -> dict:
    """Liger's Multi-Token Attention forward plus backward against the evolution step's on both paths (centred
    3x3 kernel), in turns on the same maps (S and the upstream gradient are Liger's scores and output gradient,
    the kernel and bias its weights), and the ratios EA / Liger. A failure is recorded, and the run goes on."""
    import torch

    device = "cpu" if args.dry_run else "cuda"
    inputs = step_inputs(dtype, length, batch, False, device)
    record: dict[str, Any] = {"dtype": dtype, "n": length, "batch": batch, "heads": HEADS, "rounds": args.repeats}
    try:
        kernel = inputs["weight"].shape[-1]
        module = liger_class(HEADS, HEADS, kernel, padding=kernel // 2, bias=True)
        module = module.to(device=device, dtype=inputs["scores"].dtype)
        with torch.no_grad():
            module.weight.copy_(inputs["weight"])
            module.bias.copy_(inputs["bias"])

        def liger() -> Any:
            scores = inputs["scores"].detach().requires_grad_()
            module.zero_grad(set_to_none=True)  # fresh gradients each call, as the step's
            output = module(scores)
            output.backward(inputs["upstream"])
            return output.detach()

        def evolution_step(kernels: list) -> Callable[[], Any]:
            def step() -> Any:
                with ea.fused_kernels(kernels):
                    return evolve(inputs, "backward")

            return step

        record["liger_output_shape"] = list(liger().shape)
        steps = {"liger": liger, "triton": evolution_step([ea.triton_kernels()]), "torch": evolution_step([])}
        runs = alternating(steps, device, args.repeats, args.warmup)
        medians = {name: statistics.median(run.seconds for run in timings) for name, timings in runs.items()}
    except Exception as error:  # e.g. Liger's kernels on a triton they were not written for: recorded
        record["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        return record
    for name, seconds in medians.items():
        record[f"{name}_forward_backward_ms"] = 1000 * seconds
    for path in ("triton", "torch"):
        record[f"{path}_over_liger"] = record[f"{path}_forward_backward_ms"] / record["liger_forward_backward_ms"]
    return record


def liger_line(record: dict) -> str:
    """The printed line of a Liger comparison."""
    head = f"  Liger MTA {record['dtype']} N={record['n']} batch {record['batch']}: "
    if "error" in record:
        return head + record["error"]
    return (
        f"{head}forward+backward {record['liger_forward_backward_ms']:.3f} ms; EA step "
        f"{record['triton_forward_backward_ms']:.3f} (Triton), {record['torch_forward_backward_ms']:.3f} (torch) "
        f"ms: EA / Liger {record['triton_over_liger']:.2f} (Triton), {record['torch_over_liger']:.2f} (torch)"
    )


def forced(lists: dict[str, tuple[dict, ...]], kernel: str, config: dict) -> dict[str, tuple[dict, ...]]:
    """One dtype's configuration lists with ``kernel`` on ``config`` alone and every other kernel on its first:
    one configuration each, so that no autotune runs and the tuned-tile table cannot narrow them."""
    return {name: (config,) if name == kernel else configs[:1] for name, configs in lists.items()}


def run_sweep(dtype: str, length: int, batch: int, args: argparse.Namespace, lists: dict) -> list[dict]:
    """The Triton step's times under each configuration of each kernel's list (``lists``: the kernels' module's
    ``CONFIGS``, by dtype), one kernel at a time (:func:`forced`, the others on the first configuration of the
    lists in force): the modes of SWEEP_MODES that run the kernel, and with ``--tune`` the step's largest error
    against torch operations in float64."""
    kernels = ea.triton_kernels()
    device = "cpu" if args.dry_run else "cuda"
    inputs = step_inputs(dtype, length, batch, False, device)
    kind = "float32" if dtype == "fp32" else "half"
    rows = []
    with ea.fused_kernels([kernels]):
        for kernel, configs in lists[kind].items():
            for config in configs:
                row: dict[str, Any] = {"dtype": dtype, "n": length, "batch": batch, "kernel": kernel, "config": config}
                # The other kernels on the first of the lists in force (the module's, or the dry run's tiles).
                in_force = kernels.CONFIGS
                with ea.attributes(kernels, {"CONFIGS": {**in_force, kind: forced(in_force[kind], kernel, config)}}):
                    try:
                        for mode in SWEEP_MODES[kernel]:
                            step = functools.partial(evolve, inputs, mode)
                            row[f"{MODES[mode]}_ms"] = 1000 * median_seconds(step, device, args.repeats, args.warmup)
                        if args.tune:  # a configuration is chosen only where it computes the step right
                            row["largest_relative_error"] = max(path_errors(inputs).values())
                    except Exception as error:  # e.g. out of shared memory: recorded, the sweep goes on
                        row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                rows.append(row)
                time = row.get(f"{MODES[SWEEP_MODES[kernel][0]]}_ms", row.get("error"))
                print(f"  sweep {dtype} N={length} {kernel} {config}: {time}", flush=True)
    return rows


def tuned_entry(rows: list[dict], capability: str, bucket: int) -> dict | None:
    """The tuned-tile table's entry (``ea_hf/ops/triton/tuned_tiles.json``) for one dtype's sweep ``rows``: per
    kernel, its fastest correct configuration (by the time of its first mode in SWEEP_MODES), which narrows the
    kernel's list to itself on this GPU; None where no configuration was correct."""
    dtype = rows[0]["dtype"]
    tolerance = TUNE_TOLERANCE[dtype]
    correct = [row for row in rows if "error" not in row and row["largest_relative_error"] <= tolerance]
    chosen: dict[str, list[dict]] = {}
    for kernel, modes in SWEEP_MODES.items():
        group = [row for row in correct if row["kernel"] == kernel]
        if group:
            chosen[kernel] = [min(group, key=lambda row: row[f"{MODES[modes[0]]}_ms"])["config"]]
    if not chosen:
        return None
    return {"family": "evolution", "capability": capability, "dtype": str(torch_dtype(dtype)).removeprefix("torch."),
            "bucket": bucket, "configs": chosen,
            "chosen_on": f"N={rows[0]['n']}, batch {rows[0]['batch']}, {HEADS} heads"}  # fmt: skip


def write_tuned_table(path: str, sweeps: list[dict], capability: str) -> list[dict]:
    """The committed tuned-tile table with this GPU's entries (one per dtype, from its largest case) in place of
    any of the same key, written to ``path``; returns the new entries."""
    kernels = ea.triton_kernels()
    from ea_hf.ops.triton import common

    table = json.loads(common.TUNED_TILES_FILE.read_text())
    entries = []
    for dtype in dict.fromkeys(row["dtype"] for row in sweeps):
        rows = [row for row in sweeps if row["dtype"] == dtype]
        largest = max((row["n"], row["batch"]) for row in rows)
        entry = tuned_entry([row for row in rows if (row["n"], row["batch"]) == largest], capability,
                            kernels.tile_bucket(HEADS))  # fmt: skip
        if entry is not None:
            entries.append(entry)
    keys = ("family", "capability", "dtype", "bucket")
    kept = [old for old in table["entries"] if not any(all(old[k] == new[k] for k in keys) for new in entries)]
    table["entries"] = kept + entries
    Path(path).write_text(json.dumps(table, indent=2) + "\n")
    return entries


def run_cases(args: argparse.Namespace, liger_class: Any, lists: dict) -> tuple[list[dict], list[dict]]:
    """(every case, with Liger's comparison where asked for, and every sweep row over the configuration lists
    ``lists``), printed as they finish."""
    cases, sweeps = [], []
    for dtype in args.dtypes:
        for length, batch in args.cases:
            for causal in (False, True):
                case = run_case(dtype, length, batch, causal, args)
                cases.append(case)
                print(
                    f"{dtype} N={length} batch {batch} {'causal' if causal else 'centred'}: forward "
                    f"{case['triton_forward_ms']:.3f} vs {case['torch_forward_ms']:.3f} ms, forward+backward "
                    f"{case['triton_forward_backward_ms']:.3f} vs {case['torch_forward_backward_ms']:.3f} ms "
                    "(Triton vs torch)",
                    flush=True,
                )
                if liger_class is not None and not causal:  # Liger's kernel is centred, 3x3 as the step's
                    case["liger"] = compare = compare_liger(liger_class, dtype, length, batch, args)
                    print(liger_line(compare), flush=True)
            if args.sweep or args.tune:
                sweeps.extend(run_sweep(dtype, length, batch, args, lists))
    return cases, sweeps


def collect(args: argparse.Namespace) -> dict:
    """Every case (and sweep), printed as it finishes; the report is written at the end."""
    import torch

    ea.import_ea_hf()
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit(NO_CUDA_MESSAGE)
    liger_class, liger = load_liger() if args.liger else (None, None)
    if liger is not None and not liger["available"]:
        print(f"Liger-Kernel not timed: {liger['reason']}", flush=True)
    elapsed = stopwatch()
    lists = ea.triton_kernels().CONFIGS  # the kernels' own, which the dry run's interpreter tiles replace
    # Put back afterwards: the tests run this in their own process.
    with ea.evolution_on("triton", "cpu" if args.dry_run else "cuda"):
        cases, sweeps = run_cases(args, liger_class, lists)
    return {
        "benchmark": "one evolution step: Triton kernels vs torch operations (bench/benchmarks/triton_kernels.py)",
        "created": utc_now(),
        "gpu": None if args.dry_run else torch.cuda.get_device_name(),
        "versions": versions(),
        "settings": {
            "heads": HEADS,
            "alpha": ea.EA_ALPHA,
            "beta": ea.EA_BETA,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "dry_run": args.dry_run,
        },  # fmt: skip
        "cases": cases,
        "sweep": sweeps,
        "liger": None if liger is None else {**liger, "liger_computes": LIGER_COMPUTES, "ea_computes": EA_COMPUTES},
        "wall_time_s": elapsed(),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny maps on CPU in Triton's interpreter")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(TORCH_DTYPES), help="default fp32 bf16 (dry run: fp32)")
    parser.add_argument("--cases", nargs="+", type=parse_case, help="N:BATCH (default 512:8 2048:2)")
    parser.add_argument(
        "--sweep", action="store_true", help="also time the Triton step under each configuration of each kernel"
    )
    parser.add_argument(
        "--liger", action="store_true", help="also time Liger-Kernel's Multi-Token Attention (centred cases)"
    )
    parser.add_argument(
        "--tune",
        metavar="TABLE",
        help="sweep the configurations, check each against torch operations, and write the tuned-tile table with "
        "this GPU's fastest correct one per kernel to TABLE (copy it to ea_hf/ops/triton/tuned_tiles.json to commit "
        "it: the kernels then run it on this GPU instead of searching their lists)",
    )
    parser.add_argument("--repeats", type=int, help="timed calls (default 20; dry run 2)")
    parser.add_argument("--warmup", type=int, help="untimed calls first (default 3; dry run 1)")
    parser.add_argument("--out", help="output folder (default bench/results/<gpu name slug>, or .../cpu dry)")
    args = parser.parse_args(argv)
    args.dtypes = args.dtypes or (["fp32"] if args.dry_run else ["fp32", "bf16"])
    args.cases = args.cases or list(DRY_RUN_CASES if args.dry_run else FULL_CASES)
    args.repeats = args.repeats or (2 if args.dry_run else 20)
    args.warmup = args.warmup or (1 if args.dry_run else 3)
    return args


def torch_capability() -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = collect(args)
    if args.tune:
        capability = "interpreter" if args.dry_run else "{}.{}".format(*torch_capability())
        report["tuned_entries"] = write_tuned_table(args.tune, report["sweep"], capability)
        print(f"tuned tiles for {capability}: {report['tuned_entries']}; wrote {args.tune}")
    name = "triton_kernels_dry_run.json" if args.dry_run else "triton_kernels.json"
    folder = gpu_results_folder(args.out, report["gpu"])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wall time {report['wall_time_s']:.0f} s; wrote {folder / name}")


if __name__ == "__main__":
    main()

"""What the benchmark scripts of ``bench/`` share, written once.

- :mod:`harness.ea`: the EA settings every benchmark patches with, ``import_ea_hf``, the fused-kernel modules, the
  switches that pick an evolution path, the counters of kernel calls and the path they prove;
- :mod:`harness.models`: dtypes, model building (same random weights for every variant) and random inputs;
- :mod:`harness.timing`: one way to time a call (CUDA events on a GPU, ``time.perf_counter`` otherwise), medians,
  calls in rotating turns;
- :mod:`harness.memory`: the process's RSS (now, its peak since it started, its peak since a reset), the memory one
  call adds, and the GPU allocator's figures;
- :mod:`harness.host`: the machine and library versions, what other processes did meanwhile, result folders;
- :mod:`harness.children`: a script's internal mode run in a fresh process, its one JSON result line read back;
- :mod:`harness.tables`: cells, ratios, targets and Markdown tables;
- :mod:`harness.cli`: command-line pieces more than one script parses;
- :mod:`harness.traffic`: the least bytes and FLOPs of one layer's evolution step (roofline and achieved bandwidth).
- :mod:`harness.bytes`: the bytes one step moves, counted op by op on the meta device (the byte table);
- :mod:`harness.decoder`: the decoder benchmarks' model, decoding timed step by step, the rows EA keeps, the paired
  timing, their options and a run on a device.

The scripts (``bench/benchmarks/``, ``bench/analyses/``) are not a package: each puts ``bench/`` on ``sys.path``
and imports ``harness`` from there, and no script imports another.
"""

from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent.parent
REPO_ROOT = BENCH_DIR.parent
#: One folder per machine (bench/README.md, "Results").
RESULTS_DIR = BENCH_DIR / "results"


def is_cuda(device: object) -> bool:
    """Whether ``device`` (a torch.device or its name) is a CUDA device."""
    return str(device).split(":")[0] == "cuda"

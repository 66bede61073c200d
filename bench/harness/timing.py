"""The one way the benchmarks time a call (:func:`timed`), and what they build on it: medians, summaries, calls
in rotating turns, and a stopwatch for the wall time of a run."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from harness import is_cuda
from harness.memory import minor_faults


@dataclasses.dataclass(frozen=True)
class Timed:
    """One timed call: ``seconds`` (CUDA events on a GPU, ``time.perf_counter`` otherwise), the wall seconds
    between the synchronisations around it, this process's CPU seconds and minor page faults meanwhile, and what
    the call returned."""

    seconds: float
    wall_s: float
    cpu_s: float
    minor_faults: int
    output: Any = None


def timed(step: Callable[[], Any], device: Any = "cpu") -> Timed:
    """Time one call of ``step`` on ``device``. On CUDA, where a call returns once its kernels are queued, the
    seconds come from events recorded around it, and synchronisations make sure no earlier work is counted and all
    of the call's is."""
    cuda = is_cuda(device)
    if cuda:
        import torch

        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    faults, cpu_start, wall_start = minor_faults(), time.process_time(), time.perf_counter()
    if cuda:
        start.record()
    output = step()
    if cuda:
        end.record()
        torch.cuda.synchronize()
    wall = time.perf_counter() - wall_start
    cpu, step_faults = time.process_time() - cpu_start, minor_faults() - faults
    seconds = start.elapsed_time(end) / 1e3 if cuda else wall
    return Timed(seconds, wall, cpu, step_faults, output)


def median_seconds(step: Callable[[], Any], device: Any, repeats: int, warmup: int = 0) -> float:
    """The median seconds of ``repeats`` timed calls of ``step`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        step()
    return statistics.median(timed(step, device).seconds for _ in range(repeats))


def summary(times: Sequence[float]) -> dict[str, float]:
    """``median_s``, ``min_s``, ``mean_s`` and ``stdev_s`` (0 for a single time) of ``times``."""
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "mean_s": statistics.fmean(times),
        "stdev_s": statistics.stdev(times) if len(times) > 1 else 0.0,
    }


def rotation(names: Sequence[str], shift: int) -> list[str]:
    """``names`` rotated left by ``shift``: the order of turn ``shift`` when every name takes one a round."""
    shift %= len(names)
    return [*names[shift:], *names[:shift]]


def alternating(
    steps: dict[str, Callable[[], Any]],
    device: Any,
    repeats: int,
    warmup: int = 0,
    min_seconds: float = 0.0,
    before: Callable[[str], None] | None = None,
) -> dict[str, list[Timed]]:
    """Every step timed in turns, so that slow and fast spells of the machine (clocks, heat, neighbours) hit them
    alike: ``warmup`` untimed rounds, then at least ``repeats`` rounds, more until the timed calls took
    ``min_seconds`` in all; each round calls every step once, the order rotating by one a round. ``before(name)``
    runs ahead of each call, untimed. The calls' outputs are dropped, so that none holds memory."""
    for _ in range(warmup):
        for name, step in steps.items():
            if before is not None:
                before(name)
            step()
    runs: dict[str, list[Timed]] = {name: [] for name in steps}
    turn = 0
    while turn < repeats or sum(run.seconds for timings in runs.values() for run in timings) < min_seconds:
        for name in rotation(list(steps), turn):
            if before is not None:
                before(name)
            runs[name].append(dataclasses.replace(timed(steps[name], device), output=None))
        turn += 1
    return runs


def stopwatch() -> Callable[[], float]:
    """A function giving the seconds since this call: the wall time of a run or a process, not of a timed call."""
    start = time.perf_counter()
    return lambda: time.perf_counter() - start

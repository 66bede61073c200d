"""The machine a benchmark ran on: its processor, libraries and GPU, what other processes did while a case was
measured, the date, and where a GPU's results go."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import platform
import re
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from harness import RESULTS_DIR
from harness.ea import import_ea_hf
from harness.timing import stopwatch

#: A machine whose other processes use fewer cores than this counts as quiet (:func:`wait_until_quiet`).
QUIET_CORES = 0.15


def utc_now() -> str:
    """The date and time of a report, UTC, to the second."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def processor_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what ``platform.processor`` says."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            names = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor()


def machine_info(threads: int) -> dict:
    """The machine and libraries of a run; ``device`` says cuda wherever a GPU is visible (a report that ran
    elsewhere overwrites it)."""
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    return {
        "platform": platform.platform(),
        "processor": processor_name(),
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
    """:func:`machine_info` in one line, for the reports and plots."""
    device = info["gpu"] if info["device"] == "cuda" else f"{info['device']}, {info['threads']} threads"
    return (
        f"{info['processor'] or info['machine']} ({info['cpu_count']} CPUs), {info['platform']}, "
        f"Python {info['python']}, torch {info['torch']}, transformers {info['transformers']}, {device}"
    )


def versions() -> dict:
    """The versions a GPU result depends on: torch, triton (None without it), transformers, ea_hf, CUDA, cuDNN."""
    import torch
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "torch": torch.__version__,
        "triton": triton_version,
        "transformers": transformers.__version__,
        "ea_hf": import_ea_hf().__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
    }


def slug(name: str) -> str:
    """A folder name from a device name: ``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def gpu_results_folder(out: str | None, gpu: str | None) -> Path:
    """Where a GPU benchmark writes: ``--out``, else bench/results/<the GPU's slug>, or bench/results/cpu for a
    run without one (a dry run: not to keep)."""
    return Path(out) if out else RESULTS_DIR / (slug(gpu) if gpu else "cpu")


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


@dataclasses.dataclass
class HostActivity:
    """What the machine did while a measurement ran (:func:`host_activity`): the load averages at its start and
    end, the CPU seconds every other process used (this one's subtracted) and the hypervisor stole, and its wall
    seconds. Near 0 when the measurement had the machine to itself (/proc/stat counts in 10 ms ticks)."""

    loadavg_before: tuple[float, float, float]
    loadavg_after: tuple[float, float, float] = (0.0, 0.0, 0.0)
    other_cpu_s: float = 0.0
    steal_s: float = 0.0
    wall_s: float = 0.0

    @property
    def other_cores(self) -> float:
        """The average number of cores other processes kept busy meanwhile."""
        return self.other_cpu_s / self.wall_s


@contextlib.contextmanager
def host_activity() -> Iterator[HostActivity]:
    """A :class:`HostActivity` (yielded), filled in when the context ends."""
    activity = HostActivity(os.getloadavg())
    elapsed = stopwatch()
    busy_before, steal_before = system_cpu_seconds()
    own_before = time.process_time()
    yield activity
    activity.loadavg_after = os.getloadavg()
    activity.wall_s = elapsed()
    busy_after, steal_after = system_cpu_seconds()
    activity.other_cpu_s = max(0.0, (busy_after - busy_before) - (time.process_time() - own_before))
    activity.steal_s = steal_after - steal_before


def wait_until_quiet(max_wait_s: float, busy_cores: float = QUIET_CORES, window_s: float = 2.0) -> float:
    """Wait until the machine's other processes use less than ``busy_cores`` cores over ``window_s`` (this process
    idles meanwhile), at most ``max_wait_s``; return the seconds waited.

    Two OpenMP threads on two cores stall badly when anything else holds a core, so a case that starts on a busy
    machine measures the neighbour, not the model. The 1-min load average cannot tell: it still counts the previous
    case for a minute after it ended.
    """
    waited = stopwatch()
    while True:
        busy_before, _ = system_cpu_seconds()
        time.sleep(window_s)
        busy_after, _ = system_cpu_seconds()
        if not busy_after - busy_before >= busy_cores * window_s or waited() >= max_wait_s:  # NaN: cannot tell
            return waited()


def run_quietly(
    run: Callable[[], dict],
    what: str,
    max_wait_s: float,
    max_other_cores: float,
    retries: int,
    summary_keys: Sequence[str] = (),
) -> dict:
    """Run a measurement (``run``: its result has ``other_processes_cores``) on a quiet machine: wait up to
    ``max_wait_s`` for one first (0: do not wait), and run it again, up to ``retries`` times, if other processes
    kept more than ``max_other_cores`` busy meanwhile. Returns the least disturbed attempt, marked ``contended`` if
    even that one was, with the others summarised under ``other_attempts`` (their ``summary_keys`` too)."""
    attempts = []
    for attempt in range(retries + 1):
        waited = wait_until_quiet(max_wait_s) if max_wait_s > 0 else 0.0
        result = run()
        result["waited_for_quiet_s"] = waited
        result["attempt"] = attempt
        attempts.append(result)
        if result["other_processes_cores"] <= max_other_cores:
            break
        print(
            f"  {what}: other processes used {result['other_processes_cores']:.2f} cores meanwhile"
            + (", running it again" if attempt < retries else ""),
            flush=True,
        )
    best = min(attempts, key=lambda r: r["other_processes_cores"])
    best["contended"] = best["other_processes_cores"] > max_other_cores
    keys = ("attempt", "other_processes_cores", *summary_keys, "waited_for_quiet_s")
    best["other_attempts"] = [{key: r[key] for key in keys} for r in attempts if r is not best]
    return best

"""ea_hf as the benchmarks use it: the settings they patch with, its import, the fused kernels' modules, the
switches that pick the path the maps evolve on, and counters that prove which path ran."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from harness import REPO_ROOT

#: Every benchmark's EA: ``ea_hf.patch(model, alpha=EA_ALPHA, beta=EA_BETA)``, whose kernel is 3 x 3.
EA_ALPHA = 0.2
EA_BETA = 0.2
EA_KERNEL_SIZE = 3
#: The paths the maps evolve on (:func:`evolution_on`): torch operations, or ea_hf's Triton kernels.
PATHS = ("torch", "triton")
#: A candidate path of the decision table (:func:`evolution_on` takes it too): torch operations with the
#: convolutions on channels-last maps whose heads are padded to a multiple of 8 (``EA_HF_CHANNELS_LAST=1``).
CHANNELS_LAST_PATH = "torch-nhwc"
_ONE_PROGRAM = {"BLOCK_Q": 32, "BLOCK_K": 32, "BLOCK_TAPS": 32, "num_warps": 4, "num_stages": 3}
#: Tiles for Triton's interpreter (the Triton kernels' configuration lists, one configuration each): one program
#: per tiny map, as the interpreter runs every program in Python. The torch allocations do not depend on them.
#: On a GPU the kernels' own lists are searched.
INTERPRETER_TILES = {
    "CONFIGS": {kind: dict.fromkeys(("correlate", "input_grad", "weight_grad"), (_ONE_PROGRAM,))
                for kind in ("float32", "half")},
}  # fmt: skip
#: The same with one run of tiles for the weight gradient, for dry runs that only time: faster still, but the
#: weight gradient's partial sums (torch allocations) shrink with the runs.
DRY_RUN_TILES = {**INTERPRETER_TILES, "WEIGHT_GRAD_SPLITS": 1}


def import_ea_hf() -> ModuleType:
    """ea_hf, from this checkout where it is not installed (a lent machine runs the working tree)."""
    try:
        import ea_hf
    except ImportError:
        sys.path.insert(0, str(REPO_ROOT))
        import ea_hf
    return ea_hf


def triton_kernels() -> ModuleType:
    """ea_hf's Triton kernels of the evolution step: the module whose tiles the benchmarks set and whose entry
    points (``correlate``, ``backward``) they count. The one place the benchmarks name it."""
    import_ea_hf()
    from ea_hf.ops.triton import evolution

    return evolution


def fused_kernels(kernels: list[ModuleType]) -> contextlib.AbstractContextManager[None]:
    """The evolution step's registered fused kernels set to ``kernels`` for the duration (none: torch
    operations), then put back."""
    import_ea_hf()
    from ea_hf.modeling import kernels as registry

    return attributes(registry, {"FUSED_KERNELS": kernels})


@contextlib.contextmanager
def environment(variables: dict[str, str]) -> Iterator[None]:
    """``variables`` set in ``os.environ`` for the duration; the earlier values (or their absence) put back."""
    saved = {name: os.environ.get(name) for name in variables}
    try:
        os.environ.update(variables)
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def attributes(owner: Any, values: dict[str, Any]) -> Iterator[None]:
    """``owner``'s attributes set to ``values`` for the duration, then put back."""
    saved = {name: getattr(owner, name) for name in values}
    try:
        for name, value in values.items():
            setattr(owner, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(owner, name, value)


def path_environment(path: str | None, device_type: str) -> dict[str, str]:
    """The environment (read by ea_hf at call time) that makes EA evolve its maps on ``path``: ``torch``, ``triton``
    (on CPU tensors only under Triton's interpreter), ``torch-nhwc`` (:data:`CHANNELS_LAST_PATH`), or None for a
    model without EA (Triton off).

    Every EA path turns ea_hf's CPU kernel off, which would otherwise take float32 maps on the CPU before Triton or
    torch operations could; on CUDA it never applies."""
    variables = {"EA_HF_TRITON": "1" if path == "triton" else "0"}
    variables["EA_HF_CHANNELS_LAST"] = "1" if path == CHANNELS_LAST_PATH else "0"
    if path is not None:
        variables["EA_HF_KERNELS"] = "0"
    if path == "triton" and device_type == "cpu":
        variables["TRITON_INTERPRET"] = "1"
    return variables


@contextlib.contextmanager
def evolution_on(
    path: str | None, device_type: str, interpreter_tiles: dict[str, int] = INTERPRETER_TILES
) -> Iterator[None]:
    """:func:`path_environment` for the duration, and ``interpreter_tiles`` where Triton is interpreted; both put
    back afterwards, so that cases run in one process (and the tests beside them) do not inherit them."""
    tiles = interpreter_tiles if path == "triton" and device_type == "cpu" else {}
    with environment(path_environment(path, device_type)), attributes(triton_kernels(), tiles):
        yield


def counting(function: Callable, counts: dict[str, int], key: str) -> Callable:
    """``function``, counting its calls in ``counts[key]``: the calls that run it, not torch.compile's tracing of
    them (where the count would be a side effect dynamo refuses inside an autograd.Function or a checkpoint, and
    break the graph; a compiled graph's operators run the kernels through their bodies, which count)."""
    import torch

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            counts[key] += 1
        return function(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def counted_kernel_calls() -> Iterator[dict[str, int]]:
    """Counters (yielded) of the fused kernels' entry points while the context lasts: ``triton_correlate``,
    ``triton_backward``, ``cpu_correlate`` and ``cpu_backward``, and of the torch path's channels-last candidate
    (``channels_last_forward``, ``channels_last_backward``). ea_hf calls them through their modules (the CPU
    kernel's correlation through ``cpu_binding``), so replacing the module attributes sees every call; they are
    put back afterwards."""
    import_ea_hf()
    from ea_hf.modeling import convolution
    from ea_hf.ops.cpu import binding as cpu_binding
    from ea_hf.ops.cpu import evolution as cpu

    kernels = triton_kernels()
    points = {
        "triton_correlate": (kernels, "correlate"),
        "triton_backward": (kernels, "backward"),
        "cpu_correlate": (cpu_binding, "correlate"),
        "cpu_backward": (cpu, "backward"),
        "channels_last_forward": (convolution, "evolve_channels_last"),
        "channels_last_backward": (convolution, "backward_channels_last"),
    }
    counts = dict.fromkeys(points, 0)
    with contextlib.ExitStack() as stack:
        for key, (module, name) in points.items():
            stack.enter_context(attributes(module, {name: counting(getattr(module, name), counts, key)}))
        yield counts


def triton_calls(counts: dict[str, int]) -> int:
    """The Triton kernels' calls in :func:`counted_kernel_calls`' counts."""
    return counts["triton_correlate"] + counts["triton_backward"]


def cpu_kernel_calls(counts: dict[str, int]) -> int:
    """The CPU kernel's calls in :func:`counted_kernel_calls`' counts."""
    return counts["cpu_correlate"] + counts["cpu_backward"]


def evolution_path(evolving: bool, counts: dict[str, int], compiled: bool = False) -> str | None:
    """What evolved the maps, judged by the kernel calls counted (None where nothing evolves). ``EA_HF_TRITON=1``
    asks for the Triton kernels, but they fall back to torch operations where they do not apply: the calls tell
    which ran."""
    if not evolving:
        return None
    under = " under torch.compile" if compiled else ""
    if triton_calls(counts):
        return "Triton kernels" + under
    if cpu_kernel_calls(counts):
        return "ea_hf CPU kernel"
    if channels_last_calls(counts):
        return "torch operations, channels-last"
    return "torch operations" + under


def channels_last_calls(counts: dict[str, int]) -> int:
    """The channels-last candidate's calls in :func:`counted_kernel_calls`' counts."""
    return counts["channels_last_forward"] + counts["channels_last_backward"]

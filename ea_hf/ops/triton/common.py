"""What the Triton kernel families share: triton itself (optional), where they run, how products are multiplied,
the device function that multiplies a tile, and the jitting of a family's kernels once per interpreter setting.

**Where they run.** On CUDA the kernels take the maps where ``EA_HF_TRITON=1`` asks for them, never with
``EA_HF_TRITON=0``, and, unset, where a GPU session's decision table chose them for the GPU and the maps' precision
(:func:`by_default`, :data:`TRITON_BY_DEFAULT`: bf16 and fp16 maps on Hopper GPUs; docs/performance.md, "How the
default on CUDA is set"). CPU tensors, for tests, need ``EA_HF_TRITON=1`` and ``TRITON_INTERPRET=1``
(:func:`interpreting`), which runs the kernels in Triton's interpreter. All are read at call time
(:func:`enabled`). Without triton installed, or with one older than :data:`MIN_TRITON`, this package still
imports and no kernel applies.

**Products.** On a GPU, products of float32 maps run on tensor cores: in TF32 where
``torch.backends.cudnn.allow_tf32`` allows it (as the torch operations' cuDNN convolution does; torch's default),
else as three TF32 products (float32 accuracy); half-precision maps are multiplied in their own dtype; accumulators
are float32 (:func:`product_switches`, :func:`tile_product`).

**Jitting.** Triton decides when a function is decorated whether it will be interpreted, and tests switch
``TRITON_INTERPRET`` at run time. So a family's kernels and the device functions they call are plain functions,
wrapped by ``triton.jit`` on first use, together and once per interpreter setting (:class:`JittedPerSetting`).
Beyond those they call only Triton builtins (``tl.full``, not ``tl.zeros``; no ``tl.sum``; reductions through
``tl.reduce`` with triton's own combine functions, which the interpreter recognises without calling them): the
helpers that ``triton.language`` itself defines with ``@triton.jit`` are decorated when triton is imported, and
torch imports it early (``torch._dynamo``), usually before a test sets ``TRITON_INTERPRET``; the interpreter cannot
call them then. The kernels' annotations (``tl.constexpr``) stay unevaluated strings (``from __future__ import
annotations``), which triton reads as such, so that the kernel modules import without triton.

**Configurations.** A kernel's tiles, warps and pipeline stages are a configuration (a dict: its constexpr tiles
and the launch options ``num_warps`` and ``num_stages``). Each kernel family lists a few per kernel and map dtype;
:func:`launch_configs` is the one place that decides which of them a launch may use: the list, narrowed to those
that the tuned-tile table (:data:`TUNED_TILES_FILE`) names for the GPU's compute capability, the maps' dtype and
the family's bucket, where it names any. :func:`launch` runs the first where only one is left, in the interpreter
(which ignores tiles, and must not time configurations), where torch asks for deterministic algorithms (a search
could choose another configuration in another process, and with it another order of sums) and while a CUDA graph
is captured; elsewhere ``triton.autotune`` times each on the first call of a tuning key (the padded heads or head
size, buckets of the map's rows and columns, :func:`size_bucket`, and the maps' dtype) and keeps the fastest for
the process. Each kernel writes its outputs whole and reads none of them, so autotune's repeated launches need
neither ``reset_to_zero`` nor ``restore_value`` (both in Triton 3.6 and 3.9; in-place results go through scratch
maps, and the weight gradient's partial sums have a shape that every configuration fills).
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FunctionType, SimpleNamespace

import torch

from ...modeling.versions import release
from ..fused_step import tracing_without_kernels

#: The oldest triton the kernels compile with (the ``gpu`` extra's floor). An older one, such as the triton 3.2
#: to 3.5 that torch 2.6 to 2.9 install with themselves, counts as absent: no kernel applies (and the evolution kernels
#: warn where ``EA_HF_TRITON=1`` asked for them).
MIN_TRITON = "3.6"

try:  # optional dependency: the kernel modules must import (and decline every map) without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

#: The installed triton's version where it is older than :data:`MIN_TRITON` (then unused), else None.
TOO_OLD_TRITON = None
if triton is not None and release(triton.__version__) < release(MIN_TRITON):
    TOO_OLD_TRITON, triton, tl = triton.__version__, None, None

#: The dtypes of the maps the kernels take.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


#: The configurations chosen on GPUs (``bench/benchmarks/triton_kernels.py --tune``), read by :func:`tuned_configs`.
TUNED_TILES_FILE = Path(__file__).with_name("tuned_tiles.json")
#: A configuration's launch options; its other entries are the kernel's constexpr tiles.
LAUNCH_OPTIONS = ("num_warps", "num_stages")
#: The largest bucket of a map's side (:func:`size_bucket`): longer maps tune as this long.
MAX_SIZE_BUCKET = 4096


def tile_key(family: str, device: torch.device, dtype: torch.dtype, bucket: int) -> dict[str, object]:
    """What an entry of the tuned-tile table is keyed by: the kernel family, the GPU's compute capability
    (``"9.0"``), the maps' dtype and the family's bucket (a power of two: the padded heads of the evolution
    kernels, the padded head size of the attention tail's)."""
    major, minor = torch.cuda.get_device_capability(device)
    return {"family": family, "capability": f"{major}.{minor}", "dtype": str(dtype).removeprefix("torch."),
            "bucket": bucket}  # fmt: skip


@functools.cache
def _tuned_entries(path: Path) -> tuple[dict, ...]:
    return tuple(json.loads(path.read_text())["entries"]) if path.is_file() else ()


def tuned_configs(key: dict[str, object], path: Path | None = None) -> dict[str, list[dict]]:
    """The configurations per kernel that the table at ``path`` (:data:`TUNED_TILES_FILE`) holds for ``key`` (see
    :func:`tile_key`), or none.

    Example:
        >>> key = {"family": "evolution", "capability": "0.0", "dtype": "bfloat16", "bucket": 16}
        >>> tuned_configs(key)  # no GPU of capability 0.0 was tuned
        {}
    """
    for entry in _tuned_entries(path or TUNED_TILES_FILE):
        if all(entry.get(name) == value for name, value in key.items()):
            return {kernel: [dict(config) for config in configs] for kernel, configs in entry["configs"].items()}
    return {}


def launch_configs(
    family: str, kernel: str, listed: Sequence[dict], device: torch.device, dtype: torch.dtype, bucket: int
) -> list[dict]:
    """The configurations a launch of ``kernel`` (of ``family``) may use: ``listed`` (the family's list for the
    maps' dtype, best guess first), on a GPU narrowed to those that the tuned-tile table names for its compute
    capability, ``dtype`` and ``bucket`` (where it names none of them, the whole list). Read at call time.

    Example:
        >>> listed = [{"BLOCK": 16, "num_warps": 4, "num_stages": 3}, {"BLOCK": 32, "num_warps": 8, "num_stages": 3}]
        >>> launch_configs("evolution", "correlate", listed, torch.device("cpu"), torch.float32, 16) == listed
        True
    """
    if device.type != "cuda":
        return list(listed)
    tuned = tuned_configs(tile_key(family, device, dtype, bucket)).get(kernel, [])
    return [config for config in listed if config in tuned] or list(listed)


def padded_side(size: int) -> int:
    """``size`` padded to a power of two of at least 16, tl.dot's smallest side (the heads of the evolution's
    products, the head size of the attention tail's).

    Example:
        >>> padded_side(12), padded_side(16), padded_side(40)
        (16, 16, 64)
    """
    return max(16, 1 << (size - 1).bit_length())


def size_bucket(size: int) -> int:
    """A map side's bucket in autotune's key: its next power of two, at least 16 and at most
    :data:`MAX_SIZE_BUCKET`, so that a kernel is tuned once per bucket, not once per sequence length (as
    flash-attention's Triton kernels key on the length // 32).

    Example:
        >>> size_bucket(1), size_bucket(17), size_bucket(512), size_bucket(100_000)
        (16, 32, 512, 4096)
    """
    return min(MAX_SIZE_BUCKET, padded_side(size))


def tiles_of(config: dict) -> dict:
    """A configuration's constexpr tiles (without its launch options)."""
    return {name: value for name, value in config.items() if name not in LAUNCH_OPTIONS}


def launch(
    family: JittedPerSetting,
    name: str,
    configs: Sequence[dict],
    grid: Callable[[dict], tuple[int, ...]],
    args: tuple,
    switches: dict,
) -> None:
    """Launch ``family``'s kernel ``name`` with the positional ``args`` and constexpr ``switches`` over
    ``configs`` (:func:`launch_configs`): the first one where it is the only one, in the interpreter, where torch
    asks for deterministic algorithms, or while a CUDA graph is captured (autotune's timing launches cannot be
    captured); else the fastest, which ``triton.autotune`` finds on the first call of each tuning key (see the
    module docstring). ``grid`` maps a configuration's tiles to the launch grid."""
    kernels = family()
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    if len(configs) == 1 or interpreting() or torch.are_deterministic_algorithms_enabled() or capturing:
        getattr(kernels, name)[grid(configs[0])](*args, **switches, **configs[0])
    else:
        family.autotuned(name, configs)[grid](*args, **switches)


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``), read at call time."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


#: The environment variable that chooses the path of the maps: ``1`` the Triton kernels wherever they apply, ``0``
#: torch operations, unset the default of :func:`by_default`.
VARIABLE = "EA_HF_TRITON"

#: Where the kernels run by default (``EA_HF_TRITON`` unset): the NVIDIA GPUs (compute capability, major) and map
#: precisions for which a GPU session's decision table chose them as the fastest correct candidate
#: (``bench/benchmarks/attention_gpu.py``, ``default_choice``; docs/performance.md, "How the default on CUDA is
#: set"). The H200's table (``bench/results/nvidia-h200/decision_table.json``) chose them for bf16 and fp16 maps
#: and torch operations for fp32 ones. GPUs no table measured, and ROCm, keep torch operations.
TRITON_BY_DEFAULT = frozenset({(9, "half")})


def precision(dtype: torch.dtype) -> str:
    """The precision a map dtype belongs to, by which the kernels' configurations and the default are chosen:
    ``"float32"`` or ``"half"`` (bf16 and fp16).

    Example:
        >>> precision(torch.bfloat16), precision(torch.float32)
        ('half', 'float32')
    """
    return "float32" if dtype == torch.float32 else "half"


def requested(environment: dict[str, str] | None = None) -> bool | None:
    """What ``EA_HF_TRITON`` in ``environment`` (the process's, read at call time) asks for: True (``1``), False
    (``0``) or nothing (unset or empty: the default, :func:`by_default`).

    Example:
        >>> requested({"EA_HF_TRITON": "1"}), requested({"EA_HF_TRITON": "0"}), requested({})
        (True, False, None)
    """
    value = (os.environ if environment is None else environment).get(VARIABLE, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(
            f"{VARIABLE}={value!r}: expected 1 (the Triton kernels), 0 (torch operations) or unset (the default "
            "for the GPU and the maps' precision)"
        )
    return None if value == "" else value == "1"


@torch.compiler.assume_constant_result
def _capability_major(device: torch.device) -> int:
    # A constant of the process while torch.compile traces (the device does not change under a graph).
    return torch.cuda.get_device_capability(device)[0]


def by_default(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether maps of ``dtype`` on the CUDA ``device`` take the kernels without ``EA_HF_TRITON`` set: an NVIDIA
    GPU and precision of :data:`TRITON_BY_DEFAULT`."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return (_capability_major(device), precision(dtype)) in TRITON_BY_DEFAULT


def opted_in() -> bool:
    """Whether ``EA_HF_TRITON=1`` asks for the kernels, read at call time."""
    return requested() is True


def enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels may take maps of ``dtype`` on ``device``: a usable triton is installed, no ONNX export
    or jit trace runs (:func:`~ea_hf.ops.fused_step.tracing_without_kernels`), and on CUDA ``EA_HF_TRITON=1`` or,
    unset, :func:`by_default`; CPU tensors (for tests) need ``EA_HF_TRITON=1`` and the interpreter
    (``TRITON_INTERPRET=1``). Read at call time."""
    if triton is None or tracing_without_kernels():
        return False
    asked = requested()
    if device.type == "cpu":
        return bool(asked) and interpreting()
    if device.type != "cuda":
        return False
    return by_default(device, dtype) if asked is None else asked


def float32_precision() -> str:
    """``tl.dot``'s input precision for float32 maps, read at call time: as the torch operations' cuDNN convolution
    would multiply them, in TF32 where ``torch.backends.cudnn.allow_tf32`` (torch's default) allows it, else as three
    TF32 products (float32 accuracy; "ieee" is many times slower: docs/performance.md, "Choices in the fused kernels");
    in the interpreter always in float32 (its bfloat16 products are wrong)."""
    if interpreting():
        return "ieee"
    return "tf32" if torch.backends.cudnn.allow_tf32 else "tf32x3"


def product_switches(dtype: torch.dtype) -> dict[str, object]:
    """The constexpr switches of :func:`tile_product` for maps of ``dtype``: half-precision maps in their own dtype
    (on tensor cores where the kernels are compiled), float32 maps at :func:`float32_precision`."""
    return {
        "HALF": dtype != torch.float32,
        "TENSOR_CORES": dtype != torch.float32 and not interpreting(),
        "FP32_PRECISION": float32_precision(),
    }


def tile_product(
    left, right, acc, map_ptr, HALF: tl.constexpr, TENSOR_CORES: tl.constexpr, FP32_PRECISION: tl.constexpr
):
    """``acc + left @ right`` (float32 accumulators) as the maps of ``map_ptr`` are multiplied: half-precision
    maps round the operands to their dtype (on tensor cores where compiled); float32 maps (and the interpreter,
    whose bfloat16 products are wrong) multiply float32 operands at ``FP32_PRECISION`` (see
    :func:`product_switches`). A device function: jitted with the kernels that call it (:class:`JittedPerSetting`)."""
    if HALF:
        left, right = left.to(map_ptr.dtype.element_ty), right.to(map_ptr.dtype.element_ty)
    if TENSOR_CORES:
        acc = tl.dot(left, right, acc)
    else:
        acc = tl.dot(left.to(tl.float32), right.to(tl.float32), acc, input_precision=FP32_PRECISION)
    return acc


class JittedPerSetting:
    """A family's kernels, jitted with the device functions they call for the current ``TRITON_INTERPRET``
    setting: calling it returns them as attributes (``jitted().correlate[grid](...)``), made once per setting and
    kept, since triton.jit reads the setting itself when it wraps (the wrappers for one setting are never reused
    for the other).

    ``kernels`` (name: plain function) are functions of one module; ``helpers`` are the device functions they
    call by name, from that module or imported into it under their own names (such as :func:`tile_product`).
    ``tuning_keys`` names, per kernel, the arguments whose values key ``triton.autotune``'s choice (the maps'
    dtypes are added by autotune itself); :meth:`autotuned` wraps a compiled kernel in it."""

    def __init__(
        self,
        kernels: dict[str, FunctionType],
        helpers: tuple[FunctionType, ...],
        tuning_keys: dict[str, tuple[str, ...]] | None = None,
    ):
        modules = {kernel.__module__ for kernel in kernels.values()}
        if len(modules) != 1:
            raise ValueError(f"kernels jitted together come from one module, not {sorted(modules)}")
        self.kernels, self.helpers, self.tuning_keys = kernels, helpers, dict(tuning_keys or {})
        self._lock = threading.Lock()
        self._jitted: dict[bool, SimpleNamespace] = {}
        self._autotuned: dict[tuple, object] = {}

    def autotuned(self, name: str, configs: Sequence[dict], do_bench: Callable | None = None):
        """The kernel ``name`` under ``triton.autotune`` over ``configs``, keyed by its ``tuning_keys``: made once
        per list (and interpreter setting) and kept, with what it has measured, for the process. On a GPU the
        choices are kept in Triton's cache too (``cache_results``), so that another process takes the same
        configuration without timing them again. ``do_bench`` replaces autotune's timer (tests run it in the
        interpreter, which :func:`launch` never autotunes)."""
        kernel = getattr(self(), name)
        listed = tuple(tuple(sorted(config.items())) for config in configs)
        cache_key = (interpreting(), name, listed, do_bench)
        with self._lock:
            if cache_key not in self._autotuned:
                tuned = [
                    triton.Config(tiles_of(config), **{option: config[option] for option in LAUNCH_OPTIONS})
                    for config in configs
                ]
                self._autotuned[cache_key] = triton.autotune(
                    tuned, key=list(self.tuning_keys[name]), cache_results=True, do_bench=do_bench
                )(kernel)
            return self._autotuned[cache_key]

    def __call__(self) -> SimpleNamespace:
        if triton is None:
            raise RuntimeError("ea_hf Triton kernels need triton installed (check applicable() first)")
        interpret = interpreting()
        with self._lock:
            if interpret not in self._jitted:
                self._jitted[interpret] = self._jit_together()
            return self._jitted[interpret]

    def _jit_together(self) -> SimpleNamespace:
        """``triton.jit`` of the kernels and of their device functions, for the current interpreter setting.

        A kernel finds a device function by name in its globals, and the two must be jitted for the same setting
        (a compiled kernel cannot call an interpreted function, nor the interpreter a compiled one). So each
        function is rebuilt over a copy of the kernels' module namespace in which the helpers' names are bound to
        their jitted forms."""
        namespace = dict(next(iter(self.kernels.values())).__globals__)

        def rebuilt(fn: FunctionType) -> FunctionType:
            copy = FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
            # A launch reads which parameters are tl.constexpr from the annotations, and a new function object has
            # none: without them every constexpr would become a run-time argument, which fails to specialize on a
            # GPU for a string (FP32_PRECISION). The interpreter never binds them.
            copy.__annotations__ = dict(fn.__annotations__)
            copy.__kwdefaults__, copy.__qualname__, copy.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
            return copy

        for helper in self.helpers:
            namespace[helper.__name__] = triton.jit(rebuilt(helper))
        return SimpleNamespace(**{name: triton.jit(rebuilt(kernel)) for name, kernel in self.kernels.items()})

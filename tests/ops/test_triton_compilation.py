"""The Triton kernels compiled for an H100 without a GPU: every launch the evolution step makes, with its own
arguments and tiles, through Triton's whole compiler (to PTX, then a cubin by the ptxas triton ships).

``test_triton_kernel.py`` checks the kernels' numbers in Triton's CPU interpreter. The interpreter runs the
kernels as Python, and takes code that the compiler refuses (such as a device function jitted for the other
setting); it ignores tiles, warps and tensor cores. This module checks those where no GPU is: that the compiler
takes every kernel as launched, that a program's shared memory fits an H100, and that the products run on
tensor cores.
"""

import json
import os

import pytest
import torch
from testing import compile_for_cuda, recorded_triton_launches

from ea_hf.modeling.step import EvolutionStep, GradientIn, StepMaps
from ea_hf.modeling.versions import release
from ea_hf.ops.triton import attention_tail, common
from ea_hf.ops.triton import evolution as kernels

triton = pytest.importorskip(
    "triton", minversion=common.MIN_TRITON, reason="the Triton kernels need the optional triton package"
)

H100 = 90
#: Shared memory one program may use on an H100 (227 KiB).
H100_SHARED_MEMORY = 232448


def launches_of_one_step(monkeypatch, dtype: torch.dtype) -> list[tuple[str, tuple, dict]]:
    """The launches of a training step's evolution and of a decoding step: forward and backward with A_prev and a
    padding mask, and without either (their pointers become constexpr ``None``), and the plain correlation of a
    decoding step's kept rows (a causal 2 x 3 kernel)."""
    generator = torch.Generator().manual_seed(0)
    batch, heads, rows = 2, 12, 40
    scores, previous = (torch.randn(batch, heads, rows, rows, generator=generator).to(dtype) for _ in range(2))
    keep = torch.ones(batch, 1, rows, rows, dtype=dtype)
    weight, bias = torch.randn(heads, heads, 3, 3, generator=generator), torch.randn(heads, generator=generator)
    gate = torch.ones(scores.shape, dtype=torch.bool)

    def step():
        mixed, alone = EvolutionStep(0.3, 0.2, 1), EvolutionStep(0.0, 0.2, 1)
        kernels.evolve(mixed, StepMaps(scores, previous, keep), weight, bias, in_place=False, gate=True)
        kernels.evolve(alone, StepMaps(scores, None, None), weight, bias, in_place=False, gate=True)
        kernels.backward(mixed, StepMaps(scores, previous, keep), GradientIn(scores.clone()), gate, weight)
        kernels.backward(alone, StepMaps(scores, None, None), GradientIn(scores.clone()), gate, weight)
        kernels.convolve(scores, weight[..., 1:, :], bias, row_shift=-1)

    return recorded_triton_launches(monkeypatch, kernels, step)


def compile_launch(name: str, args: tuple, launch_kwargs: dict):
    """The kernel ``name`` compiled for an H100 as this launch would compile it: a cubin, whose program's shared
    memory fits the GPU."""
    compiled = compile_for_cuda(getattr(kernels.jitted(), name), args, launch_kwargs, capability=H100)
    assert len(compiled.asm["cubin"]) > 0
    assert 0 < compiled.metadata.shared <= H100_SHARED_MEMORY, (name, compiled.metadata.shared)
    return compiled


def tensor_core_products(compiled) -> int:
    """The tensor-core product instructions in a compiled kernel (Ampere's ``mma.sync`` or Hopper's
    ``wgmma.mma_async``, which Triton picks for tiles of 64 rows or more)."""
    ptx = compiled.asm["ptx"]
    return ptx.count("mma.sync") + ptx.count("wgmma.mma_async")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_every_launch_compiles_for_an_h100(monkeypatch, tmp_path, dtype):
    """float32 maps in TF32 (cuDNN's default) and as three TF32 products; half-precision maps in their dtype."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compiled here, not found in a cache
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the kernels jitted for a compiler, as on a GPU
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    launches = launches_of_one_step(monkeypatch, dtype)
    assert [name for name, _, _ in launches] == [
        "correlate", "correlate", "input_grad", "weight_grad", "input_grad", "weight_grad", "correlate",
    ]  # fmt: skip
    for name, args, launch_kwargs in launches:
        assert launch_kwargs["TENSOR_CORES"] == (dtype != torch.float32)
        products = tensor_core_products(compile_launch(name, args, launch_kwargs))
        assert products > 0, name  # every product on tensor cores
        if dtype == torch.float32:
            # float32 accuracy (allow_tf32 off): each product as three TF32 products.
            assert launch_kwargs["FP32_PRECISION"] == "tf32"
            exact = compile_launch(name, args, launch_kwargs | {"FP32_PRECISION": "tf32x3"})
            # Three times the product instructions, or a multiple of that where the compiler unrolls the longer
            # loop further (the float32 weight-gradient tiles of GPU_TILES: 192 against 32).
            exact_products = tensor_core_products(exact)
            assert exact_products % (3 * products) == 0, (name, exact_products, products)


@pytest.mark.parametrize(
    ("dtype", "kind"), [(torch.float32, "float32"), (torch.bfloat16, "half"), (torch.float16, "half")]
)
def test_gpu_tiles_are_module_tiles_and_apply_only_where_compiled(monkeypatch, dtype, kind):
    """A misspelt name in GPU_TILES would be ignored without a word; the interpreter keeps the module's tiles."""
    module_tiles = {name: getattr(kernels, name) for name in kernels.TILE_NAMES}
    assert kernels.GPU_TILES[kind] and set(kernels.GPU_TILES[kind]) <= set(module_tiles)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert vars(kernels.tile_settings(dtype)) == module_tiles | kernels.GPU_TILES[kind]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert vars(kernels.tile_settings(dtype)) == module_tiles


def test_compiled_under_the_triton_asked_for():
    """CI compiles the kernels under both ends of the supported Triton range (``.ci/run``): where it names the
    version it put on the path (``EA_HF_EXPECT_TRITON``), the compiler these tests use is that one."""
    expected = os.environ.get("EA_HF_EXPECT_TRITON")
    if expected is None:
        pytest.skip("EA_HF_EXPECT_TRITON not set: the installed triton is the one meant")
    assert release(triton.__version__)[: len(release(expected))] == release(expected), triton.__version__


def test_tiles_tuned_on_a_gpu_apply_to_their_capability_dtype_and_heads_only(monkeypatch, tmp_path):
    """An entry of the tuned-tile table (bench_triton_kernels.py --tune) goes over GPU_TILES where its key matches
    the launch: compiled, on a GPU of its capability, maps of its dtype, heads of its bucket; nowhere else."""
    from ea_hf.ops.triton import common

    entry = {"family": "evolution", "capability": "9.0", "dtype": "bfloat16", "bucket": 16}
    table = tmp_path / "tuned_tiles.json"
    table.write_text(json.dumps({"entries": [entry | {"tiles": {"BLOCK_ROWS": 32, "NUM_WARPS": 2}}]}))
    monkeypatch.setattr(common, "TUNED_TILES_FILE", table)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cuda, half = torch.device("cuda"), kernels.GPU_TILES["half"]
    tuned = kernels.tile_settings(torch.bfloat16, 12, cuda)
    assert (tuned.BLOCK_ROWS, tuned.NUM_WARPS, tuned.TAP_BLOCK) == (32, 2, half["TAP_BLOCK"])
    for other in [(torch.float16, 12, cuda), (torch.bfloat16, 17, cuda), (torch.bfloat16, 12, torch.device("cpu"))]:
        assert kernels.tile_settings(*other).BLOCK_ROWS == half["BLOCK_ROWS"], other
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert kernels.tile_settings(torch.bfloat16, 12, cuda).BLOCK_ROWS == half["BLOCK_ROWS"]
    monkeypatch.setattr(kernels, "GPU_TILES", kernels.NO_GPU_TILES)  # what tests and sweeps set: module tiles
    assert kernels.tile_settings(torch.bfloat16, 12, cuda).BLOCK_ROWS == kernels.BLOCK_ROWS


def test_the_shipped_tuned_tiles_name_real_tiles():
    """A misspelt tile in the committed table would be ignored without a word."""
    from ea_hf.ops.triton import common

    entries = json.loads(common.TUNED_TILES_FILE.read_text())["entries"]
    for entry in entries:
        assert {"family", "capability", "dtype", "bucket", "tiles"} <= set(entry)
        assert entry["family"] == "evolution" and set(entry["tiles"]) <= set(kernels.TILE_NAMES), entry


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "masks"),
    [(torch.float32, "padding+dropout"), (torch.bfloat16, "padding+dropout"), (torch.bfloat16, "additive")],
    ids=str,
)
def test_the_attention_tail_compiles_for_an_h100(monkeypatch, tmp_path, dtype, masks):
    """The fused attention tail's launches (forward; the row terms and backward) with grouped-query values at
    BERT-Base's head size, on the module's tiles, with a padding mask and dropout, or an additive mask alone (the
    absent maps' pointers are stand-ins, see ``attention_tail._pointers``): each compiles to a cubin whose
    shared memory fits an H100, with its products on tensor cores."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("EA_HF_TRITON", "1")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    batch, heads, rows, head_dim = 2, 12, 40, 64
    logits = torch.randn(batch, heads, rows, rows).to(dtype)
    value = torch.randn(batch, 4, rows, head_dim).to(dtype)
    output = torch.empty(batch, heads, rows, head_dim, dtype=dtype)
    stats = torch.empty(2, batch, heads, rows)
    if masks == "additive":
        allowed, additive, keep = None, torch.zeros(batch, 1, rows, rows), None
    else:
        allowed, additive = torch.ones(batch, 1, 1, rows, dtype=torch.bool), None
        keep = torch.ones(logits.shape, dtype=torch.bool)

    def step():
        attention_tail.forward(logits, allowed, additive, value, keep, 1.25)
        attention_tail.backward(logits, allowed, additive, value, keep, 1.25, stats, output, dtype)

    names = ("forward", "row_terms", "backward")
    launches = recorded_triton_launches(monkeypatch, attention_tail, step, names)
    assert [name for name, _, _ in launches] == ["forward", "row_terms", "backward"]
    for name, args, launch_kwargs in launches:
        compiled = compile_for_cuda(getattr(attention_tail.jitted(), name), args, launch_kwargs, capability=H100)
        assert len(compiled.asm["cubin"]) > 0
        assert 0 < compiled.metadata.shared <= H100_SHARED_MEMORY, (name, compiled.metadata.shared)
        assert tensor_core_products(compiled) > 0, name

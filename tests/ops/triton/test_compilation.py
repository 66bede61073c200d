"""The Triton kernels compiled for an H100 without a GPU: every launch the evolution step makes, with its own
arguments and tiles, through Triton's whole compiler (to PTX, then a cubin by the ptxas triton ships).

``test_evolution.py`` checks the kernels' numbers in Triton's CPU interpreter. The interpreter runs the
kernels as Python, and takes code that the compiler refuses (such as a device function jitted for the other
setting); it ignores tiles, warps and tensor cores. This module checks those where no GPU is: that the compiler
takes every kernel as launched, that a program's shared memory fits an H100, and that the products run on
tensor cores.
"""

import json
import os
import types

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


def launches_of_one_step(monkeypatch, dtype: torch.dtype) -> list[tuple[str, tuple, dict, list[dict]]]:
    """The launches of a training step's evolution and of a decoding step: forward and backward with A_prev and a
    padding mask, and without either (their pointers become constexpr ``None``), and the plain correlation of a
    decoding step's kept rows (a causal 2 x 3 kernel). The first launch of each kernel has every switch on."""
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


def compile_launch(family, name: str, args: tuple, launch_kwargs: dict):
    """``family``'s kernel ``name`` compiled for an H100 as this launch would compile it: a cubin, whose program's
    shared memory fits the GPU."""
    compiled = compile_for_cuda(getattr(family.jitted(), name), args, launch_kwargs, capability=H100)
    assert len(compiled.asm["cubin"]) > 0
    assert 0 < compiled.metadata.shared <= H100_SHARED_MEMORY, (name, launch_kwargs, compiled.metadata.shared)
    return compiled


def tensor_core_products(compiled) -> int:
    """The tensor-core product instructions in a compiled kernel (Ampere's ``mma.sync`` or Hopper's
    ``wgmma.mma_async``, which Triton picks for tiles of 64 rows or more)."""
    ptx = compiled.asm["ptx"]
    return ptx.count("mma.sync") + ptx.count("wgmma.mma_async")


@pytest.fixture
def compiling(monkeypatch, tmp_path):
    """Kernels jitted for a compiler, as on a GPU, compiled afresh (not found in a cache), float32 products in
    TF32 (cuDNN's default)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("EA_HF_TRITON", "1")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)


@pytest.mark.slow
@pytest.mark.usefixtures("compiling")
# The fast run compiles bf16; CI's second stage and the oldest Triton's run every dtype.
@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(torch.float32, marks=pytest.mark.full_table),
        torch.bfloat16,
        pytest.param(torch.float16, marks=pytest.mark.full_table),
    ],
    ids=str,
)
def test_every_launch_compiles_for_an_h100(monkeypatch, dtype):
    """Every launch of a step on its first configuration (what the interpreter and deterministic algorithms run):
    float32 maps in TF32 and as three TF32 products; half-precision maps in their dtype. Each launch may use
    its kernel's whole list for the dtype (no tuned entry applies off a GPU)."""
    launches = launches_of_one_step(monkeypatch, dtype)
    assert [name for name, *_ in launches] == [
        "correlate", "correlate", "input_grad", "weight_grad", "input_grad", "weight_grad", "correlate",
    ]  # fmt: skip
    kind = "float32" if dtype == torch.float32 else "half"
    for name, args, switches, configs in launches:
        assert configs == list(kernels.CONFIGS[kind][name])
        assert switches["TENSOR_CORES"] == (dtype != torch.float32)
        launch_kwargs = switches | configs[0]
        products = tensor_core_products(compile_launch(kernels, name, args, launch_kwargs))
        assert products > 0, name  # every product on tensor cores
        if dtype == torch.float32:
            # float32 accuracy (allow_tf32 off): each product as three TF32 products.
            assert switches["FP32_PRECISION"] == "tf32"
            exact = compile_launch(kernels, name, args, launch_kwargs | {"FP32_PRECISION": "tf32x3"})
            # Three times the product instructions, or a multiple of that where the compiler unrolls the longer
            # loop further.
            exact_products = tensor_core_products(exact)
            assert exact_products % (3 * products) == 0, (name, exact_products, products)


@pytest.mark.slow
@pytest.mark.full_table  # CI's second stage, and the oldest Triton's run of this file (.ci/run)
@pytest.mark.usefixtures("compiling")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_configuration_compiles_for_an_h100(monkeypatch, dtype):
    """Every configuration autotune may choose (each kernel's list past its first, which the test above
    compiles), on the kernel's launch with every switch on: a cubin whose shared memory fits an H100, its
    products on tensor cores. (float16 maps take bfloat16's list, tiles and shared memory.)"""
    first_launches = {}
    for name, args, switches, configs in launches_of_one_step(monkeypatch, dtype):
        first_launches.setdefault(name, (args, switches, configs))
    for name, (args, switches, configs) in first_launches.items():
        for config in configs[1:]:
            assert tensor_core_products(compile_launch(kernels, name, args, switches | config)) > 0, (name, config)


@pytest.mark.parametrize("family", [kernels, attention_tail], ids=lambda family: family.__name__.rsplit(".")[-1])
def test_configuration_lists_are_well_formed(family):
    """Each kernel's list, for each dtype: distinct configurations of the kernel's tiles (powers of two; a
    product's sides at least 16; the evolution's tile columns whole bytes of the packed gate), warps and stages;
    the tiles are constexprs of the kernel (a misspelt one would fail at launch, on a GPU only)."""
    for kind, lists in family.CONFIGS.items():
        assert kind in ("float32", "half") and set(lists) == set(family.jitted.kernels)
        for name, configs in lists.items():
            parameters = family.jitted.kernels[name].__annotations__
            assert len({tuple(sorted(config.items())) for config in configs}) == len(configs) >= 2, (kind, name)
            for config in configs:
                tiles = common.tiles_of(config)
                assert set(config) - set(tiles) == set(common.LAUNCH_OPTIONS), config
                assert all(parameters.get(tile) == "tl.constexpr" for tile in tiles), (name, config)
                assert all(value & (value - 1) == 0 for value in tiles.values()), config
                if family is kernels:
                    assert config["BLOCK_Q"] * config["BLOCK_K"] >= 16 and config["BLOCK_TAPS"] >= 16, config
                    assert config["BLOCK_K"] % 8 == 0, config
                else:
                    assert min(config["BLOCK_M"], config["BLOCK_N"]) >= 16, config


def test_compiled_under_the_triton_asked_for():
    """CI compiles the kernels under both ends of the supported Triton range (``.ci/run``): where it names the
    version it put on the path (``EA_HF_EXPECT_TRITON``), the compiler these tests use is that one."""
    expected = os.environ.get("EA_HF_EXPECT_TRITON")
    if expected is None:
        pytest.skip("EA_HF_EXPECT_TRITON not set: the installed triton is the one meant")
    assert release(triton.__version__)[: len(release(expected))] == release(expected), triton.__version__


def test_a_tuned_entry_narrows_the_list_on_its_capability_dtype_and_bucket_only(monkeypatch, tmp_path):
    """An entry of the tuned-tile table (bench/benchmarks/triton_kernels.py --tune) narrows a kernel's list to the
    configurations it names, on a GPU of its capability, for maps of its dtype and heads (values' head size) of
    its bucket; nowhere else. An entry that names none of the list's configurations leaves the whole list."""
    correlate, weight_grad = kernels.CONFIGS["half"]["correlate"], kernels.CONFIGS["half"]["weight_grad"]
    forward = attention_tail.CONFIGS["half"]["forward"]
    key = {"capability": "9.0", "dtype": "bfloat16"}
    entries = [
        {"family": "evolution", **key, "bucket": 16,
         "configs": {"correlate": [correlate[2]], "weight_grad": [weight_grad[1], weight_grad[3]]}},
        {"family": "evolution", **key, "bucket": 32, "configs": {"correlate": [{"BLOCK_Q": 2, "num_warps": 1}]}},
        {"family": "attention_tail", **key, "bucket": 64, "configs": {"forward": [forward[1]]}},
    ]  # fmt: skip
    table = tmp_path / "tuned_tiles.json"
    table.write_text(json.dumps({"entries": entries}))
    monkeypatch.setattr(common, "TUNED_TILES_FILE", table)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert kernels.configs("correlate", torch.bfloat16, 12, cuda) == [correlate[2]]
    assert kernels.configs("weight_grad", torch.bfloat16, 16, cuda) == [weight_grad[1], weight_grad[3]]
    assert kernels.configs("input_grad", torch.bfloat16, 12, cuda) == list(kernels.CONFIGS["half"]["input_grad"])
    assert kernels.configs("correlate", torch.bfloat16, 24, cuda) == list(correlate)  # names none of the list
    assert attention_tail.configs("forward", torch.bfloat16, 64, cuda) == [forward[1]]
    assert attention_tail.configs("forward", torch.bfloat16, 80, cuda) == list(forward)
    for other in [(torch.float16, 12, cuda), (torch.bfloat16, 17, cuda), (torch.bfloat16, 12, cpu)]:
        assert kernels.configs("correlate", *other) == list(kernels.CONFIGS["half"]["correlate"]), other
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert kernels.configs("correlate", torch.bfloat16, 12, cuda) == list(correlate)


def test_a_launch_autotunes_only_where_compiled_with_a_choice(monkeypatch):
    """``common.launch`` hands a compiled kernel with several configurations to ``triton.autotune`` (with the
    grid as a function of the chosen tiles); it launches the first configuration alone where it is the only one,
    in the interpreter, under ``torch.use_deterministic_algorithms`` and while a CUDA graph is captured."""
    launched = []

    class Family:
        def __call__(self):
            return types.SimpleNamespace(kernel=Launcher("plain"))

        def autotuned(self, name, configs):
            return Launcher(("autotuned", name, tuple(config["BLOCK"] for config in configs)))

    class Launcher:
        def __init__(self, how):
            self.how = how

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append((self.how, grid, args, kwargs))

    configs = [{"BLOCK": 16, "num_warps": 4, "num_stages": 3}, {"BLOCK": 32, "num_warps": 8, "num_stages": 2}]

    def grid(tiles):
        return (100 // tiles["BLOCK"],)

    def launch(configs, interpreting=False):
        monkeypatch.setattr(common, "interpreting", lambda: interpreting)
        common.launch(Family(), "kernel", configs, grid, (1, 2), {"SWITCH": True})
        return launched.pop()

    assert launch(configs) == (("autotuned", "kernel", (16, 32)), grid, (1, 2), {"SWITCH": True})
    first = ("plain", (6,), (1, 2), {"SWITCH": True, **configs[0]})
    assert launch(configs, interpreting=True) == first
    assert launch(configs[:1]) == first
    with monkeypatch.context() as patch:
        patch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
        assert launch(configs) == first
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert launch(configs) == first


def test_the_shipped_tuned_tiles_name_configurations_on_the_lists():
    """An entry naming a configuration that is not on its kernel's list would be ignored without a word."""
    families = {"evolution": kernels, "attention_tail": attention_tail}
    entries = json.loads(common.TUNED_TILES_FILE.read_text())["entries"]
    for entry in entries:
        assert {"family", "capability", "dtype", "bucket", "configs"} <= set(entry)
        kind = "float32" if entry["dtype"] == "float32" else "half"
        lists = families[entry["family"]].CONFIGS[kind]
        for name, configs in entry["configs"].items():
            assert configs and all(config in lists[name] for config in configs), (entry, name)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "masks"),
    [
        pytest.param(torch.float32, "padding+dropout", marks=pytest.mark.full_table),  # (fp32: CI's second stage)
        (torch.bfloat16, "padding+dropout"),
        (torch.bfloat16, "additive"),
    ],
    ids=str,
)
@pytest.mark.usefixtures("compiling")
def test_the_attention_tail_compiles_for_an_h100(monkeypatch, dtype, masks):
    """The fused attention tail's launches (forward; the row terms and backward) with grouped-query values at
    BERT-Base's head size, with a padding mask, dropout and an addend to the logits' gradient, or an additive mask
    alone (the absent maps' pointers are stand-ins, see ``attention_tail._pointers``): each compiles to a cubin
    whose shared memory fits an H100, with its products on tensor cores; with a padding mask, dropout and the addend
    (every switch on), each kernel under every configuration of its list."""
    batch, heads, rows, head_dim = 2, 12, 40, 64
    logits = torch.randn(batch, heads, rows, rows).to(dtype)
    value = torch.randn(batch, 4, rows, head_dim).to(dtype)
    output = torch.empty(batch, heads, rows, head_dim, dtype=dtype)
    stats = torch.empty(2, batch, heads, rows)
    if masks == "additive":
        allowed, additive, keep, addend = None, torch.zeros(batch, 1, rows, rows), None, None
    else:
        allowed, additive = torch.ones(batch, 1, 1, rows, dtype=torch.bool), None
        keep, addend = torch.ones(logits.shape, dtype=torch.bool), torch.zeros_like(logits)

    def step():
        attention_tail.forward(logits, allowed, additive, value, keep, 1.25)
        attention_tail.backward(logits, allowed, additive, value, keep, 1.25, stats, output, dtype, addend)

    names = ("forward", "row_terms", "backward")
    launches = recorded_triton_launches(monkeypatch, attention_tail, step, names)
    assert [name for name, *_ in launches] == ["forward", "row_terms", "backward"]
    for name, args, switches, configs in launches:
        assert configs == list(attention_tail.CONFIGS["float32" if dtype == torch.float32 else "half"][name])
        for config in configs if masks != "additive" else configs[:1]:
            assert tensor_core_products(compile_launch(attention_tail, name, args, switches | config)) > 0, name

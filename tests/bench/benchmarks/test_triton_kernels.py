"""The one-step Triton benchmark (bench/benchmarks/triton_kernels.py) in its CPU dry run: both paths run every mode,
the Triton one on the Triton kernels (in the interpreter), it agrees with the torch operations in float64, the
sweep times every tile setting, and settings and environment are put back."""

import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest
import torch
from testing import INTERPRETER_TRITON, bench_script, spy_on

from ea_hf.modeling import kernels as registry

pytest.importorskip(
    "triton", minversion=INTERPRETER_TRITON, reason="the Triton kernels need the optional triton package"
)


@pytest.fixture(scope="module")
def bench():
    return bench_script("benchmarks/triton_kernels")


@pytest.fixture(scope="module")
def triton_kernels(bench):
    """The Triton kernels' module, as the benchmark's harness finds it."""
    return bench.ea.triton_kernels()


@pytest.mark.full_table  # a dry run: CI's second stage
def test_dry_run_times_both_paths_and_tunes_the_tiles(bench, triton_kernels, tmp_path, monkeypatch):
    calls = spy_on(monkeypatch, triton_kernels)
    configs = triton_kernels.CONFIGS
    environment = {name: os.environ.get(name) for name in ("EA_HF_TRITON", "TRITON_INTERPRET")}
    registered = list(registry.FUSED_KERNELS)

    # One timed call after the warm-up (the dry run's default is two): each still runs on the kernels and is timed;
    # the interpreter's times mean nothing, and every call of the sweep is slow in it.
    table = tmp_path / "tuned_tiles.json"
    bench.main(["--dry-run", "--tune", str(table), "--repeats", "1", "--out", str(tmp_path)])

    report = json.loads((tmp_path / "triton_kernels_dry_run.json").read_text())
    assert [(c["dtype"], c["n"], c["batch"], c["causal"]) for c in report["cases"]] == [
        ("fp32", 13, 2, False),
        ("fp32", 13, 2, True),
    ]
    for case in report["cases"]:
        for path in ("triton", "torch"):
            for mode in bench.MODES.values():
                assert case[f"{path}_{mode}_ms"] > 0
        assert case["forward_triton_over_torch"] == case["triton_forward_ms"] / case["torch_forward_ms"]
        # fp32 Triton kernels against torch operations in float64: output and all four gradients.
        assert set(case["relative_errors"]) == {"output", "scores", "previous", "weight", "bias"}
        assert max(case["relative_errors"].values()) <= 1e-5
    # Every timed Triton call and the sweep ran on the kernels: per case 3 modes x (1 warm-up + 1) calls and the
    # error check; then each configuration of the correlation's list in 2 modes (forward, in place) and each of
    # the gradient kernels' lists in forward plus backward, 2 calls each, and each configuration's error check.
    lists = triton_kernels.CONFIGS["float32"]
    forward_configs = len(lists["correlate"])
    backward_configs = len(lists["input_grad"]) + len(lists["weight_grad"])
    assert calls.count("correlate") == 2 * (3 * 2 + 1) + forward_configs * (2 * 2 + 1) + backward_configs * (2 + 1)
    assert calls.count("backward") == 2 * (2 + 1) + forward_configs + backward_configs * (2 + 1)
    assert [(row["kernel"], row["config"]) for row in report["sweep"]] == [
        (kernel, config) for kernel, configs in lists.items() for config in configs
    ]
    for row in report["sweep"]:
        modes = bench.SWEEP_MODES[row["kernel"]]
        assert "error" not in row and all(row[f"{bench.MODES[mode]}_ms"] > 0 for mode in modes)
        assert row["largest_relative_error"] <= bench.TUNE_TOLERANCE["fp32"]
    # --tune: the committed table with this machine's entry, each kernel's fastest configuration by its first mode.
    fastest = {
        kernel: [min((row for row in report["sweep"] if row["kernel"] == kernel),
                     key=lambda row: row[f"{bench.MODES[modes[0]]}_ms"])["config"]]
        for kernel, modes in bench.SWEEP_MODES.items()
    }  # fmt: skip
    (entry,) = json.loads(table.read_text())["entries"]
    assert entry["configs"] == fastest and report["tuned_entries"] == [entry]
    key = {name: entry[name] for name in ("family", "capability", "dtype", "bucket")}
    assert key == {"family": "evolution", "capability": "interpreter", "dtype": "float32", "bucket": 16}
    for case in report["cases"]:  # the bandwidth each path achieved on the step's least bytes
        assert 0 < case["triton_forward_gb_s"] and 0 < case["torch_forward_backward_gb_s"]
    assert report["settings"]["dry_run"] is True and report["gpu"] is None
    defaults = bench.parse_args(["--dry-run"])  # what the dry run times without --repeats
    assert (report["settings"]["repeats"], defaults.repeats, defaults.warmup) == (1, 2, 1)
    # Put back: configurations, environment, registered kernels.
    assert triton_kernels.CONFIGS is configs
    assert {name: os.environ.get(name) for name in environment} == environment
    assert registry.FUSED_KERNELS == registered
    assert torch.is_grad_enabled()


def test_without_cuda_the_full_run_refuses(bench, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device"):
        bench.collect(bench.parse_args([]))


class StandInMultiTokenAttention(torch.nn.Module):
    """Liger-Kernel's ``LigerMultiTokenAttention`` (constructor and call) on torch operations, for the CPU, where
    its Triton kernels do not run: a causal mask, softmax over the keys, conv2d, zeros above the diagonal."""

    calls = 0

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1, bias=True,
                 sparse=False):  # fmt: skip
        super().__init__()
        self.settings = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups}
        self.weight = torch.nn.Parameter(torch.empty(out_channels, in_channels // groups, kernel_size, kernel_size))
        self.bias = torch.nn.Parameter(torch.zeros(out_channels)) if bias else None

    def forward(self, scores):
        type(self).calls += 1
        future = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
        probabilities = scores.masked_fill(future, -1e9).softmax(-1)
        return torch.nn.functional.conv2d(probabilities, self.weight, self.bias, **self.settings).masked_fill(future, 0)


@pytest.mark.full_table  # a dry run: CI's second stage
def test_liger_is_timed_in_turns_with_both_paths_on_the_centred_case(bench, triton_kernels, tmp_path, monkeypatch):
    package, transformers = types.ModuleType("liger_kernel"), types.ModuleType("liger_kernel.transformers")
    transformers.LigerMultiTokenAttention = StandInMultiTokenAttention
    monkeypatch.setitem(sys.modules, "liger_kernel", package)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", transformers)
    monkeypatch.setattr(StandInMultiTokenAttention, "calls", 0)
    calls = spy_on(monkeypatch, triton_kernels)

    bench.main(["--dry-run", "--liger", "--out", str(tmp_path)])

    report = json.loads((tmp_path / "triton_kernels_dry_run.json").read_text())
    liger = report["liger"]
    assert liger["available"] is True and liger["class"].endswith("StandInMultiTokenAttention")
    assert liger["liger_computes"] == bench.LIGER_COMPUTES and liger["ea_computes"] == bench.EA_COMPUTES
    centred, causal = report["cases"]
    assert "liger" not in causal  # Liger's kernel is centred
    compare = centred["liger"]
    assert (compare["dtype"], compare["n"], compare["batch"], compare["heads"]) == ("fp32", 13, 2, 12)
    assert compare["liger_output_shape"] == [2, 12, 13, 13]
    for path in ("liger", "triton", "torch"):
        assert compare[f"{path}_forward_backward_ms"] > 0
    for path in ("triton", "torch"):
        assert compare[f"{path}_over_liger"] == (
            compare[f"{path}_forward_backward_ms"] / compare["liger_forward_backward_ms"]
        )
    # The stand-in ran once for its output's shape, then in 1 warm-up and 2 timed rounds; the Triton path's
    # backward ran in those rounds too (besides the case's 3 calls and its error check).
    assert StandInMultiTokenAttention.calls == 1 + 1 + 2
    assert calls.count("backward") == 2 * (3 + 1) + (1 + 2)


def test_liger_not_importable_is_recorded_and_the_run_goes_on(bench, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # the import fails, installed or not
    monkeypatch.delitem(sys.modules, "liger_kernel.transformers", raising=False)

    bench.main(["--dry-run", "--liger", "--cases", "5:1", "--out", str(tmp_path)])

    report = json.loads((tmp_path / "triton_kernels_dry_run.json").read_text())
    assert report["liger"]["available"] is False
    assert report["liger"]["reason"].startswith("ModuleNotFoundError") and "liger_kernel" in report["liger"]["reason"]
    assert [case["n"] for case in report["cases"]] == [5, 5]
    assert not any("liger" in case for case in report["cases"])
    assert bench.parse_args([]).liger is False  # off unless asked for


def test_alternating_times_each_step_in_rotating_turns(bench):
    order = []
    steps = {name: lambda name=name: order.append(name) for name in "abc"}

    runs = bench.alternating(steps, "cpu", repeats=3, warmup=1)

    assert order == list("abcabcbcacab")
    assert set(runs) == set("abc") and all(len(timings) == 3 for timings in runs.values())
    assert all(run.seconds >= 0 and run.output is None for timings in runs.values() for run in timings)


LIGER_SCRIPT = """
import sys, torch
from liger_kernel.transformers import LigerMultiTokenAttention
torch.manual_seed(0)
module = LigerMultiTokenAttention(4, 4, 3, padding=1)
scores, upstream = torch.randn(2, 4, 13, 13, requires_grad=True), torch.randn(2, 4, 13, 13)
output = module(scores)
output.backward(upstream)
torch.save({"state": module.state_dict(), "scores": scores.detach(), "upstream": upstream,
            "output": output.detach(), "scores_grad": scores.grad}, sys.argv[1])
"""


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="liger-kernel is not installed")
def test_the_stand_in_computes_what_liger_computes(tmp_path):
    # Liger's kernels in the interpreter, in a process that starts with TRITON_INTERPRET=1: they call the helpers
    # (tl.max, tl.sum) that triton decorates as it is imported, for the interpreter only if it was set by then.
    environment = {**os.environ, "TRITON_INTERPRET": "1"}
    subprocess.run([sys.executable, "-c", LIGER_SCRIPT, str(tmp_path / "liger.pt")], env=environment, check=True)
    liger = torch.load(tmp_path / "liger.pt")
    stand_in = StandInMultiTokenAttention(4, 4, 3, padding=1)
    stand_in.load_state_dict(liger["state"])
    scores = liger["scores"].requires_grad_()
    output = stand_in(scores)
    output.backward(liger["upstream"])
    assert torch.allclose(output, liger["output"], atol=1e-6)
    assert torch.allclose(scores.grad, liger["scores_grad"], atol=1e-6)

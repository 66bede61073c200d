"""The one-step Triton benchmark (bench/bench_triton_kernels.py) in its CPU dry run: both paths run every mode,
the Triton one on the Triton kernels (in the interpreter), it agrees with the torch operations in float64, the
sweep times every tile setting, and settings and environment are put back."""

import json
import os

import pytest
import torch
from testing import INTERPRETER_TRITON, bench_script, spy_on

from ea_hf.modeling import convolution
from ea_hf.ops import triton_kernels

pytest.importorskip(
    "triton", minversion=INTERPRETER_TRITON, reason="the Triton kernels need the optional triton package"
)


@pytest.fixture(scope="module")
def bench():
    return bench_script("bench_triton_kernels")


def test_dry_run_times_both_paths_and_sweeps_the_tiles(bench, tmp_path, monkeypatch):
    calls = spy_on(monkeypatch, triton_kernels)
    tiles = {name: getattr(triton_kernels, name) for name in triton_kernels._TILE_NAMES}
    environment = {name: os.environ.get(name) for name in ("EA_HF_TRITON", "TRITON_INTERPRET")}
    registered = list(convolution.FUSED_KERNELS)

    bench.main(["--dry-run", "--sweep", "--out", str(tmp_path)])

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
    # Every timed Triton call and the sweep ran on the kernels: per case 3 modes x (1 warm-up + 2) calls, the
    # error check, then 8 settings x 3 modes x 3 calls; backward once per call of the backward mode.
    assert calls.count("correlate") == 2 * (3 * 3 + 1) + len(bench.SWEEP) * 3 * 3
    assert calls.count("backward") == 2 * (3 + 1) + len(bench.SWEEP) * 3
    assert [row["setting"] for row in report["sweep"]] == bench.SWEEP
    for row in report["sweep"]:
        assert "error" not in row and all(row[f"{mode}_ms"] > 0 for mode in bench.MODES.values())
    assert report["settings"]["dry_run"] is True and report["gpu"] is None
    # Put back: tiles, environment, registered kernels.
    assert {name: getattr(triton_kernels, name) for name in triton_kernels._TILE_NAMES} == tiles
    assert {name: os.environ.get(name) for name in environment} == environment
    assert convolution.FUSED_KERNELS == registered
    assert all(triton_kernels.GPU_TILES.values()) and torch.is_grad_enabled()


def test_without_cuda_the_full_run_refuses(bench, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device"):
        bench.collect(bench.parse_args([]))

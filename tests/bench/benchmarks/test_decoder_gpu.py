"""The decoder benchmark on a GPU (bench/benchmarks/decoder_gpu.py) in its dry run on the CPU: every variant timed
in turns, the ratios, the rows kept, the files; its defaults, and its refusal to start without CUDA."""

import json
import os
from pathlib import Path

import pytest
from testing import bench_harness, bench_script

LENGTHS = [16, 24]
DECODE_TOKENS = 3
RESULTS = Path(__file__).resolve().parents[3] / "bench" / "results"

#: The tiny config of bench/harness/decoder.py.
TINY = bench_harness("decoder").TINY_CONFIG


@pytest.fixture(scope="module")
def bench():
    return bench_script("benchmarks/decoder_gpu")


@pytest.fixture(scope="module")
def device_report(bench, tmp_path_factory):
    """A tiny run on the CPU, each N's paired timing in this process: what a GPU run does, less
    the allocator's memory figures (a GPU run is the same code with torch.cuda.synchronize and those figures)."""
    out = tmp_path_factory.mktemp("bench_decoder_gpu")
    args = bench.parse_args(
        ["--device", "cpu", "--tiny", "--out", str(out), "--lengths", *map(str, LENGTHS), "--threads", "1"]
        + ["--decode-tokens", str(DECODE_TOKENS), "--paired-rounds", "2"]
    )
    return bench.RUN.collect(args, paired_run=bench.run_paired_in_process), out


def test_the_gpu_protocol_times_and_compares_every_variant_on_any_device(bench, device_report):
    """The paired timing on the CPU: real times for every variant, ratios that are the medians' quotients, no
    memory figures (the CPU's allocator keeps none), and EA variants that evolved (their rows on the cache)."""
    import torch

    result, _ = device_report
    layers, heads = TINY["num_hidden_layers"], TINY["num_attention_heads"]
    assert [t["n"] for t in result["paired_timing"]] == LENGTHS
    assert result["device_name"] == "cpu" and result["torch"] == torch.__version__
    assert result["ea_hf_triton"] == os.environ.get("EA_HF_TRITON") and result["settings"]["dtype"] == "float32"
    for timing in result["paired_timing"]:
        n = timing["n"]
        assert (timing["device"], timing["dtype"], timing["rounds"]) == ("cpu", "fp32", 2)
        for variant in bench.decoder.VARIANTS:
            prefills, steps = timing["prefill_times_s"][variant], timing["decode_times_s"][variant]
            assert len(prefills) == 2 and len(steps) == 2 * DECODE_TOKENS and min(prefills + steps) > 0
            assert timing["cache_length_after_decode"][variant] == n + DECODE_TOKENS
            for what, baseline in (("prefill", "eager"), ("prefill", "sdpa"), ("decode", "eager"), ("decode", "sdpa")):
                medians = timing[f"{what}_median_s"]
                expected = medians[variant] / medians[baseline]
                assert timing[f"{what}_over_{baseline}"][variant] == pytest.approx(expected)
            assert timing["prefill_memory_added_bytes"][variant] is None
            assert timing["prefill_memory_added_mib"][variant] is None
            assert timing["prefill_memory_over_eager"][variant] is None
        assert timing["prefill_over_eager"]["eager"] == 1.0 and timing["decode_over_eager"]["eager"] == 1.0
        kept = timing["kept_rows_after_prefill"]
        assert kept["eager"] == kept["sdpa"] == {}
        assert timing["evolution_path"]["eager"] is timing["evolution_path"]["sdpa"] is None
        for variant, evolved in (("ea", list(range(layers))), ("ea-layers", list(range(0, layers, 4)))):
            assert sorted(r["layer"] for r in kept[variant].values()) == evolved
            assert all(r["shape"] == [1, heads, 1, n] for r in kept[variant].values())
            assert timing["evolution_path"][variant] in ("ea_hf CPU kernel", "torch operations")
    rows = {(r["variant"], r["n"]): r for r in result["comparison"]}
    assert rows[("ea", LENGTHS[0])]["decode_over_sdpa_paired"] == result["paired_timing"][0]["decode_over_sdpa"]["ea"]
    assert rows[("ea", LENGTHS[0])]["kept_rows_bytes_per_layer"] == heads * LENGTHS[0] * 4  # fp32 rows


def test_the_gpu_protocol_writes_its_files(bench, device_report):
    result, out = device_report
    data = json.loads((out / "bench_decoder_gpu_dry_run_tiny.json").read_text())
    assert data["settings"]["lengths"] == LENGTHS and data["parameters"] == result["parameters"] > 0
    markdown = (out / "bench_decoder_gpu_dry_run_tiny.md").read_text()
    assert "prefill peak added MiB" in markdown
    # One line per length; no memory on the CPU; kernel 3 keeps one fp32 row per head: 4 heads x 16 keys x 4 bytes.
    assert sum(line.startswith("| ea | ") for line in markdown.splitlines()) == len(LENGTHS)
    assert "| ea | 16 | " in markdown and "| - | - | - |" in markdown and "| 256 B |" in markdown


def test_the_gpu_protocol_builds_the_models_in_the_dtype_asked_for(bench):
    """bf16 reaches the models: the KV cache holds 2 bytes an element (the dtype a GPU run defaults to)."""
    timing = bench.decoder.run_paired(16, 1, 1, "bf16", "cpu", tiny=True)
    config = TINY
    kv_heads, head_dim = config["num_key_value_heads"], config["hidden_size"] // config["num_attention_heads"]
    assert timing["dtype"] == "bf16" and min(timing["prefill_median_s"].values()) > 0
    assert timing["kv_cache_bytes_per_layer"]["ea"] == [2 * kv_heads * 16 * head_dim * 2] * 4


def test_cuda_without_a_gpu_exits_with_status_2(bench, monkeypatch, capsys, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--tiny", "--out", str(tmp_path)])  # --device cuda by default
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == bench.NO_CUDA_MESSAGE + "\n" and not list(tmp_path.iterdir())


def test_gpu_defaults_and_output_paths(bench):
    args = bench.parse_args([])
    assert (args.device, args.dtype, args.lengths, args.decode_tokens, args.paired_rounds) == (
        "cuda", "bf16", [512, 2048], 16, 5
    )  # fmt: skip
    json_path, markdown_path = bench.RUN.output_paths(args, "NVIDIA H100 80GB HBM3")
    assert json_path == RESULTS / "nvidia-h100-80gb-hbm3" / "bench_decoder_gpu.json"
    assert markdown_path.name == "bench_decoder_gpu.md"
    args = bench.parse_args(["--dtype", "fp32", "--out", "elsewhere"])
    assert bench.RUN.output_paths(args, "NVIDIA H200")[0].as_posix() == "elsewhere/bench_decoder_gpu_fp32.json"
    dry = bench.parse_args(["--device", "cpu", "--tiny"])
    assert bench.RUN.output_paths(dry, None)[0] == RESULTS / "cpu" / "bench_decoder_gpu_dry_run_tiny.json"
    for bad in (["--paired-rounds", "0"], ["--device", "tpu"], ["--lengths", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)

"""The decoder benchmark (bench/bench_decoder.py) on its tiny config: every case runs, the kept rows are found and
sized, and the files are written."""

import json
import os
import sys

import pytest
from testing import bench_script

LENGTHS = [16, 24]
DECODE_TOKENS = 3


@pytest.fixture(scope="module")
def bench():
    return bench_script("bench_decoder")


@pytest.fixture(scope="module")
def report(bench, tmp_path_factory):
    """A whole tiny run, every case in this process (a fresh interpreter per case would cost its start-up)."""
    import torch

    threads = torch.get_num_threads()  # run_case sets the thread count; give the other tests theirs back
    out = tmp_path_factory.mktemp("bench_decoder")
    # One thread: two OpenMP threads stall for milliseconds per op when something else holds a core.
    args = bench.parse_args(
        ["--tiny", "--out", str(out), "--lengths", *map(str, LENGTHS), "--decode-tokens", str(DECODE_TOKENS)]
        + ["--threads", "1", "--quiet-wait", "0", "--retries", "0"]
    )
    try:
        result = bench.collect(args, run=bench.run_case_in_process, paired_run=bench.run_paired_in_process)
    finally:
        torch.set_num_threads(threads)
    return result, out


@pytest.fixture(scope="module")
def device_report(bench, tmp_path_factory):
    """A tiny --gpu-protocol run on the CPU, each N's paired timing in this process: what a GPU run does, less
    the allocator's memory figures (a GPU run is the same code with torch.cuda.synchronize and those figures)."""
    out = tmp_path_factory.mktemp("bench_decoder_gpu")
    args = bench.parse_args(
        ["--gpu-protocol", "--tiny", "--out", str(out), "--lengths", *map(str, LENGTHS), "--threads", "1"]
        + ["--decode-tokens", str(DECODE_TOKENS), "--paired-rounds", "2"]
    )
    return bench.collect_device(args, paired_run=bench.run_paired_in_process), out


def test_every_variant_and_length_has_positive_times(bench, report):
    result, _ = report
    cases = {(c["variant"], c["n"]): c for c in result["cases"]}
    assert set(cases) == {(v, n) for v in bench.VARIANTS for n in LENGTHS}
    for case in cases.values():
        assert len(case["prefill_times_s"]) == 2 and min(case["prefill_times_s"]) > 0
        assert len(case["decode_times_s"]) == DECODE_TOKENS and min(case["decode_times_s"]) > 0
        assert case["cache_length_after_decode"] == case["n"] + DECODE_TOKENS
        assert case["prefill_peak_rss_mib"] >= case["loaded_rss_mib"] > 0
        if case["variant"] in bench.EA_VARIANTS:
            assert len(case["prefill_no_cache_times_s"]) == 2 and min(case["prefill_no_cache_times_s"]) > 0
        else:
            assert case["prefill_no_cache_times_s"] == [] and case["prefill_no_cache_median_s"] is None
    rows = {(r["variant"], r["n"]): r for r in result["comparison"]}
    for n in LENGTHS:
        assert rows[("sdpa", n)]["prefill_over_sdpa"] == pytest.approx(1.0)
        assert rows[("eager", n)]["decode_over_eager"] == pytest.approx(1.0)
        ea, sdpa = cases[("ea", n)], cases[("sdpa", n)]
        assert rows[("ea", n)]["prefill_over_sdpa"] == pytest.approx(ea["prefill_median_s"] / sdpa["prefill_median_s"])


def test_the_paired_process_times_every_variant_in_turns(bench, report):
    """One paired process per N: each variant's prefills (one a round) and decoding steps, and the ratios of
    their medians, which the comparison rows and the Markdown table carry."""
    result, out = report
    rounds = result["settings"]["paired_rounds"]
    assert rounds == 2 and [p["n"] for p in result["paired_timing"]] == LENGTHS
    rows = {(r["variant"], r["n"]): r for r in result["comparison"]}
    for timing in result["paired_timing"]:
        n = timing["n"]
        assert set(timing["prefill_times_s"]) == set(bench.VARIANTS)
        for variant in bench.VARIANTS:
            prefills, steps = timing["prefill_times_s"][variant], timing["decode_times_s"][variant]
            assert len(prefills) == rounds and len(steps) == rounds * DECODE_TOKENS and min(prefills + steps) > 0
            medians = timing["prefill_median_s"]
            expected = medians[variant] / medians["sdpa"]
            assert timing["prefill_over_sdpa"][variant] == pytest.approx(expected)
            assert rows[(variant, n)]["prefill_over_sdpa_paired"] == pytest.approx(expected)
            decode = timing["decode_median_s"]
            assert rows[(variant, n)]["decode_over_eager_paired"] == pytest.approx(decode[variant] / decode["eager"])
        assert timing["decode_over_eager"]["eager"] == pytest.approx(1.0)
    markdown = (out / "decoder_cpu_tiny.md").read_text()
    assert "## Paired: every variant in one process" in markdown
    assert sum(line.startswith("| ea | ") for line in markdown.splitlines()) == 3 * len(LENGTHS)  # three tables


def test_the_gpu_protocol_times_and_compares_every_variant_on_any_device(bench, device_report):
    """run_device_paired on the CPU: real times for every variant, ratios that are the medians' quotients, no
    memory figures (the CPU's allocator keeps none), and EA variants that evolved (their rows on the cache)."""
    import torch

    result, _ = device_report
    layers, heads = bench.TINY_CONFIG["num_hidden_layers"], bench.TINY_CONFIG["num_attention_heads"]
    assert [t["n"] for t in result["paired_timing"]] == LENGTHS
    assert result["device_name"] == "cpu" and result["torch"] == torch.__version__
    assert result["ea_hf_triton"] == os.environ.get("EA_HF_TRITON") and result["settings"]["dtype"] == "float32"
    for timing in result["paired_timing"]:
        n = timing["n"]
        assert (timing["device"], timing["dtype"], timing["rounds"]) == ("cpu", "fp32", 2)
        for variant in bench.VARIANTS:
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
    timing = bench.run_device_paired(16, 1, 1, "bf16", "cpu", tiny=True)
    config = bench.TINY_CONFIG
    kv_heads, head_dim = config["num_key_value_heads"], config["hidden_size"] // config["num_attention_heads"]
    assert timing["dtype"] == "bf16" and min(timing["prefill_median_s"].values()) > 0
    assert timing["kv_cache_bytes_per_layer"]["ea"] == [2 * kv_heads * 16 * head_dim * 2] * 4


def test_cuda_without_a_gpu_exits_with_status_2(bench, monkeypatch, capsys, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--device", "cuda", "--tiny", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == bench.NO_CUDA_MESSAGE + "\n" and not list(tmp_path.iterdir())


def test_gpu_defaults_and_output_paths(bench):
    args = bench.parse_args(["--device", "cuda"])
    assert (args.dtype, args.gpu_protocol, args.lengths, args.decode_tokens) == ("bf16", True, [512, 2048], 16)
    json_path, markdown_path = bench.device_output_paths(args, "NVIDIA H100 80GB HBM3")
    assert json_path == bench.BENCH_DIR / "results" / "nvidia-h100-80gb-hbm3" / "bench_decoder_gpu.json"
    assert markdown_path.name == "bench_decoder_gpu.md"
    args = bench.parse_args(["--device", "cuda", "--dtype", "fp32", "--out", "elsewhere"])
    assert bench.device_output_paths(args, "NVIDIA H200")[0].as_posix() == "elsewhere/bench_decoder_gpu_fp32.json"
    cpu = bench.parse_args([])
    assert (cpu.dtype, cpu.gpu_protocol, cpu.out) == ("fp32", False, None)  # the CPU run as before
    for bad in (["--device", "cuda", "--case", "ea", "512"], ["--gpu-protocol", "--paired-rounds", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_without_paired_rounds_there_is_no_paired_table(bench):
    rows = bench.compare(
        [
            {
                "variant": v,
                "n": 8,
                "evolved_layers": None,
                "prefill_median_s": 1.0,
                "prefill_no_cache_median_s": None,
                "prefill_peak_above_loaded_mib": 0,
                "prefill_peak_rss_mib": 0,
                "retained_after_prefill_mib": 0,
                "decode_median_s": 0.1,
                "kv_cache_bytes_per_layer": [1],
                "kept_rows_after_prefill": {},
                "kept_rows_bytes_total": 0,
                "kept_rows_storage_bytes_total": 0,
                "kept_rows_after_decode": {},
                "loadavg_before_after": [[0.0], [0.0]],
                "other_processes_cpu_s": 0.0,
                "other_processes_cores": 0.0,
            }
            for v in bench.VARIANTS
        ],
        [8],
    )
    assert all(r["prefill_over_eager_paired"] is None for r in rows)
    assert bench.paired_table(rows) == ""


def test_kept_rows_are_sized_and_fewer_with_fewer_layers(bench, report):
    result, _ = report
    config = result["config"]
    layers, heads = bench.TINY_CONFIG["num_hidden_layers"], bench.TINY_CONFIG["num_attention_heads"]
    kv_heads, head_dim = bench.TINY_CONFIG["num_key_value_heads"], config["hidden_size"] // heads
    cases = {(c["variant"], c["n"]): c for c in result["cases"]}
    for n in LENGTHS:
        for variant in ("eager", "sdpa"):
            assert cases[(variant, n)]["kept_rows_after_prefill"] == {}
            assert cases[(variant, n)]["kept_rows_bytes_total"] == 0
        ea, partial = cases[("ea", n)], cases[("ea-layers", n)]
        assert sorted(r["layer"] for r in ea["kept_rows_after_prefill"].values()) == list(range(layers))
        assert sorted(r["layer"] for r in partial["kept_rows_after_prefill"].values()) == list(range(0, layers, 4))
        # Kernel 3: one earlier row per query head, over the N keys, fp32.
        for row in ea["kept_rows_after_prefill"].values():
            assert row["shape"] == [1, heads, 1, n] and row["bytes"] == heads * n * 4
        assert 0 < partial["kept_rows_bytes_total"] < ea["kept_rows_bytes_total"] == layers * heads * n * 4
        # Keys + values of each layer: [1, kv_heads, N, head_dim] fp32 each.
        assert ea["kv_cache_bytes_per_layer"] == [2 * kv_heads * n * head_dim * 4] * layers
        assert ea["kept_rows_storage_bytes_total"] >= ea["kept_rows_bytes_total"]


def test_files_are_written(bench, report):
    result, out = report
    data = json.loads((out / "decoder_cpu_tiny.json").read_text())
    assert data["settings"]["lengths"] == LENGTHS and len(data["cases"]) == len(bench.VARIANTS) * len(LENGTHS)
    assert len(data["loadavg"]["start"]) == 3 and data["parameters"] == result["parameters"] > 0
    markdown = (out / "decoder_cpu_tiny.md").read_text()
    cost_rows = [line for line in markdown.splitlines() if line.startswith("| ea-layers [0] |")]
    assert len(cost_rows) == 3 * len(LENGTHS)  # one line in each table per length
    assert "| ea | 16 | 4 / 4 | 256 B |" in markdown  # 4 heads x 16 keys x 4 bytes


def test_tiny_defaults_and_argument_checks(bench):
    tiny = bench.parse_args(["--tiny"])
    assert (tiny.lengths, tiny.repeats, tiny.decode_tokens, tiny.paired_rounds) == ([32, 64], 2, 4, 2)
    full = bench.parse_args([])
    assert (full.lengths, full.repeats, full.decode_tokens, full.threads, full.paired_rounds) == (
        [512, 2048],
        3,
        16,
        2,
        5,
    )
    bad_arguments = [["--case", "flash", "512"], ["--retries", "-1"], ["--lengths", "0"], ["--paired-rounds", "-1"]]
    bad_arguments += [["--paired", "0"], ["--paired", "16", "--paired-rounds", "0"]]
    for bad in bad_arguments:
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_a_disturbed_case_is_run_again_and_the_quietest_attempt_kept(bench):
    args = bench.parse_args(["--tiny", "--quiet-wait", "0", "--retries", "2", "--max-other-cores", "0.1"])
    disturbance = iter([0.9, 0.4, 0.05, 0.0])
    calls = []

    def fake_run(variant, length, _args):
        calls.append((variant, length))
        return {"other_processes_cores": next(disturbance), "prefill_median_s": 1.0, "decode_median_s": 0.1}

    best = bench.run_quietly("ea", 32, args, fake_run)
    assert calls == [("ea", 32)] * 3  # the third attempt was quiet enough: no fourth
    assert best["attempt"] == 2 and best["contended"] is False
    assert [a["other_processes_cores"] for a in best["other_attempts"]] == [0.9, 0.4]
    args.retries = 0
    assert bench.run_quietly("ea", 32, args, fake_run)["contended"] is False  # 0.0 left in the iterator
    disturbance = iter([0.5])
    assert bench.run_quietly("ea", 32, args, fake_run)["contended"] is True


@pytest.mark.slow
def test_a_case_runs_in_its_own_process(bench, tmp_path):
    """The child protocol: ``--case`` in a fresh interpreter prints one result line the parent reads."""
    args = bench.parse_args(["--tiny", "--repeats", "1", "--warmup", "0", "--decode-tokens", "2"])
    result = bench.spawn_case("ea-layers", 16, args)
    assert result["variant"] == "ea-layers" and result["n"] == 16 and result["process_wall_s"] > 0
    assert result["peak_reset"] is (sys.platform == "linux")
    assert result["prefill_peak_above_loaded_mib"] >= 0 and result["kept_rows_bytes_total"] == 4 * 16 * 4
    args.paired_rounds = 1
    paired = bench.spawn_paired(16, args)
    assert paired["n"] == 16 and paired["rounds"] == 1 and paired["process_wall_s"] > 0
    assert {len(times) for times in paired["decode_times_s"].values()} == {2}


@pytest.fixture(scope="module")
def static_report(bench, tmp_path_factory):
    """A tiny --static run on the CPU, dynamo's graphs run as they are (the eager backend: inductor would take
    minutes here), each N's paired timing in this process."""
    out = tmp_path_factory.mktemp("bench_decoder_static")
    args = bench.parse_args(
        ["--static", "--tiny", "--compile-backend", "eager", "--out", str(out), "--lengths", "16", "--threads", "1"]
        + ["--decode-tokens", str(DECODE_TOKENS), "--paired-rounds", "2"]
    )
    return bench.collect_device(args, paired_run=bench.run_paired_in_process), out


def test_static_decoding_compiles_one_graph_and_decodes_the_same_tokens(bench, static_report):
    """Every attention as it is and compiled, over three new caches (a warm-up round and two timed): one graph
    each, no recompilation between steps or caches, and the same greedy tokens as uncompiled."""
    result, _ = static_report
    (timing,) = result["paired_timing"]
    variants = ["eager", "eager-compile", "sdpa", "sdpa-compile", "ea", "ea-compile"]
    assert list(timing["prefill_times_s"]) == variants
    for variant in variants:
        prefills, steps = timing["prefill_times_s"][variant], timing["decode_times_s"][variant]
        assert len(prefills) == 2 and len(steps) == 2 * DECODE_TOKENS and min(prefills + steps) > 0
        assert timing["graphs_compiled"][variant] == (1 if variant.endswith("-compile") else 0)
        assert timing["cache_length_after_decode"][variant] == 16 + DECODE_TOKENS
    tokens = timing["decoded_tokens"]
    for attention in bench.STATIC_ATTENTIONS:
        assert tokens[f"{attention}-compile"] == tokens[attention] and len(tokens[attention]) == DECODE_TOKENS
    # The static cache's kept rows: one row per head over the whole cache plus the convolution's k // 2 columns.
    heads, layers = bench.TINY_CONFIG["num_attention_heads"], bench.TINY_CONFIG["num_hidden_layers"]
    kept = timing["kept_rows_after_prefill"]["ea-compile"]
    assert len(kept) == layers and {tuple(r["shape"]) for r in kept.values()} == {(1, heads, 1, 16 + DECODE_TOKENS + 1)}
    assert timing["evolution_path"]["sdpa-compile"] is None and timing["evolution_path"]["ea"] is not None


def test_static_decoding_is_held_against_plain_run_alike_and_the_targets(bench, static_report):
    result, out = static_report
    (timing,) = result["paired_timing"]
    decode, prefill = timing["decode_median_s"], timing["prefill_median_s"]
    rows = {r["variant"]: r for r in result["comparison"]}
    assert rows["ea-compile"]["decode_over_plain"] == pytest.approx(decode["ea-compile"] / decode["sdpa-compile"])
    assert rows["ea"]["decode_over_plain"] == pytest.approx(decode["ea"] / decode["sdpa"])
    assert rows["ea-compile"]["decode_over_as_is"] == pytest.approx(decode["ea-compile"] / decode["ea"])
    assert rows["sdpa-compile"]["decode_over_plain"] == rows["sdpa"]["decode_over_plain"] == 1.0
    assert all(row["same_tokens_as_is"] for row in rows.values())
    targets = {(t["what"], t["variant"]): t for t in result["targets"]}
    assert set(targets) == set(bench.STATIC_TARGETS)
    assert targets[("prefill", "ea")]["ratio"] == pytest.approx(prefill["ea"] / prefill["sdpa"])
    assert targets[("decode", "ea-compile")]["met"] is (rows["ea-compile"]["decode_over_plain"] <= 1.10)
    data = json.loads((out / "bench_decoder_static_dry_run_tiny.json").read_text())
    assert data["settings"]["compile_backend"] == "eager" and data["comparison"] == result["comparison"]
    markdown = (out / "bench_decoder_static_dry_run_tiny.md").read_text()
    assert 'backend="eager"' in markdown and markdown.count("(target <= ") == 2
    assert sum(line.startswith("| ea-compile | 16 | ") for line in markdown.splitlines()) == 1


def test_static_arguments(bench):
    args = bench.parse_args(["--static", "--device", "cuda", "--lengths", "512"])
    assert (args.gpu_protocol, args.compile_mode, args.compile_backend, args.dtype) == (
        True, "reduce-overhead", "inductor", "bf16"
    )  # fmt: skip
    assert bench.device_output_paths(args, "NVIDIA H200")[0].name == "bench_decoder_static.json"
    with pytest.raises(SystemExit):
        bench.parse_args(["--static", "--static-attentions", "eager", "ea"])  # no plain model to hold EA against

"""The decoder benchmark on the CPU (bench/benchmarks/decoder_cpu.py) on its tiny config: every case runs, the kept
rows are found and sized, and the files are written."""

import json
import sys

import pytest
from testing import bench_script

LENGTHS = [16, 24]
DECODE_TOKENS = 3


@pytest.fixture(scope="module")
def bench():
    return bench_script("benchmarks/decoder_cpu")


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
    assert (full.dtype, full.out) == ("fp32", None)
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
@pytest.mark.full_table  # a dry run: CI's second stage
def test_a_case_runs_in_its_own_process(bench, tmp_path):
    """The child protocol: ``--case`` in a fresh interpreter prints one result line the parent reads."""
    args = bench.parse_args(["--tiny", "--repeats", "1", "--warmup", "0", "--decode-tokens", "2"])
    result = bench.spawn_case("ea-layers", 16, args)
    assert result["variant"] == "ea-layers" and result["n"] == 16 and result["process_wall_s"] > 0
    assert result["peak_reset"] is (sys.platform == "linux")
    assert result["prefill_peak_above_loaded_mib"] >= 0 and result["kept_rows_bytes_total"] == 4 * 16 * 4
    args.paired_rounds = 1
    paired = bench.spawn_paired_on_cpu(16, args)
    assert paired["n"] == 16 and paired["rounds"] == 1 and paired["process_wall_s"] > 0
    assert {len(times) for times in paired["decode_times_s"].values()} == {2}

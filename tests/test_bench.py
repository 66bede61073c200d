"""The benchmark's bookkeeping: ratios, targets and the table from known figures (no model is run)."""

import pytest
from testing import bench_script


@pytest.fixture(scope="module")
def bench():
    return bench_script("bench_attention")


def separate_case(variant, n, mode, times, peak, before=800.0):
    return {"variant": variant, "n": n, "mode": mode, "times_s": times, "peak_mib": peak, "before_mib": before}


def test_ratios_come_from_the_paired_steps_and_memory_from_the_separate_processes(bench):
    paired = [
        {
            "n": 512,
            "mode": mode,
            "times_s": {"eager": [1.0, 2.0, 1.0], "sdpa": [0.9, 1.8, 0.9], "ea": [1.1, 2.6, 1.2]},
        }
        for mode in bench.MODES
    ]
    results = []
    for mode in bench.MODES:
        for round_peaks in ((1000.0, 1000.0, 1200.0), (1010.0, 990.0, 1300.0)):
            for variant, peak in zip(bench.VARIANTS, round_peaks, strict=True):
                results.append(separate_case(variant, 512, mode, [0.5, 0.7] if variant == "eager" else [0.6], peak))
    rows = bench.compare(results, paired, [512])
    assert [(r["n"], r["mode"]) for r in rows] == [(512, "inference"), (512, "training")]
    training = rows[1]
    assert training["eager_median_ms"] == pytest.approx(1000.0)
    assert training["ea_over_eager_time"] == pytest.approx(1.2)  # medians 1.2 / 1.0
    assert training["ea_over_eager_time_min"] == pytest.approx(1.1)
    assert training["ea_over_eager_time_paired_median"] == pytest.approx(1.2)  # ratios 1.1, 1.3, 1.2
    assert training["ea_over_eager_time_separate"] == pytest.approx(1.0)  # 0.6 / median(0.5, 0.7, 0.5, 0.7)
    assert training["ea_over_eager_peak_memory"] == pytest.approx(1300.0 / 1010.0)  # highest peaks
    assert training["ea_over_eager_memory_increment"] == pytest.approx(500.0 / 210.0)
    assert training["ea_time_target"] == 1.15 and training["ea_time_pass"] is False
    assert training["ea_memory_target"] == 1.3 and training["ea_memory_pass"] is True
    table = bench.markdown_table(rows).splitlines()
    assert len(table) == 4 and table[3].startswith("| 512 | training |")
    assert "| 1.200 | <= 1.15 FAIL |" in table[3] and "<= 1.3 pass" in table[3]


def test_quick_mode_is_a_short_smoke_run(bench):
    args = bench.parse_args(["--quick"])
    assert (args.lengths, args.repeats, args.rounds, args.paired_seconds) == ([64], 2, 1, 0.0)
    assert bench.parse_args([]).paired_seconds == 60.0

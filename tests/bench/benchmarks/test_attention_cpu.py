"""The benchmark's bookkeeping: ratios, targets and the table from known figures (no model is run)."""

import pytest
from testing import bench_script


@pytest.fixture(scope="module")
def bench():
    return bench_script("benchmarks/attention_cpu")


def separate_case(variant, n, mode, times, peak, before=800.0):
    return {"variant": variant, "n": n, "mode": mode, "times_s": times, "peak_mib": peak, "before_mib": before}


def test_ratios_come_from_the_paired_steps_and_memory_from_the_separate_processes(bench):
    paired = [
        {
            "n": 512,
            "mode": mode,
            "times_s": {"eager": [1.0, 2.0, 1.0], "sdpa": [0.9, 1.8, 0.9], "ea": [1.1, 2.6, 1.2]},
            "minor_faults": {"eager": [0, 6144, 12288], "sdpa": [5, 0, 0], "ea": [30000, 2, 1]},
        }
        for mode in bench.MODES
    ]
    results = []
    for mode in bench.MODES:
        for round_peaks in ((1000.0, 1000.0, 1200.0), (1010.0, 990.0, 1300.0)):
            for variant, peak in zip(bench.VARIANTS, round_peaks, strict=True):
                results.append(separate_case(variant, 512, mode, [0.5, 0.7] if variant == "eager" else [0.6], peak))
    rows = bench.compare(results, paired, [512], {512: 2})
    assert [(r["n"], r["mode"]) for r in rows] == [(512, "inference"), (512, "training")]
    training = rows[1]
    assert training["eager_median_ms"] == pytest.approx(1000.0)
    assert training["ea_over_eager_time"] == pytest.approx(1.2)  # medians 1.2 / 1.0
    assert training["ea_over_eager_time_per_process"] == pytest.approx([1.2])
    assert training["ea_over_eager_time_min"] == pytest.approx(1.1)
    assert training["ea_over_eager_time_paired_median"] == pytest.approx(1.2)  # ratios 1.1, 1.3, 1.2
    assert training["ea_over_eager_time_separate"] == pytest.approx(1.0)  # 0.6 / median(0.5, 0.7, 0.5, 0.7)
    faults = [training[f"{v}_minor_faults_per_step_median"] for v in ("eager", "sdpa", "ea")]
    assert faults == [6144, 0, 2]
    assert training["ea_over_eager_peak_memory"] == pytest.approx(1300.0 / 1010.0)  # highest peaks
    assert training["ea_over_eager_memory_increment"] == pytest.approx(500.0 / 210.0)
    assert training["ea_time_target"] == 1.12 and training["ea_time_pass"] is False
    # The memory target is on the step's memory (peak above the loaded model), not the total RSS.
    assert training["ea_memory_target"] == 1.2 and training["ea_memory_pass"] is False
    table = bench.comparison_table(rows).splitlines()
    assert len(table) == 4 and table[3].startswith("| 512 | 2 | training |")
    assert "| 1.200 | 1.200 | <= 1.12 FAIL | 1.333 |" in table[3]  # EA/sdpa: 1.2 / 0.9
    assert "| 210 | 500 | 2.381 | <= 1.2 FAIL | 1010 | 1300 | 1.287 |" in table[3]


def test_several_paired_processes_give_the_median_of_their_ratios(bench):
    """One paired process per round: the ratio is the median over the processes of each one's ratio of
    medians (not the ratio of pooled medians), and the table lists every process's ratio."""

    def process(eager, ea):
        return {"n": 512, "mode": "training", "times_s": {"eager": eager, "sdpa": eager, "ea": ea}}

    # Ratios of medians 1.25 (a slow process for EA), 1.05 and 1.10; pooled, the medians would give 1.5 / 1.2.
    paired = [process([1.0, 1.0, 1.0], [1.25, 1.25, 1.25]), process([2.0, 2.0], [2.1, 2.1]), process([1.2], [1.32])]
    paired += [{**p, "mode": "inference"} for p in paired]
    results = [separate_case(v, 512, mode, [1.0], 1000.0) for mode in bench.MODES for v in bench.VARIANTS]
    training = bench.compare(results, paired, [512], {512: 2})[1]
    assert training["ea_over_eager_time"] == pytest.approx(1.10)
    assert training["ea_over_eager_time_per_process"] == pytest.approx([1.25, 1.05, 1.10])
    assert training["ea_time_pass"] is True
    assert (training["eager_median_ms"], training["ea_median_ms"]) == pytest.approx((1200.0, 1320.0))
    # The step-by-step ratios pooled: 1.25 x 3, 1.05 x 2, 1.1, whose median the slow process pulls up.
    assert training["ea_over_eager_time_paired_median"] == pytest.approx(1.175)
    assert training["ea_minor_faults_per_step_median"] is None  # runs that did not record them
    assert "| 1.100 | 1.050 / 1.100 / 1.250 | <= 1.12 pass |" in bench.comparison_table([training])


def test_quick_mode_is_a_short_smoke_run(bench):
    args = bench.parse_args(["--quick"])
    assert (args.lengths, args.repeats, args.rounds, args.paired_seconds) == ([64], 2, 1, 0.0)
    assert args.compiled == []
    defaults = bench.parse_args([])
    assert defaults.paired_seconds == 300.0 and defaults.compiled == [(128, "training"), (512, "training")]
    assert bench.parse_args(["--compiled", "256", "inference"]).compiled == [(256, "inference")]
    assert bench.parse_args(["--no-compiled"]).compiled == []
    assert bench.parse_args(["--compiled-memory", "ea", "128", "training"]).compiled_memory == ["ea", "128", "training"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--compiled-memory", "sdpa", "128", "training"])  # no compiled sdpa row
    with pytest.raises(SystemExit):
        bench.parse_args(["--compiled-memory", "ea", "128", "decoding"])


def test_dropout_reaches_every_child_process(bench, monkeypatch):
    """``--dropout`` (what BERT fine-tuning runs with; 0 by default, as the targets are measured) is handed to the
    child processes that build the models."""
    assert bench.parse_args([]).dropout == 0.0
    args = bench.parse_args(["--dropout", "0.1"])
    commands = []
    monkeypatch.setattr(bench, "run_child", lambda script, arguments, threads, what: commands.append(arguments) or {})
    bench.spawn(["--paired", "512", "training"], args, "paired", 512)
    assert commands[0][commands[0].index("--dropout") + 1] == "0.1"
    for wrong in ("1.0", "-0.1"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--dropout", wrong])


def test_batches_follow_the_lengths(bench):
    defaults = bench.parse_args([])
    assert [bench.batch_of(defaults, n) for n in defaults.lengths] == [8, 2]  # the shapes
    assert [bench.batch_of(bench.parse_args(["--batches", "4"]), n) for n in (128, 512)] == [4, 4]
    chosen = bench.parse_args(["--lengths", "64", "256", "--batches", "3", "5"])
    assert [bench.batch_of(chosen, n) for n in (64, 256)] == [3, 5]
    assert [bench.batch_of(chosen, n) for n in (128, 96)] == [8, 1]  # a --compiled length outside --lengths
    with pytest.raises(SystemExit):
        bench.parse_args(["--lengths", "64", "256", "512", "--batches", "3", "5"])


def test_the_compiled_row(bench):
    timing = {"n": 128, "batch": 8, "mode": "training", "repeats": 3}
    timing["times_s"] = {"eager": [2.0, 1.0, 1.0], "ea": [1.1, 1.3, 1.2]}
    steps = {"eager": [900.0, 1000.0, 950.0], "ea": [1040.0, 1100.0, 990.0]}
    memory = {variant: {"variant": variant, "step_memory_mib": steps[variant]} for variant in steps}
    row = bench.compiled_row(timing, memory)
    assert row["ea_over_eager_compiled_time"] == pytest.approx(1.2)
    assert row["ea_over_eager_compiled_step_memory"] == pytest.approx(1.1)  # the largest step of each
    line = "| 128 | 8 | training | 1000.0 | 1200.0 | 1.200 | 1000 | 1100 | 1.100 |"
    assert bench.compiled_table([row]).splitlines()[2] == line
    earlier = bench.compiled_row(timing)  # no memory measured
    assert bench.compiled_table([row, earlier]).splitlines()[3].endswith("| 1.200 | - | - | - |")


def test_step_memory_is_what_a_step_adds_at_its_peak(bench):
    """The compiled row's memory: a step that fills 64 MiB and frees it again adds 64 MiB at its peak, and the
    peak of an earlier step does not count for the next (an empty step adds nothing after it)."""
    import torch

    def fill() -> None:  # 64 MiB of floats in 8 MiB blocks, touched
        blocks = [torch.ones(2 * 1024 * 1024) for _ in range(8)]
        del blocks

    cpu = torch.device("cpu")
    assert 62 <= bench.step_memory_mib(fill, cpu) <= 68
    assert bench.step_memory_mib(lambda: None, cpu) < 2


def test_a_profile_gives_each_operator_its_mean_time_and_calls_per_step(bench):
    import torch

    left, right = torch.randn(64, 64), torch.randn(64, 64)

    def step() -> None:
        torch.mm(left, right)
        torch.mm(right, left).softmax(-1)

    sample = bench.operator_times(step)
    assert sample["aten::mm"][1] == 2 and sample["aten::_softmax"][1] == 1
    assert all(milliseconds >= 0 for milliseconds, _ in sample.values())
    # Means over the steps, largest first, at most PROFILE_ROWS of them.
    samples = [{"a": (3.0, 2), "b": (1.0, 1)}, {"a": (5.0, 2), "c": (6.0, 4)}]
    assert bench.profile_rows(samples) == [
        {"name": "a", "self_ms_per_step": 4.0, "calls_per_step": 2.0},
        {"name": "c", "self_ms_per_step": 3.0, "calls_per_step": 2.0},
        {"name": "b", "self_ms_per_step": 0.5, "calls_per_step": 0.5},
    ]
    many = [{f"op{i}": (float(i), 1) for i in range(bench.PROFILE_ROWS + 5)}]
    assert len(bench.profile_rows(many)) == bench.PROFILE_ROWS


def test_the_kernel_alone_and_the_memory_bandwidth(bench):
    from ea_hf.ops.cpu import binding as cpu_binding

    if not cpu_binding.kernel_available():
        pytest.skip("no C++ compiler here: the fused CPU kernel cannot be built")
    import torch

    threads = torch.get_num_threads()  # both set one thread; give the other tests theirs back
    try:
        result = bench.run_kernel(64, batch=1, repeats=2, threads=1, heads=4)
        bandwidth = bench.memory_bandwidth(threads=1, mib=8, repeats=2)
    finally:
        torch.set_num_threads(threads)
    assert (result["n"], result["batch"], result["heads"], result["calls"]) == (64, 1, 4, 2)
    assert 0 < result["forward_ms"] < 1e3 and 0 < result["backward_ms"] < 1e3
    assert "builds" not in result
    assert set(bandwidth) == {"copy_gb_s", "read_gb_s"}
    assert all(0.1 < value < 1e4 for value in bandwidth.values())


def test_the_kernel_alone_against_another_build(bench, tmp_path, monkeypatch):
    """``--kernel-build``: another build of the kernel (here its lines requested into L1) timed beside the
    default one, their calls alternating; the default build is restored afterwards."""
    from ea_hf.ops.cpu import binding as cpu_binding

    if not cpu_binding.kernel_available():
        pytest.skip("no C++ compiler here: the fused CPU kernel cannot be built")
    import torch

    monkeypatch.setenv("EA_HF_CACHE", str(tmp_path))
    default, threads = cpu_binding.cpu_kernel(), torch.get_num_threads()
    try:
        result = bench.run_kernel(64, batch=1, repeats=2, threads=1, heads=4, builds=["-DEA_HF_PREFETCH_LOCALITY=3"])
    finally:
        torch.set_num_threads(threads)
    assert cpu_binding.cpu_kernel() is default
    assert 0 < result["forward_ms"] < 1e3 and 0 < result["backward_ms"] < 1e3
    ((flags, build),) = result["builds"].items()
    assert flags == "-DEA_HF_PREFETCH_LOCALITY=3"
    assert set(build) == {"forward_ms", "backward_ms"} and all(0 < value < 1e3 for value in build.values())

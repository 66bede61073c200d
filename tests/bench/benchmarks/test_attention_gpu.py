"""The GPU benchmark (bench/benchmarks/attention_gpu.py) in its CPU dry run: every case runs, the Triton variant
really runs on the Triton kernels (Triton's interpreter) and the channels-last variant on its candidate, both agree
with the torch operations, the ratios, targets, counted bytes and achieved bandwidths follow from the recorded
medians, the rule names the default, the files are written, and without CUDA the full run refuses to start."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from testing import INTERPRETER_TRITON, bench_script

BENCH_DIR = Path(__file__).resolve().parents[3] / "bench"
LENGTHS = (16, 24)
LAYERS = 2
#: Environment variables the cases set for their duration.
SETTINGS = ("EA_HF_TRITON", "EA_HF_KERNELS", "EA_HF_CHANNELS_LAST", "TRITON_INTERPRET")
#: The environment of a case on the Triton kernels, in the dry run.
TRITON_ENVIRONMENT = {"EA_HF_TRITON": "1", "EA_HF_CHANNELS_LAST": "0", "EA_HF_KERNELS": "0", "TRITON_INTERPRET": "1"}


@pytest.fixture(scope="module")
def bench():
    return bench_script("benchmarks/attention_gpu")


@pytest.fixture(scope="module")
def report(bench, tmp_path_factory):
    """The whole dry run, in this process (most of its time is torch.compile's graph capture and the interpreted
    Triton kernels)."""
    pytest.importorskip(
        "triton", minversion=INTERPRETER_TRITON, reason="the dry run's ea-triton cases need the optional triton package"
    )
    import torch

    threads = torch.get_num_threads()  # the dry run sets one thread; give the other tests theirs back
    out = tmp_path_factory.mktemp("bench_gpu")
    before = {name: os.environ.get(name) for name in SETTINGS}
    try:
        result = bench.collect(bench.parse_args(["--dry-run", "--out", str(out)]))
    finally:
        torch.set_num_threads(threads)
    result["environment_changed"] = {n: (v, os.environ.get(n)) for n, v in before.items() if os.environ.get(n) != v}
    return result, out


def cases_by_key(result):
    return {(c["variant"], c["n"], c["mode"]): c for c in result["cases"]}


def test_every_case_ran_with_positive_times(bench, report):
    result, _ = report
    cases = cases_by_key(result)
    assert set(cases) == {(v, n, m) for v in bench.VARIANTS for n in LENGTHS for m in bench.MODES}
    assert len(result["cases"]) == len(cases)
    for case in cases.values():
        assert case["status"] == "ok" and case["error"] is None, case["error"]
        assert (case["device"], case["dtype"], case["batch"]) == ("cpu", "fp32", 2)
        assert len(case["times_s"]) == 2 and min(case["times_s"]) > 0 and case["median_s"] > 0
        # CPU: no GPU memory figures, and the JSON says why.
        assert case["peak_mib"] is None and case["above_loaded_mib"] is None
        assert "null" in case["memory_source"]
        if case["mode"] == "training":
            assert case["first_loss"] > 0
    assert result["versions"]["triton"] and result["versions"]["torch"] and result["versions"]["transformers"]


def test_the_triton_variant_ran_on_the_triton_kernels_and_the_others_did_not(bench, report):
    result, _ = report
    for (variant, _n, mode), case in cases_by_key(result).items():
        calls = case["kernel_calls"]
        assert calls["cpu_correlate"] == calls["cpu_backward"] == 0  # EA_HF_KERNELS=0 for every EA variant
        if variant == "ea-triton":
            # One correlation per layer and step, and in training one backward too; warm-ups included.
            per_step = LAYERS * (2 if mode == "training" else 1)
            assert case["triton_calls"] == per_step * 3 and case["triton_calls_per_step"] == per_step
            assert case["ran_on_triton"] is True and case["evolution_path"] == "Triton kernels"
            assert calls["triton_backward"] == (LAYERS * 3 if mode == "training" else 0)
            assert case["environment"] == TRITON_ENVIRONMENT
        elif variant == "ea-triton-compile":
            # Compiled, the kernels run as operators: one correlation per layer and step in both modes (the
            # backward operator runs the kernels' backward body, which is not the counted entry point).
            assert case["triton_calls"] == LAYERS * 3 and calls["triton_backward"] == 0
            assert case["ran_on_triton"] is True and case["evolution_path"] == "Triton kernels under torch.compile"
            assert case["environment"] == TRITON_ENVIRONMENT
        else:
            assert case["triton_calls"] == 0 and case["ran_on_triton"] is False
        if variant == "ea-torch":
            assert case["evolution_path"] == "torch operations"
        if variant == "ea-torch-nhwc":
            # The candidate's forward once per layer and step, and in training its backward too; warm-ups included.
            assert calls["channels_last_forward"] == LAYERS * 3
            assert calls["channels_last_backward"] == (LAYERS * 3 if mode == "training" else 0)
            assert case["evolution_path"] == "torch operations, channels-last"
            assert case["environment"] == {"EA_HF_TRITON": "0", "EA_HF_CHANNELS_LAST": "1", "EA_HF_KERNELS": "0"}
        else:
            assert calls["channels_last_forward"] == calls["channels_last_backward"] == 0
        if variant in ("ea-compile", "ea-triton-compile"):
            compiled = case["compile"]
            assert compiled["backend"] == "eager" and compiled["failed"] is False and compiled["error"] is None
            assert compiled["unique_graphs"] > 0 and compiled["graphs_compiled_in_timed_steps"] == 0
            assert compiled["graph_breaks"] == 0, compiled["graph_break_reasons"]
        else:
            assert case["compile"] is None
    assert result["environment_changed"] == {}  # the settings of a case do not outlive it


def test_ea_torch_and_the_candidates_agree(report):
    result, _ = report
    checks = {(c["n"], c["candidate"]): c for c in result["agreement"]}
    assert set(checks) == {(n, candidate) for n in LENGTHS for candidate in ("ea-triton", "ea-torch-nhwc")}
    for (_, candidate), check in checks.items():
        assert check["status"] == "ok", check["error"]
        kind = "triton" if candidate == "ea-triton" else "channels_last"
        assert check[f"{candidate}_{kind}_calls"] > 0 and check[f"ea-torch_{kind}_calls"] == 0
        assert check["inference_max_abs_diff"] <= 1e-4 and check["training_output_max_abs_diff"] <= 1e-4
        assert check["gradient_max_rel_diff"] <= 1e-3 and check["gradient_max_abs"] > 0
        assert check["agree"] is True
    # The timed inference cases: same logits (by their checksum) on every EA path.
    cases = cases_by_key(result)
    for n in LENGTHS:
        reference = cases[("ea-torch", n, "inference")]["output_checksum"]
        for variant in ("ea-triton", "ea-torch-nhwc", "ea-compile", "ea-triton-compile"):
            assert cases[(variant, n, "inference")]["output_checksum"] == pytest.approx(reference, abs=1e-4)


def test_ratios_are_the_ratios_of_the_medians_and_targets_follow(bench, report):
    result, _ = report
    cases = cases_by_key(result)
    rows = result["comparison"]
    assert len(rows) == len(result["cases"])
    for row in rows:
        case = cases[(row["variant"], row["n"], row["mode"])]
        eager, sdpa = cases[("eager", row["n"], row["mode"])], cases[("sdpa", row["n"], row["mode"])]
        assert row["median_ms"] == pytest.approx(case["median_s"] * 1e3)
        assert row["time_over_eager"] == pytest.approx(case["median_s"] / eager["median_s"])
        assert row["time_over_sdpa"] == pytest.approx(case["median_s"] / sdpa["median_s"])
        assert row["peak_over_eager"] is None and row["memory_pass"] is None  # no memory figures on CPU
        if row["variant"] in bench.EA_VARIANTS:
            assert row["memory_target"] == 1.2
            # The tiny N stand in for 512 and 2048, whose training targets they carry.
            want = {16: 1.15, 24: 1.25}[row["n"]] if row["mode"] == "training" else None
            assert row["time_target"] == want
            assert row["time_pass"] == (None if want is None else row["time_over_eager"] <= want)
        else:
            assert row["time_target"] is None and row["memory_target"] is None
        if row["variant"] == "eager":
            assert row["time_over_eager"] == pytest.approx(1.0)


def test_counted_bytes_and_the_achieved_bandwidth(bench, report):
    """The counter's bytes for the variants it counts, over the median step: the achieved bandwidth. The candidate
    moves more than the default torch path on the meta device (its padded channels), never less."""
    result, _ = report
    cases, rows = cases_by_key(result), {(r["variant"], r["n"], r["mode"]): r for r in result["comparison"]}
    for key, case in cases.items():
        if key[0] in ("sdpa", "ea-compile", "ea-triton-compile"):
            assert case["counted_bytes"] is None and rows[key]["achieved_gb_s"] is None
            continue
        assert case["counted_bytes"] > 0 and case["bytes_source"].startswith("bench/harness/bytes.py")
        assert rows[key]["counted_gb"] == pytest.approx(case["counted_bytes"] / 1e9)
        assert rows[key]["achieved_gb_s"] == pytest.approx(case["counted_bytes"] / case["median_s"] / 1e9)
    for n in LENGTHS:
        for mode in bench.MODES:
            eager, default = cases[("eager", n, mode)], cases[("ea-torch", n, mode)]
            assert (
                eager["counted_bytes"] < default["counted_bytes"] < cases[("ea-torch-nhwc", n, mode)]["counted_bytes"]
            )


def test_the_rule_names_the_fastest_correct_candidate_of_the_dry_run(bench, report):
    result, _ = report
    choice = result["default_choice"]["float32"]  # the dry run's cases are fp32
    assert choice == bench.default_choice(result["comparison"], result["agreement"], "float32")
    assert result["default_choice"]["half"]["default"] == "ea-torch"  # no half-precision case: the reference
    assert result["default_choice"]["half"]["cases_compared"] == 0
    assert choice["correct"] == list(bench.DEFAULT_CANDIDATES) and choice["excluded"] == {}
    assert choice["cases_compared"] == len(LENGTHS) * len(bench.MODES)
    means = choice["geomean_time_over_eager"]
    assert choice["default"] == min(means, key=means.get)
    for candidate, mean in means.items():
        ratios = [r["time_over_eager"] for r in result["comparison"] if r["variant"] == candidate]
        assert mean == pytest.approx(float(np.exp(np.mean(np.log(ratios)))))


def rule_row(variant, dtype, ratio, path=None, status="ok"):
    return {
        "n": 512, "batch": 8, "dtype": dtype, "mode": "training", "variant": variant, "status": status,
        "time_over_eager": ratio, "evolution_path": path or {
            "ea-torch": "torch operations", "ea-triton": "Triton kernels",
            "ea-torch-nhwc": "torch operations, channels-last",
        }.get(variant),
    }  # fmt: skip


def test_the_rule_excludes_what_is_wrong_or_fell_back_and_takes_the_geometric_mean(bench):
    agree = [{"dtype": "bf16", "candidate": c, "status": "ok", "agree": True} for c in ("ea-triton", "ea-torch-nhwc")]
    rows = [rule_row("eager", "bf16", 1.0), rule_row("eager", "fp16", 1.0)]
    rows += [rule_row("ea-torch", "bf16", 2.0), rule_row("ea-torch", "fp16", 1.6)]
    rows += [rule_row("ea-triton", "bf16", 1.8), rule_row("ea-triton", "fp16", 1.8)]
    rows += [rule_row("ea-torch-nhwc", "bf16", 1.5), rule_row("ea-torch-nhwc", "fp16", 2.4)]

    def default_choice(rows, checks):  # bf16 and fp16 are one precision
        return bench.default_choice(rows, checks, "half")

    choice = default_choice(rows, agree)
    # Geometric means: ea-torch sqrt(3.2) = 1.789, ea-triton 1.8, ea-torch-nhwc sqrt(3.6) = 1.897.
    assert choice["default"] == "ea-torch" and choice["cases_compared"] == 2
    assert choice["geomean_time_over_eager"]["ea-torch"] == pytest.approx(3.2**0.5)
    assert [c["fastest"] for c in choice["fastest_by_case"]] == ["ea-torch-nhwc", "ea-torch"]
    faster = [*rows[:6], rule_row("ea-torch-nhwc", "bf16", 1.5), rule_row("ea-torch-nhwc", "fp16", 1.2)]
    assert default_choice(faster, agree)["default"] == "ea-torch-nhwc"
    disagreeing = [agree[0], {"dtype": "fp16", "candidate": "ea-torch-nhwc", "status": "ok", "agree": False}]
    assert default_choice(faster, disagreeing)["excluded"] == {
        "ea-torch-nhwc": "disagrees with ea-torch in an agreement check"
    }
    assert default_choice(faster, agree[:1])["excluded"] == {"ea-torch-nhwc": "no agreement check against ea-torch"}
    fell_back = [*faster[:-1], rule_row("ea-torch-nhwc", "fp16", 1.2, path="torch operations")]
    choice = default_choice(fell_back, agree)
    assert choice["excluded"] == {"ea-torch-nhwc": "1 of its cases failed or ran on another path"}
    assert choice["default"] == "ea-torch" and set(choice["geomean_time_over_eager"]) == {"ea-torch", "ea-triton"}
    # Only the cases every correct candidate ran are compared; with none, ea-torch stays the default.
    assert default_choice(rows[2:3], [])["default"] == "ea-torch"
    assert default_choice([], [])["default"] == "ea-torch"
    # Each precision is decided on its own: fp32 cases and checks change nothing in half precision, and back.
    fp32 = [rule_row("ea-torch", "fp32", 1.0), rule_row("ea-triton", "fp32", 0.5)]
    fp32_agree = [{"dtype": "fp32", "candidate": "ea-triton", "status": "ok", "agree": True}]
    half = default_choice(rows, agree)
    assert default_choice(rows + fp32, agree + fp32_agree) == half
    choices = bench.default_choices(rows + fp32, agree + fp32_agree)
    assert choices["half"] == half and choices["float32"]["default"] == "ea-triton"
    assert choices["float32"]["excluded"] == {"ea-torch-nhwc": "not in the table"}


DECISION_TABLES = sorted((BENCH_DIR / "results").glob("*/decision_table.json"))


def test_the_code_default_on_cuda_follows_every_committed_decision_table(bench):
    """ea_hf's default path on CUDA (``TRITON_BY_DEFAULT``) is, for each GPU and precision, what the rule names
    from that GPU's committed decision table, and no GPU takes the kernels by default without a table."""
    from ea_hf.ops.triton.common import TRITON_BY_DEFAULT

    assert DECISION_TABLES, "no decision table is committed under bench/results"
    decided = set()
    for path in DECISION_TABLES:
        table = json.loads(path.read_text())
        choices = bench.default_choices(table["comparison"], table["agreement"])
        assert table["default_choice"] == json.loads(json.dumps(choices)), path  # the verdict as written
        major = table["capability"][0]
        for precision, choice in choices.items():
            assert ((major, precision) in TRITON_BY_DEFAULT) == (choice["default"] == "ea-triton"), (path, precision)
            decided.add((major, precision))
    assert TRITON_BY_DEFAULT <= decided


def test_the_h200_table_chose_triton_for_half_precision_and_torch_operations_for_fp32(bench):
    """The H200's verdict, as docs/performance.md states it: in bf16 the kernels' geometric mean of step time over
    eager is the lesser (2.236x against 2.259x over three cases); in fp32 they have no agreement check."""
    table = json.loads((BENCH_DIR / "results" / "nvidia-h200" / "decision_table.json").read_text())
    half, single = table["default_choice"]["half"], table["default_choice"]["float32"]
    assert (half["default"], half["cases_compared"]) == ("ea-triton", 3)
    assert half["geomean_time_over_eager"] == pytest.approx({"ea-torch": 2.259, "ea-triton": 2.236}, abs=5e-4)
    assert single["default"] == "ea-torch"
    assert single["excluded"]["ea-triton"] == "no agreement check against ea-torch"


def test_files_are_written(bench, report):
    result, out = report
    data = json.loads((out / "bench_gpu_dry_run.json").read_text())
    assert len(data["cases"]) == len(result["cases"]) and data["settings"]["dry_run"] is True
    assert data["comparison"] == json.loads(json.dumps(result["comparison"]))
    markdown = (out / "bench_gpu_dry_run.md").read_text()
    assert "| " + " | ".join(bench.TABLE_HEADER) + " |" in markdown
    assert "Dry run on CPU" in markdown and "ea-torch vs each candidate" in markdown
    for precision, choice in result["default_choice"].items():
        assert f"- {precision} maps: **default on CUDA by this table: `{choice['default']}`.**" in markdown
    rows = len(bench.VARIANTS) * len(bench.MODES) + len(bench.CHECKED_CANDIDATES)  # + agreement
    assert sum(line.startswith("| 16 | 2 | fp32 |") for line in markdown.splitlines()) == rows
    assert "FELL BACK" not in markdown and "FAILED" not in markdown


def test_without_cuda_and_without_dry_run_it_exits_with_status_2(bench):
    environment = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        [sys.executable, str(BENCH_DIR / "benchmarks" / "attention_gpu.py")],
        capture_output=True,
        text=True,
        env=environment,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == bench.NO_CUDA_MESSAGE and done.stdout == ""


def test_a_failed_compile_is_recorded_not_raised(bench):
    """A backend that fails when dynamo hands it the first graph: the case reports the failure and its message."""
    import torch

    def failing_backend(graph_module, example_inputs):
        raise RuntimeError("backend refuses the graph")

    torch._dynamo.register_backend(failing_backend, name="ea_hf_test_failing_backend")
    args = bench.parse_args(["--dry-run", "--compile-backend", "ea_hf_test_failing_backend", "--warmup", "0"])
    threads = torch.get_num_threads()
    try:
        case = bench.run_case("ea-compile", 16, 2, "training", "fp32", args)
    finally:
        torch.set_num_threads(threads)
    assert case["status"] == "error" and case["failed_at"] == "first step" and case["median_s"] is None
    assert case["compile"]["failed"] is True and "backend refuses the graph" in case["compile"]["error"]
    row = bench.compare([case], dry_run=True)[0]
    assert row["time_over_eager"] is None and row["time_pass"] is None
    assert "compile FAILED" in bench.cases_table([row], [case])


def synthetic_case(variant, mode, median_s, peak_mib, triton_calls=0):
    return {
        "variant": variant,
        "n": 512,
        "batch": 8,
        "dtype": "bf16",
        "mode": mode,
        "status": "ok",
        "error": None,
        "median_s": median_s,
        "peak_mib": peak_mib,
        "above_loaded_mib": peak_mib - 500.0,
        "triton_calls_per_step": triton_calls,
        "ran_on_triton": triton_calls > 0,
        "compile": None,
    }


def test_gpu_figures_give_memory_ratios_and_a_silent_fallback_shows(bench):
    """What a GPU run records, made up: memory ratios and targets, and an ea-triton case without Triton calls."""
    cases = [
        synthetic_case("eager", "training", 0.100, 1000.0),
        synthetic_case("sdpa", "training", 0.080, 800.0),
        synthetic_case("ea-torch", "training", 0.110, 1300.0),
        synthetic_case("ea-triton", "training", 0.120, 1100.0, triton_calls=0),
    ]
    rows = {r["variant"]: r for r in bench.compare(cases, dry_run=False)}
    assert rows["ea-torch"]["time_over_eager"] == pytest.approx(1.1) and rows["ea-torch"]["time_pass"] is True
    assert rows["ea-torch"]["peak_over_eager"] == pytest.approx(1.3) and rows["ea-torch"]["memory_pass"] is False
    assert rows["ea-torch"]["peak_over_sdpa"] == pytest.approx(1300 / 800)
    assert rows["ea-triton"]["time_over_eager"] == pytest.approx(1.2) and rows["ea-triton"]["time_pass"] is False
    assert rows["ea-triton"]["memory_pass"] is True
    table = bench.cases_table(list(rows.values()), cases)
    assert "FELL BACK to torch operations" in table.splitlines()[-1]
    assert "<= 1.15 FAIL" in table and "<= 1.2 pass" in table


def test_resume_reuses_only_finished_cases_of_the_same_settings(bench, tmp_path):
    args = bench.parse_args(["--dry-run", "--resume"])
    done, failed = synthetic_case("eager", "inference", 0.1, 600.0), synthetic_case("sdpa", "inference", 0.1, 600.0)
    failed["status"] = "error"
    path = tmp_path / "bench_gpu_dry_run.json"
    path.write_text(json.dumps({"settings_key": bench.settings_key(args), "cases": [done, failed], "agreement": []}))
    assert bench.previous_results(path, args) == ([done], [])
    assert bench.previous_results(path, bench.parse_args(["--dry-run", "--resume", "--repeats", "5"])) == ([], [])
    assert bench.previous_results(path, bench.parse_args(["--dry-run"])) == ([], [])  # without --resume


def test_resumed_runs_of_subsets_end_in_one_file(bench, tmp_path):
    """Two commands, the second with --resume and other modes: the file has the cases of both, in order."""
    import torch

    common = ["--dry-run", "--out", str(tmp_path), "--cases", "16:2", "--variants", "sdpa", "eager"]
    threads = torch.get_num_threads()
    try:
        first = bench.collect(bench.parse_args([*common, "--modes", "training"]))
        second = bench.collect(bench.parse_args([*common, "--modes", "inference", "--resume"]))
    finally:
        torch.set_num_threads(threads)
    assert [c["variant"] for c in first["cases"]] == ["eager", "sdpa"] and first["agreement"] == []
    saved = json.loads((tmp_path / "bench_gpu_dry_run.json").read_text())
    order = [(c["mode"], c["variant"], c.get("reused_from_previous_run", False)) for c in saved["cases"]]
    assert order == [
        ("inference", "eager", False),
        ("inference", "sdpa", False),
        ("training", "eager", True),
        ("training", "sdpa", True),
    ]
    training = [c for c in second["cases"] if c["mode"] == "training"]
    assert [c["median_s"] for c in training] == [c["median_s"] for c in first["cases"]]
    assert second["comparison"][1]["time_over_eager"] == pytest.approx(
        saved["cases"][1]["median_s"] / saved["cases"][0]["median_s"]
    )


def test_defaults_output_paths_and_argument_checks(bench):
    full = bench.parse_args([])
    assert full.cases == [(512, 8), (2048, 2)] and full.dtypes == ["bf16", "fp32"]
    assert (full.repeats, full.warmup, full.compile_backend, full.optimizer) == (10, 3, "inductor", "none")
    assert full.variants == list(bench.VARIANTS) and full.modes == ["inference", "training"]
    dry = bench.parse_args(["--tiny"])
    assert dry.dry_run and dry.cases == [(16, 2), (24, 2)] and dry.dtypes == ["fp32"] and dry.threads == 1
    json_path, markdown_path = bench.output_paths(full, "NVIDIA H100 80GB HBM3")
    assert json_path == BENCH_DIR / "results" / "nvidia-h100-80gb-hbm3" / "bench_gpu.json"
    assert markdown_path.name == "bench_gpu.md"
    assert bench.output_paths(dry, None)[0] == BENCH_DIR / "results" / "cpu" / "bench_gpu_dry_run.json"
    assert bench.parse_args(["--cases", "128:4", "--out", "x"]).cases == [(128, 4)]
    for bad in (["--cases", "512"], ["--cases", "0:2"], ["--case", "flash", "16", "2", "training", "fp32"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


@pytest.mark.slow
@pytest.mark.full_table  # a dry run: CI's second stage
def test_a_case_runs_in_its_own_process(bench):
    """The --isolate protocol: ``--case`` in a fresh interpreter, which sets TRITON_INTERPRET before importing
    torch, prints one result line the parent reads."""
    pytest.importorskip(
        "triton", minversion=INTERPRETER_TRITON, reason="the ea-triton case needs the optional triton package"
    )
    args = bench.parse_args(["--dry-run", "--repeats", "1", "--warmup", "0"])
    result = bench.spawn_case("ea-triton", 16, 2, "inference", "fp32", args)
    assert result["status"] == "ok", result["error"]
    assert result["triton_calls"] == LAYERS and result["median_s"] > 0 and result["process_wall_s"] > 0

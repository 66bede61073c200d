"""The lent machines' prepared calls (bench/sessions/): every benchmark command of a session script parses,
and the GPU session's dry run runs every step."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
#: The benchmarks gpu_session.sh runs (the parsing test's expectation).
GPU_SESSION_SCRIPTS = {
    "attention_cpu",
    "attention_gpu",
    "bytes_per_step",
    "decoder_gpu",
    "decoder_static",
    "triton_kernels",
}

#: A stand-in for the machine's Python: it parses a benchmark's arguments with the script's own parser (and
#: records them, or the failure) and runs nothing else.
PARSING_PYTHON = """
import importlib.util, json, pathlib, sys
args, folder = sys.argv[1:], pathlib.Path(sys.argv[0]).parent
if args and args[0].startswith("bench/") and args[0].endswith(".py"):
    name = pathlib.Path(args[0]).stem
    spec = importlib.util.spec_from_file_location(name, args[0])
    sys.modules[name] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        module.parse_args(args[1:])
    except SystemExit:
        (folder / "failed.log").open("a").write(json.dumps(args) + "\\n")
        raise
    (folder / "parsed.log").open("a").write(json.dumps(args) + "\\n")
"""


@pytest.mark.parametrize(
    ("session", "scripts"),
    [
        ("gpu_session.sh", GPU_SESSION_SCRIPTS),
        ("cpu_host_session.sh", {"attention_cpu"}),
    ],
)
def test_every_command_of_a_session_script_parses(tmp_path, session, scripts):
    """A lent machine's minutes are few: the prepared script, run as written with a Python that only parses
    the benchmarks' arguments, reaches every benchmark step, and each takes its arguments (argparse would exit
    on one it does not know, and the step would be lost)."""
    (tmp_path / "parse.py").write_text(PARSING_PYTHON)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {tmp_path / "parse.py"} "$@"\n')
    python.chmod(0o755)
    environment = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": str(python)}
    subprocess.run(["bash", f"bench/sessions/{session}"], cwd=REPO, env=environment, capture_output=True, timeout=120)
    assert not (tmp_path / "failed.log").exists(), (tmp_path / "failed.log").read_text()
    parsed = [json.loads(line) for line in (tmp_path / "parsed.log").read_text().splitlines()]
    assert {Path(args[0]).stem for args in parsed} == scripts


@pytest.mark.slow
@pytest.mark.full_table  # (CI's second stage: test_every_command_of_a_session_script_parses covers its arguments)
def test_the_gpu_session_dry_run_runs_every_step(tmp_path):
    """``DRY_RUN=1 bash bench/sessions/gpu_session.sh``: every step's CPU dry run (Triton's interpreter, tiny
    models) ends within its limit and leaves its results in the one tarball that comes back, the tuned-tile table
    included."""
    environment = {**os.environ, "OUT": str(tmp_path), "DRY_RUN": "1", "PYTHON": sys.executable}
    completed = subprocess.run(
        ["bash", "bench/sessions/gpu_session.sh"], cwd=REPO, env=environment, capture_output=True, text=True,
        timeout=1800,  # the dry run's step limits added up
    )  # fmt: skip
    assert completed.returncode == 0, completed.stdout[-3000:]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["gpu_session.tgz", "session.log"]
    with tarfile.open(tmp_path / "gpu_session.tgz") as archive:
        names = set(archive.getnames())
        statuses = {
            name.split("/")[0]: archive.extractfile(name).read().decode().split()
            for name in names
            if name.endswith("status.txt")
        }
        table = json.loads(archive.extractfile("c_tune/tuned_tiles.json").read())
        decisions = json.loads(archive.extractfile("b_table/512/bench_gpu_dry_run.json").read())
        merged = json.loads(archive.extractfile("b_table/decision_table.json").read())
        counted = json.loads(archive.extractfile("b_table/bytes/bench_bytes.json").read())
    assert statuses == {"a_smoke": ["0"], "b_table": ["0"] * 5, "c_tune": ["0"], "e_decoder": ["0", "0"]}
    for result in ("512", "2048", "compiled"):
        assert f"b_table/{result}/bench_gpu_dry_run.json" in names
    # The candidates' table: the channels-last candidate ran, was checked against ea-torch, its bytes counted (also
    # in the byte table) beside its time, and the rule named a default.
    nhwc = [case for case in decisions["cases"] if case["variant"] == "ea-torch-nhwc"]
    assert [case["evolution_path"] for case in nhwc] == ["torch operations, channels-last"] * 2
    assert all(case["counted_bytes"] > 0 for case in nhwc)
    assert [(check["candidate"], check["agree"]) for check in decisions["agreement"]] == [("ea-torch-nhwc", True)]
    assert decisions["default_choice"]["float32"]["default"] in ("ea-torch", "ea-torch-nhwc")
    # The reports merged into the decision table: the candidates' cases of both N, the checks, the same verdicts.
    assert merged["capability"] is None  # a CPU dry run's
    assert {(row["n"], row["variant"]) for row in merged["comparison"]} == {
        (16, "ea-torch"), (16, "ea-torch-nhwc"), (24, "ea-triton"),
    }  # fmt: skip
    assert merged["agreement"] == decisions["agreement"]
    assert counted["variants"] == ["eager", "ea-torch", "ea-torch-nhwc"]
    assert {"c_tune/triton_kernels_dry_run.json", "a_smoke/tests.xml", "machine.txt"} <= names
    decoder = {"e_decoder/bench_decoder_static_dry_run_tiny.json", "e_decoder/bench_decoder_gpu_dry_run_tiny.json"}
    assert decoder <= names
    assert [entry["capability"] for entry in table["entries"]] == ["interpreter"]

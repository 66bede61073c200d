"""The result-line protocol: a script run in an internal mode in a fresh process (its own peak memory, no
allocator state carried over) prints its result as one JSON line, which the parent reads back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from harness import REPO_ROOT
from harness.timing import stopwatch

#: Line prefix of a child's result on stdout (anything else a library prints there is ignored).
RESULT_PREFIX = "BENCH_RESULT "


def print_result(result: dict) -> None:
    """Print ``result`` as the child's result line."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_child(script: str | Path, arguments: list[str], threads: int, what: str) -> dict:
    """Run ``script`` with ``arguments`` (an internal mode) in a fresh Python with ``threads`` OpenMP/MKL threads;
    return its last result line's JSON with the process's wall time (``process_wall_s``) added. A child that fails
    or prints no result raises RuntimeError naming ``what``, its output's tail written to stderr."""
    env = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[name] = str(threads)
    elapsed = stopwatch()
    command = [sys.executable, str(Path(script).resolve()), *arguments]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    wall = elapsed()
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise RuntimeError(f"{what} failed (exit code {done.returncode})")
    result = json.loads(lines[-1][len(RESULT_PREFIX) :])
    result["process_wall_s"] = wall
    return result

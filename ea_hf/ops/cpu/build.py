"""Building the CPU kernel's C++ source into a shared library, cached between processes.

``csrc/evolve_cpu.cpp`` is a plain C++ shared library (no torch headers, about a second to compile). It is built
with the system C++ compiler (``$CXX``, else ``c++``/``g++``/``clang++``) for the machine it runs on
(``-march=native``) into ``$EA_HF_CACHE`` (default ``~/.cache/ea_hf``), keyed by source, compiler, flags and CPU.
:mod:`ea_hf.ops.cpu.binding` loads what this builds.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "csrc" / "evolve_cpu.cpp"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")


def find_compiler() -> str | None:
    """The C++ compiler to build with: ``$CXX``, else the first of ``c++``, ``g++``, ``clang++`` on the path."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def cpu_signature() -> str:
    """The CPU model and its feature flags: a binary built with -march=native only runs where they match."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            lines = [line for line in cpuinfo if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


def cache_dir() -> Path:
    """Where built libraries are kept: ``$EA_HF_CACHE/kernels`` (default ``~/.cache/ea_hf/kernels``)."""
    return Path(os.environ.get("EA_HF_CACHE", Path.home() / ".cache" / "ea_hf")) / "kernels"


def build(compiler: str, flags: tuple[str, ...] = FLAGS) -> Path:
    """The kernel library built from :data:`SOURCE` with ``compiler`` and ``flags``: the cached one where it
    exists, else built now. Raises ``subprocess.CalledProcessError`` (with the compiler's ``stderr``) where the
    build fails."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + compiler.encode() + " ".join(flags).encode() + cpu_signature().encode())
    target = cache_dir() / f"evolve_cpu-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename into place, so concurrent processes (DDP ranks) never load a
    # half-written library.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        subprocess.run(
            [compiler, *flags, "-o", str(built), str(SOURCE)], check=True, capture_output=True, text=True, timeout=300
        )
        os.replace(built, target)
    return target

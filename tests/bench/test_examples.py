"""The examples in bench/'s docstrings run and give what they show: bench/ is not a package, so pytest's
``--doctest-modules`` (which collects ``ea_hf`` and ``tests``) never sees them."""

import doctest
from pathlib import Path

import pytest
from testing import bench_harness, bench_script

BENCH = Path(__file__).resolve().parents[2] / "bench"
#: Every module of bench/ whose docstrings hold an example, as a path under bench/ without ".py".
WITH_EXAMPLES = sorted(
    str(path.relative_to(BENCH).with_suffix("")) for path in BENCH.rglob("*.py") if ">>> " in path.read_text()
)


def load(module: str):
    """A harness module as the scripts import it; a script as the benchmark tests load it."""
    folder, name = module.split("/", 1)
    return bench_harness(name) if folder == "harness" else bench_script(module)


def test_the_modules_with_examples_are_found():
    assert {"harness/bytes", "benchmarks/attention_gpu"} <= set(WITH_EXAMPLES)


@pytest.mark.parametrize("module", WITH_EXAMPLES)
def test_the_examples_run(module):
    loaded = load(module)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = [test for test in doctest.DocTestFinder().find(loaded) if test.examples]
    for test in tests:
        runner.run(test)
    results = runner.summarize(verbose=False)
    assert results.attempted > 0 and results.failed == 0, f"{results.failed} of {results.attempted} examples failed"

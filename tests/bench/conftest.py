"""The benchmarks' tests: those that take a whole dry run of a benchmark are CI's second stage."""

import pytest

#: Module fixtures that run a benchmark's whole dry run (half a minute to two minutes on 2 cores). The tests that
#: take one are marked ``full_table``, as every dry run is: the README's test command leaves them to CI's second
#: stage, and a run of the file itself (no ``-m``) still takes them.
DRY_RUN_FIXTURES = frozenset({"report", "static_report", "device_report"})


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if DRY_RUN_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.full_table)

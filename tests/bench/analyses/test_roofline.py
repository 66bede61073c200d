"""bench/analyses/roofline.py: one layer's evolution step against its roofline, from the shapes and the recorded GPU
measurements."""

from pathlib import Path

import pytest
from testing import bench_script

roofline = bench_script("analyses/roofline")


def test_the_performance_page_shows_the_current_roofline():
    """The page's roofline is the script's, computed from the shapes and the recorded H200 measurements; the
    bf16 step's least bytes are nine maps and three bit-packed gates (with the padding mask), as the docstring counts:
    the next layer's gradient is the fused tail's to read."""
    page = (Path(__file__).resolve().parents[3] / "docs" / "performance.md").read_text()
    assert roofline.roofline_table() in page
    traffic = roofline.evolution_traffic(8, 12, 512, "bf16")
    elements, mask = 8 * 12 * 512 * 512, 8 * 512 * 512 * 2
    assert traffic.forward_bytes + traffic.backward_bytes == 9 * 2 * elements + 3 * elements / 8 + 3 * mask
    assert traffic.seconds(roofline.H200, "bf16") == pytest.approx(
        (traffic.forward_bytes + traffic.backward_bytes) / 4.8e12
    )

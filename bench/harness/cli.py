"""Command-line pieces more than one benchmark parses."""

from __future__ import annotations

import argparse


def parse_case(text: str) -> tuple[int, int]:
    """``N:BATCH`` -> (N, batch)."""
    try:
        length, batch = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N:BATCH, got {text!r}") from None
    if min(length, batch) < 1:
        raise argparse.ArgumentTypeError(f"N and batch must be positive, got {text!r}")
    return length, batch

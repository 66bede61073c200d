"""Table cells, ratios and targets, and Markdown tables."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

#: Markdown column alignments: left, and right (numbers).
ALIGNMENTS = {"l": "---", "r": "---:"}


def number(value: float | None, digits: int) -> str:
    """A table cell: the value with ``digits`` decimals, or "-"."""
    return "-" if value is None else f"{value:.{digits}f}"


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, None where either is missing or the denominator is not positive."""
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def passes(value: float | None, target: float | None) -> bool | None:
    """Whether ``value`` is within ``target`` (at most it); None where either is missing."""
    return None if value is None or target is None else value <= target


def target_cell(target: float | None, passed: bool | None) -> str:
    """``<= t pass`` or ``<= t FAIL``, ``<= t n/a`` where the ratio is missing, "-" without a target."""
    if target is None:
        return "-"
    return f"<= {target:g} {'n/a' if passed is None else 'pass' if passed else 'FAIL'}"


def table_row(cells: Sequence[str]) -> str:
    """One row of a Markdown table."""
    return "| " + " | ".join(cells) + " |"


def markdown_table(header: Sequence[str], alignment: str, rows: Iterable[Sequence[str]]) -> str:
    """A Markdown table without a final newline; ``alignment``: a letter per column of :data:`ALIGNMENTS`."""
    if len(alignment) != len(header):
        raise ValueError(f"{len(header)} columns, {len(alignment)} alignments")
    rule = "|" + "|".join(ALIGNMENTS[letter] for letter in alignment) + "|"
    return "\n".join([table_row(header), rule, *(table_row(cells) for cells in rows)])

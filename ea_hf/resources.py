"""Folders that live at the top of the repository (recipes/, model_cards/) and ship inside the wheel."""

from __future__ import annotations

from pathlib import Path


def shipped_dir(name: str) -> Path:
    """``name`` inside the installed package (a wheel ships it as ``ea_hf/<name>``) or, in a source checkout,
    at the top of the repository."""
    package = Path(__file__).resolve().parent
    installed = package / name
    return installed if installed.is_dir() else package.parent / name

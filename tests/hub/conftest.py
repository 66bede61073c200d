"""Fixtures of the publishing tests."""

import builtins
import collections
import io
import os
from pathlib import Path

import pytest


class OpenCounter:
    """How many times each file was opened (``open``, ``Path.read_text``...: every open through ``io.open``)."""

    def __init__(self) -> None:
        self.counts: collections.Counter[Path] = collections.Counter()

    def under(self, folder: Path) -> dict[str, int]:
        """The counts of the files under ``folder``, by their path relative to it."""
        folder = Path(folder).resolve()
        counts = self.counts.items()
        return {path.relative_to(folder).as_posix(): n for path, n in counts if path.is_relative_to(folder)}

    def at_upload(self, monkeypatch, folder: Path) -> dict[str, int]:
        """The counts of the files under ``folder`` when ``ea-hf push`` hands its files to the upload (which then
        reads the files it sends): an empty dict, filled then. Counting starts anew now."""
        from ea_hf.hub import runs

        seen: dict[str, int] = {}
        upload = runs.upload

        def counted_upload(files, repo_id, **options):
            seen.update(self.under(folder))
            return upload(files, repo_id, **options)

        monkeypatch.setattr(runs, "upload", counted_upload)
        self.counts.clear()
        return seen


@pytest.fixture
def opened(monkeypatch) -> OpenCounter:
    """Every file opened from now on in this process, counted (the counts start empty)."""
    counter, original = OpenCounter(), io.open

    def counted(file, *args, **kwargs):
        if isinstance(file, str | bytes | os.PathLike):
            counter.counts[Path(os.fsdecode(file)).resolve()] += 1
        return original(file, *args, **kwargs)

    monkeypatch.setattr(io, "open", counted)
    monkeypatch.setattr(builtins, "open", counted)
    return counter

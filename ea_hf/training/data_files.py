"""Local data files checked before any is handed to ``datasets``: one clear error that names the file, the line
where there is one, and what was expected, instead of a ``DatasetGenerationError`` traceback or a tokenizer's
complaint that names neither.

Example:
    >>> import pathlib, tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "notes.jsonl"
    >>> _ = path.write_text('{"text": "a"}\\n{"text": 3}\\n')
    >>> check_text_file(path, "text")
    Traceback (most recent call last):
    ...
    ValueError: ...notes.jsonl, line 2: "text" holds int '3', expected a string
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_text(path: Path) -> str:
    """The file's text, which must be non-empty UTF-8 without NUL bytes (a binary file has them)."""
    data = path.read_bytes()
    if not data.strip():
        raise ValueError(f"{path}: the file is empty")
    if b"\x00" in data:
        line = data[: data.index(b"\x00")].count(b"\n") + 1
        raise ValueError(f"{path}, line {line}: a NUL byte: this looks like a binary file, not text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise ValueError(f"{path}, line {line}: not UTF-8 text (byte {error.start}: {error.reason})") from None


def _text_of(row: Any, column: str, where: str) -> None:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a {type(row).__name__}, expected a JSON object with a {column!r} field")
    if column not in row:
        fields = ", ".join(map(str, row)) or "none"
        raise ValueError(f"{where}: no text column {column!r} (fields: {fields}); set data.text_column")
    if not isinstance(row[column], str):
        value = row[column]
        raise ValueError(f'{where}: "{column}" holds {type(value).__name__} {str(value)[:40]!r}, expected a string')


def check_text_file(path: str | Path, text_column: str = "text") -> None:
    """Check a text corpus file of the ``causal_lm`` kind: ``.txt`` (one row per line) or ``.json``/``.jsonl``
    rows whose ``text_column`` holds a string. ValueError naming the file, the line and what was expected."""
    path = Path(path)
    text = read_text(path)
    if path.suffix.lower() == ".txt":
        return
    if path.suffix.lower() == ".json":
        try:  # one JSON document: a list of rows (otherwise datasets reads the file as JSON lines, as here)
            document = json.loads(text)
        except json.JSONDecodeError:
            document = None
        if isinstance(document, list):
            if not document:
                raise ValueError(f"{path}: an empty list, expected rows with a {text_column!r} field")
            for index, row in enumerate(document):
                _text_of(row, text_column, f"{path}, row {index}")
            return
    rows = 0
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}, line {number}: not JSON ({error.msg}, column {error.colno})") from None
        _text_of(row, text_column, f"{path}, line {number}")
        rows += 1
    if not rows:
        raise ValueError(f"{path}: no rows")

"""Local data files checked before any is handed to ``datasets`` or aeon: one clear error that names the file,
the line (or row, or series) where there is one, and what was expected, instead of a ``DatasetGenerationError``
traceback, a pandas or numpy error deep in training, or values quietly read as something else.

Each task kind checks its own files: ``check_text_file`` (text corpora), ``check_table_file`` (labelled tables),
``ts_data_line`` then, on what aeon read, ``check_ts_labels``, ``check_series``, ``check_classes`` and
``check_variables`` (UEA/UCR ``.ts`` series), ``check_image_folders`` (image folders).

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

import csv
import io
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np


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


def one_line(error: BaseException) -> str:
    """An exception's message on one line (a library's own may span several), or its type if it has none."""
    return " ".join(str(error).split()) or type(error).__name__


def json_rows(path: Path, text: str, expected: str) -> list[tuple[str, Any]]:
    """The rows of a ``.json``/``.jsonl`` file, each with where it is: a ``.json`` file's one JSON list of rows,
    else one JSON value a line (JSON lines; blank lines skipped). ``expected`` says what a row should be.

    Example:
        >>> [where for where, _ in json_rows(Path("a.jsonl"), '{"x": 1}\\n\\n{"x": 2}\\n', "rows")]
        ['a.jsonl, line 1', 'a.jsonl, line 3']
        >>> json_rows(Path("a.json"), '[{"x": 1}]', "rows")
        [('a.json, row 0', {'x': 1})]
    """
    try:  # one JSON document: a list of rows (otherwise datasets reads the file as JSON lines, as here)
        document = json.loads(text) if path.suffix.lower() == ".json" else None
    except json.JSONDecodeError:
        document = None
    if isinstance(document, list):
        if not document:
            raise ValueError(f"{path}: an empty list, expected {expected}")
        _strict_json(text, str(path))
        return [(f"{path}, row {index}", row) for index, row in enumerate(document)]
    rows = []
    # Lines end at "\n" only, as for datasets' reader: a JSON string may hold a raw U+2028, which splitlines splits.
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip(" \t\r"):  # JSON's white space: pyarrow reads a line of a form feed as a bad value
            continue
        try:
            rows.append((f"{path}, line {number}", _strict_json(line, f"{path}, line {number}")))
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}, line {number}: not JSON ({error.msg}, column {error.colno})") from None
    if not rows:
        raise ValueError(f"{path}: no rows, expected {expected}")
    return rows


def _strict_json(text: str, where: str) -> Any:
    """One JSON value as the readers after the check take it, not only as Python's ``json`` does: pyarrow's JSON
    reader (which ``datasets`` reads JSON lines with) refuses a field given twice in an object and a number beyond
    a float64 (Python keeps the last field and reads ``1e400`` as inf), and neither it nor a tokenizer can encode
    a lone surrogate (an escape such as ``\\ud800`` without its pair). ValueError saying which, at ``where``.

    Example:
        >>> _strict_json('{"text": "a", "text": "b"}', "a.jsonl, line 3")
        Traceback (most recent call last):
        ...
        ValueError: a.jsonl, line 3: the field(s) ['text'] twice in one object, expected each field once
    """

    def number(literal: str) -> float:
        value = float(literal)
        if math.isinf(value):
            shown = literal if len(literal) <= 40 else f"{literal[:20]}... ({len(literal)} characters)"
            raise ValueError(f"{where}: the number {shown} is beyond a float64, expected at most about 1.8e308")
        return value

    def mapping(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [key for key, _ in pairs]
        twice = sorted({key for key in keys if keys.count(key) > 1})
        if twice:
            raise ValueError(f"{where}: the field(s) {twice} twice in one object, expected each field once")
        return dict(pairs)

    def integer(literal: str) -> int:
        number(literal)  # and Python reads no integer of more than 4,300 digits (a ValueError of its own)
        return int(literal)

    value = json.loads(text, parse_float=number, parse_int=integer, object_pairs_hook=mapping)
    if "\\u" in text:  # the text itself is UTF-8, so a lone surrogate can only come from an escape
        _expect_unicode(value, where)
    return value


def _expect_unicode(value: Any, where: str) -> None:
    """Every string in a JSON value (keys too) encodes as UTF-8: none holds a lone surrogate."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            surrogate = value[error.start]
            raise ValueError(
                f"{where}: a lone surrogate {surrogate!r} in a string (an escape without its pair), expected "
                "Unicode text"
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _expect_unicode(key, where)
            _expect_unicode(item, where)
    elif isinstance(value, list):
        for item in value:
            _expect_unicode(item, where)


def _expect_string(value: Any, column: str, where: str) -> None:
    if not isinstance(value, str):
        raise ValueError(f'{where}: "{column}" holds {type(value).__name__} {str(value)[:40]!r}, expected a string')


def _text_of(row: Any, column: str, where: str) -> None:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a {type(row).__name__}, expected a JSON object with a {column!r} field")
    if column not in row:
        fields = ", ".join(map(str, row)) or "none"
        raise ValueError(f"{where}: no text column {column!r} (fields: {fields}); set data.text_column")
    _expect_string(row[column], column, where)


def check_text_file(path: str | Path, text_column: str = "text") -> None:
    """Check a text corpus file: ``.txt`` (one row per line) or ``.json``/``.jsonl`` rows whose ``text_column``
    holds a string. ValueError naming the file, the line and what was expected."""
    path = Path(path)
    text = read_text(path)
    if path.suffix.lower() == ".txt":
        return
    for where, row in json_rows(path, text, f"rows with a {text_column!r} field"):
        _text_of(row, text_column, where)


def load_checked_file(builder: str, path: Path, split: str, **options: Any):
    """``datasets.load_dataset(builder)`` of one local file that the checks here have passed: whatever they still
    miss and ``datasets`` cannot read is one ValueError naming the file, with the reader's own message, not a
    ``DatasetGenerationError`` traceback (the net under the checks; each case found is a check of its own)."""
    import datasets
    from datasets.exceptions import DatasetGenerationError

    try:
        return datasets.load_dataset(builder, data_files={split: str(path)}, split=split, **options)
    except DatasetGenerationError as error:  # the reader's own error is its cause
        raise ValueError(f"{path}: datasets cannot read this file ({one_line(error.__cause__ or error)})") from None


# Tables: csv, tsv, json, jsonl, parquet -------------------------------------------------------------------------


def _csv_records(path: Path, text: str, tab: bool) -> list[tuple[int, list[str]]]:
    """The records of a csv file (``tab``: tab-separated, no quoting) with the line each starts on; blank lines
    skipped, as pandas (which ``datasets`` reads csv with) does: lines of spaces and tabs only (a line holding a
    form feed or a no-break space, or ``""``, an empty field, is a row to pandas)."""
    options: dict[str, Any] = {"delimiter": "\t", "quoting": csv.QUOTE_NONE} if tab else {"strict": True}
    lines = io.StringIO(text, newline="").readlines()  # the lines as csv counts them (\n, \r\n or \r)
    reader = csv.reader(lines, **options)
    records, end = [], 0
    try:
        for record in reader:
            start, end = end + 1, reader.line_num
            if len(record) > 1 or lines[start - 1].strip(" \t\r\n"):
                records.append((start, record))
    except csv.Error as error:
        # The unclosed quote reads on to the end of the file (or past csv's field size limit) before it fails.
        if "end of data" in str(error) or "field larger" in str(error):
            problem = 'a quoted field that is never closed, expected a closing "'
        else:
            problem = f'not valid CSV ({error}), expected quotes around whole fields and "" for a quote inside one'
        raise ValueError(f"{path}, line {end + 1}: {problem}") from None
    return records


def _csv_rows(path: Path, text: str, tab: bool) -> tuple[list[str], list[tuple[str, dict[str, Any]]]]:
    """The header and the rows of a csv/tsv file, each row with as many fields as the header, its label and other
    cells typed as pandas types them."""
    records = _csv_records(path, text.removeprefix("\ufeff"), tab)
    if not records:
        raise ValueError(f"{path}: the file is empty")
    (_, header), rows = records[0], []
    twice = sorted({column for column in header if header.count(column) > 1})
    if twice:  # pandas renames the second "label.1"; the rows' check would see one, the model the other
        raise ValueError(f"{path}, line {records[0][0]}: the column(s) {twice} twice in the header, expected each once")
    separated = "tab-separated" if tab else "comma-separated"
    for line, record in records[1:]:
        if len(record) != len(header):
            raise ValueError(
                f"{path}, line {line}: {len(record)} {separated} field{'s' * (len(record) != 1)}, expected "
                f"{len(header)} as in the header ({', '.join(header)})"
            )
        rows.append((f"{path}, line {line}", dict(zip(header, record, strict=True))))
    return header, rows


def _cell(text: str) -> Any:
    """A csv cell as pandas types a column of such cells: int, float, None when empty, else the text.

    Example:
        >>> [_cell(text) for text in ["3", " 2.5", "", "nan", "great", "1_0"]]
        [3, 2.5, None, nan, 'great', '1_0']
        >>> _cell("\\u0661") == "\u0661", _cell("\\xa01") == "\xa01"  # Python's int() reads both as 1
        (True, True)
    """
    stripped = text.strip(" \t\n\r\x0b\x0c")  # pandas strips ASCII white space around a number, no other
    if not stripped:
        return None
    if "_" in stripped or not stripped.isascii():  # Python reads "1_0" as 10 and "\u0661" as 1, pandas as text
        return text
    for number in (int, float):
        try:
            return number(stripped)
        except ValueError:
            pass
    return text


def _whole_numbers_fit(rows: list[tuple[str, dict[str, Any]]], columns: Sequence[str]) -> None:
    """The whole numbers of a csv column that pandas types as whole numbers fit in 64 bits (int64 or uint64):
    ``datasets`` fails on an id of 21 digits with "Python int too large to convert to C long". Text columns are
    read as text, and a column with any other cell (text, a decimal, an empty cell) is text to pandas."""
    for column in columns:
        numbers = [(where, _cell(row[column])) for where, row in rows]
        if all(type(number) is int for _, number in numbers):
            where, number = next(((w, n) for w, n in numbers if not -(2**63) <= n < 2**64), (None, None))
            if where is not None:
                raise ValueError(
                    f"{where}: the number {number} in column {column!r} does not fit in 64 bits, expected whole "
                    f"numbers from {-(2**63)} to {2**64 - 1}"
                )


def _parquet_rows(path: Path, text_columns: Sequence[str], label_column: str):
    """The column names and the labels (one per row) of a Parquet file; its text columns must hold no nulls."""
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises ArrowInvalid, OSError... for a file that is not Parquet
        raise ValueError(f"{path}: not a Parquet file that pyarrow can open ({one_line(error)})") from None
    names = parquet.schema_arrow.names
    present = [column for column in (*text_columns, label_column) if column in names]
    try:
        table = parquet.read(columns=present)
    except Exception as error:  # a page or its compression damaged past the footer: OSError, ArrowInvalid...
        raise ValueError(f"{path}: not a Parquet file that pyarrow can read ({one_line(error)})") from None
    for column in text_columns:
        if column in names and table.column(column).null_count:
            row = table.column(column).is_null().to_pylist().index(True)
            raise ValueError(f'{path}, row {row}: "{column}" is null, expected a string')
    labels = table.column(label_column).to_pylist() if label_column in names else []
    return names, [(f"{path}, row {index}", {label_column: label}) for index, label in enumerate(labels)]


def _missing_columns(where: str, have: Iterable[str], expected: Sequence[str]) -> None:
    have = list(have)
    missing = [column for column in expected if column not in have]
    if missing:
        raise ValueError(f"{where}: lacks column(s) {missing}; it has {have}, expected {list(expected)}")


def check_table_file(
    path: str | Path, text_columns: Sequence[str], label_column: str, label_names: Sequence[str] | None
) -> None:
    """Check a labelled table (``.csv``, ``.tsv`` read without quoting, ``.json``, ``.jsonl``, ``.parquet``)
    before ``datasets`` reads it: text that parses, as many fields in each row as in the header, the text columns
    and the label column present, text that is text, labels that :func:`check_labels` takes (``label_names``
    None: regression targets), and at least one row. ValueError naming the file, the line or row, and what was
    expected.

    Example:
        >>> import pathlib, tempfile
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "train.csv"
        >>> _ = path.write_text("sentence,label\\nfine,1\\nnot, at all,0\\n")
        >>> check_table_file(path, ["sentence"], "label", ["negative", "positive"])
        Traceback (most recent call last):
        ...
        ValueError: ...train.csv, line 3: 3 comma-separated fields, expected 2 as in the header (sentence, label)
    """
    path = Path(path)
    expected = [*text_columns, label_column]
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        columns, rows = _parquet_rows(path, text_columns, label_column)
        _missing_columns(str(path), columns, expected)
    elif suffix in (".csv", ".tsv"):
        columns, rows = _csv_rows(path, read_text(path), tab=suffix == ".tsv")
        _missing_columns(str(path), columns, expected)
        _whole_numbers_fit(rows, [column for column in columns if column not in text_columns])
        rows = [(where, {label_column: _cell(row[label_column])}) for where, row in rows]
    else:
        rows = json_rows(path, read_text(path), f"rows with fields {', '.join(expected)}")
        for where, row in rows:
            if not isinstance(row, dict):
                raise ValueError(f"{where}: a {type(row).__name__}, expected a JSON object with {expected}")
            _missing_columns(where, row, expected)
            for column in text_columns:
                _expect_string(row[column], column, where)
    if not rows:
        header = " (a header line only)" if suffix in (".csv", ".tsv") else ""
        raise ValueError(f"{path}: no rows{header}, expected rows of {', '.join(expected)}")
    check_labels([(where, row[label_column]) for where, row in rows], label_names)


def check_labels(labels: Iterable[tuple[str, Any]], label_names: Sequence[str] | None) -> None:
    """Check labels, each with where it is: for classification the ``label_names`` or their ids, the one or the
    other throughout (``datasets`` reads a column of both as text, in which an id is an unknown name); for
    regression (``label_names`` None) finite numbers. A NaN or missing label is refused either way.

    Example:
        >>> check_labels([("a.csv, line 2", 0), ("a.csv, line 3", "positive")], ["negative", "positive"])
        Traceback (most recent call last):
        ...
        ValueError: a.csv, line 3: the label name 'positive' where a.csv, line 2 gives an id (0), expected ...
    """
    if label_names is None:
        for where, value in labels:
            if value is None:
                raise ValueError(f"{where}: no label, expected a finite number (the regression target)")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{where}: the label {value!r} is not a number, expected a finite number")
            if not math.isfinite(value):
                raise ValueError(f"{where}: the label is {value}, expected a finite number (the regression target)")
        return
    names, last = list(label_names), len(label_names) - 1
    first: tuple[str, Any] | None = None  # the first good label: the others are names if it is one, else ids
    unknown: dict[str, str] = {}
    outside: dict[str, tuple[Any, str]] = {}  # by repr: a JSON label may be a list
    for where, value in labels:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            shown = "" if value is None else f" ({value})"
            raise ValueError(f"{where}: no label{shown}, expected one of {names} or an id 0..{last}")
        if isinstance(value, str):
            if value not in names:
                unknown.setdefault(value, where)
                continue
        elif isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= last:
            outside.setdefault(repr(value), (value, where))
            continue
        if first is None:
            first = (where, value)
        elif isinstance(first[1], str) != isinstance(value, str):
            kind, other = ("name", "an id") if isinstance(value, str) else ("id", "a name")
            raise ValueError(
                f"{where}: the label {kind} {value!r} where {first[0]} gives {other} ({first[1]!r}), expected "
                "names throughout or ids throughout"
            )
    if unknown:
        where = next(iter(unknown.values()))
        raise ValueError(f"{where}: unknown label(s) {sorted(unknown)}; expected {names} or ids 0..{last}")
    if outside:
        where = next(iter(outside.values()))[1]
        bad = [value for value, _ in outside.values()]
        raise ValueError(f"{where}: label id(s) {bad} outside 0..{last}, expected whole numbers 0..{last} or {names}")


# UEA/UCR .ts series -----------------------------------------------------------------------------------------------


def ts_data_line(path: Path) -> int:
    """The number of the ``@data`` line of a UEA/UCR ``.ts`` file (series ``i`` is on the line ``i + 1`` below it),
    after checking that the file is text, has that line, and holds one series on every line after it: aeon reads
    every one as a series, and fails on a blank one with a bare "could not convert string to float: ''"."""
    lines = io.StringIO(read_text(path), newline=None).read().split("\n")  # universal newlines, as aeon's open()
    data_line = next(
        (number for number, line in enumerate(lines, start=1) if line.strip().lower().split()[:1] == ["@data"]),
        None,
    )
    if data_line is None:
        raise ValueError(
            f"{path}: no @data line, expected a .ts header (@problemName, @classLabel or @targetLabel...) ending "
            "in @data, then one series per line"
        )
    if lines[-1] == "":  # the end of the last line
        lines.pop()
    for number, line in enumerate(lines[data_line:], start=data_line + 1):
        if not line.strip() or line.lstrip().startswith("#"):
            what = "a comment" if line.strip() else "a blank line"
            raise ValueError(f"{path}, line {number}: {what} after @data, expected one series on every line")
    return data_line


def check_series(
    name: str,
    values: Sequence[np.ndarray],
    labels: Sequence[Any],
    regression: bool = False,
    first_line: int | None = None,
) -> None:
    """Check series ([T, C] arrays) and their labels: at least one series, and every value finite: aeon reads a
    missing value (``?`` or ``NaN``) as NaN, and one NaN makes the split's scaling statistics, and so every loss,
    NaN. For regression, finite targets. ``name`` is the file (or archive), ``first_line`` the line of series 0.

    Example:
        >>> check_series("x.ts", [np.array([[1.0], [np.nan]])], ["a"], first_line=9)
        Traceback (most recent call last):
        ...
        ValueError: x.ts, line 9 (series 0): value 2 of variable 1 is nan, expected finite numbers (fill in or ...
    """
    if len(values) == 0:
        raise ValueError(f"{name}: no series, expected at least one (one a line after @data)")

    def where(index: int) -> str:
        if first_line is None:
            return f"{name}, series {index}"
        return f"{name}, line {first_line + index} (series {index})"

    for index, series in enumerate(values):
        if np.size(series) == 0:  # aeon reads a line holding only a label ("a") as a series of no variables
            raise ValueError(f"{where(index)}: no values, expected at least one value of each variable")
        bad = np.argwhere(~np.isfinite(series))
        if len(bad):
            step, variable = bad[0]
            raise ValueError(
                f"{where(index)}: value {step + 1} of variable {variable + 1} is {series[step, variable]}, expected "
                "finite numbers (fill in or drop missing values: the model cannot take them)"
            )
    if regression:
        for index, label in enumerate(labels):
            if not math.isfinite(float(label)):
                raise ValueError(f"{where(index)}: the target is {label}, expected a finite number")


def check_ts_labels(
    path: Path, labels: Sequence[str], header: Mapping[str, Any], regression: bool, first_line: int
) -> None:
    """Check that a ``.ts`` file's labels are what the task needs, as its header (aeon's metadata) declares them:
    targets (``@targetLabel true``) for regression, classes of ``@classLabel true <classes>`` for classification."""
    if regression and not header["targetlabel"]:
        raise ValueError(
            f"{path}: no regression targets, expected @targetLabel true and a number after each series (data.task "
            "is regression)"
        )
    if regression:
        return
    if not header["classlabel"]:
        raise ValueError(
            f"{path}: no class labels, expected @classLabel true <classes> and a class after each series (data.task "
            "is classification)"
        )
    classes = list(header["class_values"])
    for index, label in enumerate(labels):
        if label not in classes:
            raise ValueError(
                f"{path}, line {first_line + index} (series {index}): class {label!r}, expected one of the "
                f"@classLabel classes {classes}"
            )


def check_classes(name: str, labels: Sequence[Any]) -> None:
    """A classification training split needs at least two classes: with one, every loss is 0 and nothing is
    learnt."""
    classes = sorted(set(map(str, labels)))
    if len(classes) < 2:
        raise ValueError(f"{name}: every series is of class {classes[0]!r}, expected at least two classes to learn")


def check_variables(splits: Mapping[str, tuple[Sequence[np.ndarray], Any]], names: Mapping[str, str]) -> None:
    """Every split's series must have as many variables as the training split's: the model's input width is
    theirs. ``names`` says where each split came from (its file).

    Example:
        >>> one, two = ([np.zeros((3, 1))], ["a"]), ([np.zeros((3, 2))], ["a"])
        >>> check_variables({"train": one, "test": two}, {"train": "train.ts", "test": "test.ts"})
        Traceback (most recent call last):
        ...
        ValueError: test.ts: series of 2 variables, expected 1 as in the train split (train.ts)
    """
    first = "train" if "train" in splits else next(iter(splits))
    width = np.shape(splits[first][0][0])[1]
    for split, (values, _) in splits.items():
        other = next((np.shape(series)[1] for series in values if np.shape(series)[1] != width), None)
        if other is not None:
            raise ValueError(
                f"{names[split]}: series of {other} variable{'s' * (other != 1)}, expected {width} as in the "
                f"{first} split ({names[first]})"
            )


# Image folders -----------------------------------------------------------------------------------------------------


def _image_suffixes() -> set[str]:
    """The file name endings that ``datasets``' ``imagefolder`` reads as images (it ignores other files)."""
    from datasets.packaged_modules.imagefolder.imagefolder import ImageFolder

    return set(ImageFolder.EXTENSIONS)


def _visible(folder: Path) -> list[Path]:
    """A folder's entries that ``datasets`` reads: not hidden (``.*``), and no ``__*`` folders."""
    entries = sorted(entry for entry in folder.iterdir() if not entry.name.startswith("."))
    return [entry for entry in entries if not (entry.name.startswith("__") and entry.is_dir())]


def check_image(path: Path) -> None:
    """Check that PIL can read an image file: ``verify`` (the header, and PNG's chunk checksums), then its pixels
    decoded, which is where a JPEG cut short after a good header fails (``verify`` reads a JPEG's header alone).
    A few thousand small images take about a second."""
    from PIL import Image

    try:
        with Image.open(path) as opened:
            opened.verify()
        with Image.open(path) as opened:  # verify leaves the image unusable: opened again to decode it
            opened.load()
    except Exception as error:  # PIL raises UnidentifiedImageError, SyntaxError (PNG), OSError (truncated)...
        raise ValueError(f"{path}: not a readable image ({one_line(error)}), expected an image file") from None


def _class_folder_images(folder: Path, suffixes: set[str]) -> int:
    images = 0
    for entry in _visible(folder):
        if entry.is_dir():
            if any(path.suffix.lower() in suffixes for path in entry.rglob("*")):
                raise ValueError(
                    f"{entry}: a folder of images inside the class folder {folder.name!r}, expected the class's "
                    "images directly in it"
                )
        elif entry.suffix.lower() in suffixes:
            check_image(entry)
            images += 1
    return images


def _image_classes(folder: Path, split: str, suffixes: set[str]) -> set[str]:
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{folder}: image folders not found: no {split} split directory here, expected one directory per "
            "split with one sub-folder of images per class"
        )
    entries = _visible(folder)
    if not entries:
        raise ValueError(f"{folder}: an empty folder, expected one sub-folder of images per class ({split} split)")
    for entry in entries:
        if entry.is_file() and entry.suffix.lower() in suffixes:
            raise ValueError(
                f"{entry}: an image directly in the {split} split's folder, expected it in a sub-folder named "
                "after its class"
            )
    classes = [entry for entry in entries if entry.is_dir()]
    if not classes:
        raise ValueError(f"{folder}: no class sub-folders, expected one sub-folder of images per class")
    for class_folder in classes:
        if not _class_folder_images(class_folder, suffixes):
            endings = ", ".join(sorted(suffixes & {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp"}))
            raise ValueError(f"{class_folder}: no images in this class folder, expected image files ({endings}...)")
    return {class_folder.name for class_folder in classes}


def check_image_folders(folders: Mapping[str, str | Path]) -> None:
    """Check local image folders (split name -> folder) before ``datasets``' ``imagefolder`` reads them: each
    split folder there and holding one sub-folder per class, each class folder holding images (and no folders of
    them, which ``imagefolder`` would label by their own names), every image readable, and at least two classes
    to train on. FileNotFoundError or ValueError naming the folder or file and what was expected."""
    suffixes = _image_suffixes()
    found = {split: _image_classes(Path(folder), split, suffixes) for split, folder in folders.items()}
    classes = found.get("train") or set().union(*found.values())
    if len(classes) < 2:
        split = "train" if "train" in found else next(iter(found))
        raise ValueError(
            f"{folders[split]}: one class folder ({', '.join(classes)}), expected at least two: one sub-folder of "
            "images per class"
        )

"""Bad local data files: each gets one clear error (ValueError, FileNotFoundError when missing) that starts with
the file, names the line, row or series where there is one, and says what was expected, for the ``glue``
(csv, tsv, json, jsonl, parquet), ``timeseries`` (UEA/UCR .ts) and ``image`` (folders) kinds, before ``datasets``
or aeon sees the file. The ``causal_lm`` kind's text files are in test_causal_lm.py (those found by
test_properties.py here). Last, bad recipe overrides that test_properties.py found."""

import importlib.util
import io
import time

import numpy as np
import pandas as pd
import pytest
from PIL import Image
from testing import SST2_SAMPLE, sample_rows, write

from ea_hf.cli import main
from ea_hf.training.data_files import check_image_folders
from ea_hf.training.kinds.causal_lm import CausalLMData, load_text_data
from ea_hf.training.kinds.glue import load_glue_data
from ea_hf.training.kinds.image import load_image_data
from ea_hf.training.recipe import recipe_from_dict


def assert_one_error(error: pytest.ExceptionInfo, path, message: str) -> None:
    """The error is ``<path><message>`` exactly, on one line; a message ending in "..." is the start of it (the
    rest quotes a library: pyarrow, aeon, PIL)."""
    text = str(error.value)
    assert "\n" not in text
    if message.endswith("..."):
        assert text.startswith(f"{path}{message[:-3]}"), text
    else:
        assert text == f"{path}{message}"


# glue: csv, tsv, json, jsonl, parquet ----------------------------------------------------------------------------


def parquet(frame: dict) -> bytes:
    buffer = io.BytesIO()
    pd.DataFrame(frame).to_parquet(buffer)
    return buffer.getvalue()


SST2 = "['negative', 'positive']"
#: Bad GLUE-format files: (task, file name, bytes, the error after the path).
BAD_TABLES = {
    "empty": ("sst2", "train.csv", b"", ": the file is empty"),
    "blank": ("sst2", "train.tsv", b"\n \n", ": the file is empty"),
    "binary": (
        "sst2",
        "train.tsv",
        b"sentence\tlabel\nfine\t1\n\x7fELF\x02\x01\x00\x00",
        ", line 3: a NUL byte: this looks like a binary file, not text",
    ),
    "latin-1": (
        "sst2",
        "train.csv",
        "sentence,label\nfine,1\ncaf\u00e9 au lait,1\n".encode("latin-1"),
        ", line 3: not UTF-8 text (byte 25: invalid continuation byte)",
    ),
    "short-row": (
        "sst2",
        "train.csv",
        b"sentence,label\nfine,1\ndull\nbright,1\n",
        ", line 3: 1 comma-separated field, expected 2 as in the header (sentence, label)",
    ),
    "long-row": (
        "sst2",
        "train.csv",
        b"sentence,label\nfine,1\n\nslow, then dull,0\n",
        ", line 4: 3 comma-separated fields, expected 2 as in the header (sentence, label)",
    ),
    "tsv-row": (
        "mrpc",
        "validation.tsv",
        b"sentence1\tsentence2\tlabel\na\tb\t1\nc\td\te\t0\n",
        ", line 3: 4 tab-separated fields, expected 3 as in the header (sentence1, sentence2, label)",
    ),
    "unclosed-quote": (
        "sst2",
        "train.csv",
        b'sentence,label\nfine,1\n"dull,0\nbright,1\n',
        ', line 3: a quoted field that is never closed, expected a closing "',
    ),
    "stray-quote": (
        "sst2",
        "train.csv",
        b'sentence,label\n"dull"ish,0\n',
        ", line 2: not valid CSV (',' expected after '\"'), expected quotes around whole fields and \"\" for a "
        "quote inside one",
    ),
    "header-only": (
        "sst2",
        "train.csv",
        b"sentence,label\n",
        ": no rows (a header line only), expected rows of sentence, label",
    ),
    "missing-column": (
        "sst2",
        "train.tsv",
        b"text\tlabel\nfine\t1\n",
        ": lacks column(s) ['sentence']; it has ['text', 'label'], expected ['sentence', 'label']",
    ),
    "empty-label": (
        "sst2",
        "train.csv",
        b"sentence,label\nfine,1\ndull,\n",
        f", line 3: no label, expected one of {SST2} or an id 0..1",
    ),
    "nan-label": (
        "sst2",
        "train.tsv",
        b"sentence\tlabel\nfine\tNaN\n",
        f", line 2: no label (nan), expected one of {SST2} or an id 0..1",
    ),
    "unknown-names": (
        "rte",
        "validation.csv",
        b"sentence1,sentence2,label\na,b,entailment\nc,d,contradiction\ne,f,neutral\n",
        ", line 3: unknown label(s) ['contradiction', 'neutral']; expected ['entailment', 'not_entailment'] or "
        "ids 0..1",
    ),
    "id-out-of-range": (
        "mnli",
        "train.csv",
        b"premise,hypothesis,label\na,b,2\nc,d,3\ne,f,-1\n",
        ", line 3: label id(s) [3, -1] outside 0..2, expected whole numbers 0..2 or "
        "['entailment', 'neutral', 'contradiction']",
    ),
    "float-id": (
        "sst2",
        "train.jsonl",
        b'{"sentence": "fine", "label": 1}\n{"sentence": "dull", "label": 0.5}\n',
        f", line 2: label id(s) [0.5] outside 0..1, expected whole numbers 0..1 or {SST2}",
    ),
    "names-and-ids": (
        "sst2",
        "train.jsonl",
        b'{"sentence": "fine", "label": 1}\n{"sentence": "dull", "label": "negative"}\n',
        ", line 2: the label name 'negative' where {path}, line 1 gives an id (1), expected names throughout or "
        "ids throughout",
    ),
    "null-label": (
        "cola",
        "train.json",
        b'[{"sentence": "fine", "label": 1}, {"sentence": "dull", "label": null}]',
        ", row 1: no label, expected one of ['unacceptable', 'acceptable'] or an id 0..1",
    ),
    "not-json": (
        "sst2",
        "train.jsonl",
        b'{"sentence": "fine", "label": 1}\n{"sentence": "dull", label: 0}\n',
        ", line 2: not JSON (Expecting property name enclosed in double quotes, column 22)",
    ),
    "json-row-not-an-object": (
        "sst2",
        "train.json",
        b'[{"sentence": "fine", "label": 1}, ["dull", 0]]',
        ", row 1: a list, expected a JSON object with ['sentence', 'label']",
    ),
    "json-missing-field": (
        "sst2",
        "train.jsonl",
        b'{"sentence": "fine", "label": 1}\n{"sentence": "dull"}\n',
        ", line 2: lacks column(s) ['label']; it has ['sentence'], expected ['sentence', 'label']",
    ),
    "json-null-text": (
        "qnli",
        "train.jsonl",
        b'{"question": "why?", "sentence": null, "label": 1}\n',
        ", line 1: \"sentence\" holds NoneType 'None', expected a string",
    ),
    "empty-json-list": ("sst2", "train.json", b"[]", ": an empty list, expected rows with fields sentence, label"),
    "stsb-nan": (
        "stsb",
        "train.csv",
        b"sentence1,sentence2,label\na,b,3.8\nc,d,nan\n",
        ", line 3: the label is nan, expected a finite number (the regression target)",
    ),
    "stsb-inf": (
        "stsb",
        "train.jsonl",
        b'{"sentence1": "a", "sentence2": "b", "label": Infinity}\n',
        ", line 1: the label is inf, expected a finite number (the regression target)",
    ),
    "stsb-empty": (
        "stsb",
        "validation.tsv",
        b"sentence1\tsentence2\tlabel\na\tb\t\n",
        ", line 2: no label, expected a finite number (the regression target)",
    ),
    "stsb-text": (
        "stsb",
        "train.json",
        b'[{"sentence1": "a", "sentence2": "b", "label": "high"}]',
        ", row 0: the label 'high' is not a number, expected a finite number",
    ),
    "not-parquet": (
        "sst2",
        "train.parquet",
        b"sentence,label\nfine,1\n",
        ": not a Parquet file that pyarrow can open (...",
    ),
    "parquet-no-rows": (
        "sst2",
        "train.parquet",
        parquet({"sentence": pd.Series([], dtype=str), "label": pd.Series([], dtype=int)}),
        ": no rows, expected rows of sentence, label",
    ),
    "parquet-missing-column": (
        "sst2",
        "train.parquet",
        parquet({"text": ["fine"], "label": [1]}),
        ": lacks column(s) ['sentence']; it has ['text', 'label'], expected ['sentence', 'label']",
    ),
    "parquet-null-text": (
        "sst2",
        "train.parquet",
        parquet({"sentence": ["fine", None], "label": [1, 0]}),
        ', row 1: "sentence" is null, expected a string',
    ),
    "parquet-label": (
        "sst2",
        "train.parquet",
        parquet({"sentence": ["fine", "dull"], "label": [1, 2]}),
        f", row 1: label id(s) [2] outside 0..1, expected whole numbers 0..1 or {SST2}",
    ),
    # Found by test_properties.py: files the check passed and pandas, pyarrow or datasets then read otherwise or
    # not at all (a DatasetGenerationError or OSError traceback, or an error that named no file).
    "column-twice": (  # pandas renames the second "label.1" and keeps the first, which the check never saw
        "sst2",
        "train.csv",
        b"sentence,label,label\nfine,great,1\n",
        ", line 1: the column(s) ['label'] twice in the header, expected each once",
    ),
    "form-feed-line": (  # not a blank line to pandas, which skips lines of spaces and tabs only
        "sst2",
        "train.csv",
        b"sentence,label\nfine,1\n\x0c\ndull,0\n",
        ", line 3: 1 comma-separated field, expected 2 as in the header (sentence, label)",
    ),
    "empty-quoted-line": (  # not blank either: pandas reads a row of one empty field
        "sst2",
        "train.csv",
        b'sentence,label\nfine,1\n""\ndull,0\n',
        ", line 3: 1 comma-separated field, expected 2 as in the header (sentence, label)",
    ),
    "arabic-digit-label": (  # Python's int() reads "\u0661" as 1, pandas as text
        "sst2",
        "train.csv",
        "sentence,label\nfine,1\ndull,\u0661\n".encode(),
        ", line 3: unknown label(s) ['\u0661']; expected ['negative', 'positive'] or ids 0..1",
    ),
    "no-break-space-label": (  # str.strip() takes it away, pandas keeps it (it strips ASCII white space only)
        "sst2",
        "train.tsv",
        "sentence\tlabel\nfine\t1\ndull\t\xa00\n".encode(),
        ", line 3: unknown label(s) ['\\xa00']; expected ['negative', 'positive'] or ids 0..1",
    ),
    "id-beyond-64-bits": (  # "Python int too large to convert to C long" from datasets
        "sst2",
        "train.csv",
        b"sentence,label,idx\nfine,1,100000000000000000000\ndull,0,2\n",
        ", line 2: the number 100000000000000000000 in column 'idx' does not fit in 64 bits, expected whole numbers "
        "from -9223372036854775808 to 18446744073709551615",
    ),
    "number-beyond-float64": (  # pyarrow's JSON reader: "Number too big to be stored in double"
        "sst2",
        "train.jsonl",
        b'{"sentence": "fine", "label": 1, "idx": 1e400}\n',
        ", line 1: the number 1e400 is beyond a float64, expected at most about 1.8e308",
    ),
    "field-twice": (  # Python keeps the last, pyarrow refuses: "Column(/label) was specified twice"
        "sst2",
        "train.jsonl",
        b'{"sentence": "fine", "label": "positive", "label": 1}\n',
        ", line 1: the field(s) ['label'] twice in one object, expected each field once",
    ),
    "lone-surrogate": (  # pyarrow: "The surrogate pair in string is invalid"; a tokenizer cannot encode it either
        "sst2",
        "train.jsonl",
        b'{"sentence": "fine \\ud800", "label": 1}\n',
        ", line 1: a lone surrogate '\\ud800' in a string (an escape without its pair), expected Unicode text",
    ),
    "form-feed-json-line": (  # blank to str.strip(), "Invalid value" to pyarrow
        "sst2",
        "train.jsonl",
        b'{"sentence": "fine", "label": 1}\n\x0c\n',
        ", line 2: not JSON (Expecting value, column 1)",
    ),
    "parquet-damaged-page": (  # the footer opens, the first page header does not (an OSError from pyarrow)
        "sst2",
        "train.parquet",
        b"PAR1\x00" + parquet({"sentence": ["fine", "dull"], "label": [1, 0]})[5:],
        ": not a Parquet file that pyarrow can read (...",
    ),
}


@pytest.mark.parametrize("name", BAD_TABLES)
def test_a_bad_glue_file_gets_one_error_naming_the_file_and_line(name, tmp_path):
    task, file_name, content, message = BAD_TABLES[name]
    path = tmp_path / file_name
    path.write_bytes(content)
    with pytest.raises(ValueError) as error:
        load_glue_data(task, "local", files={"train": str(path)})
    assert_one_error(error, path, message.replace("{path}", str(path)))


def test_good_glue_files_still_load_and_text_stays_text(tmp_path):
    # One example is fewer than a batch, not an error; "NA" and "null" are sentences, not missing values.
    one = load_glue_data("sst2", "local", files={"train": write(sample_rows("sst2", 1), tmp_path / "one.csv")})
    assert one["train"]["label"] == [0]
    words = tmp_path / "words.tsv"
    words.write_text("sentence\tlabel\nNA\t1\nnull\t0\n\t1\n")
    assert load_glue_data("sst2", "local", files={"train": str(words)})["train"]["sentence"] == ["NA", "null", ""]
    quoted = tmp_path / "quoted.csv"
    quoted.write_text('sentence,label\n"fine, and ""bright""\non two lines",1\n\n')
    assert load_glue_data("sst2", "local", files={"train": str(quoted)})["train"]["sentence"] == [
        'fine, and "bright"\non two lines'
    ]
    # A column of sentences that all look like numbers stays text (pandas would read 7.0 and 2.5; test_properties).
    numbers = tmp_path / "numbers.csv"
    numbers.write_text("sentence,label\n007,1\n2.5,0\n")
    assert load_glue_data("sst2", "local", files={"train": str(numbers)})["train"]["sentence"] == ["007", "2.5"]
    names = tmp_path / "names.jsonl"
    names.write_text('{"sentence": "fine", "label": "positive"}\n{"sentence": "dull", "label": "negative"}\n')
    assert load_glue_data("sst2", "local", files={"train": str(names)})["train"]["label"] == [1, 0]


def test_a_run_on_a_bad_file_exits_2_with_one_line_and_leaves_no_run_directory(tmp_path, capsys):
    path = tmp_path / "train.csv"
    path.write_bytes(BAD_TABLES["short-row"][2])
    run_dir = tmp_path / "run"
    overrides = [*SST2_SAMPLE, f"data.files={{train: {path}}}", f"output_dir={run_dir}"]
    assert main(["run", "quickstart", *overrides]) == 2
    error = capsys.readouterr().err.strip()
    assert error == f"ea-hf run: error: {path}{BAD_TABLES['short-row'][3]}"
    assert not run_dir.exists()  # nothing half-written that a rerun would take for a run to --resume


def test_a_corpus_line_that_pyarrow_refuses_gets_one_error_naming_the_line(tmp_path):
    """Found by test_properties.py: JSON lines that the check passed and pyarrow then refused, so that the
    ``causal_lm`` kind failed with a DatasetGenerationError traceback."""
    path = tmp_path / "train.jsonl"
    for line, message in [
        (
            b'{"text": "a", "text": "b"}\n',
            ", line 2: the field(s) ['text'] twice in one object, expected each field once",
        ),
        (
            b'{"text": "a", "n": 1e400}\n',
            ", line 2: the number 1e400 is beyond a float64, expected at most about 1.8e308",
        ),
    ]:
        path.write_bytes(b'{"text": "fine"}\n' + line)
        with pytest.raises(ValueError) as error:
            load_text_data(CausalLMData(source="local", files={"train": str(path)}))
        assert_one_error(error, path, message)


def test_what_datasets_still_cannot_read_is_one_error_naming_the_file(tmp_path, monkeypatch):
    """The net under the checks: a reader's failure that they missed is a ValueError naming the file, with the
    reader's own message on one line, not a DatasetGenerationError traceback."""
    import datasets
    import pyarrow
    from datasets.exceptions import DatasetGenerationError

    def fail(*args, **kwargs):
        try:
            raise pyarrow.ArrowInvalid("JSON parse error:\nsomething new")
        except pyarrow.ArrowInvalid as cause:
            raise DatasetGenerationError("An error occurred while generating the dataset") from cause

    monkeypatch.setattr(datasets, "load_dataset", fail)
    path = tmp_path / "train.jsonl"
    path.write_text('{"sentence": "fine", "label": 1}\n')
    with pytest.raises(ValueError) as error:
        load_glue_data("sst2", "local", files={"train": str(path)})
    assert_one_error(error, path, ": datasets cannot read this file (JSON parse error: something new)")


# timeseries: UEA/UCR .ts files -----------------------------------------------------------------------------------

pytest_aeon = pytest.mark.skipif(
    importlib.util.find_spec("aeon") is None, reason="UEA/UCR data is the optional timeseries extra (aeon)"
)

HEADER = [
    "@problemName tiny",
    "@timeStamps false",
    "@missing false",
    "@univariate false",
    "@dimensions 2",
    "@equalLength false",
    "@classLabel true a b",
    "@data",
]  # lines 1 to 8: series 0 is on line 9
SERIES = ["1.0,2.0,3.0:4.0,5.0,6.0:a", "1.5,2.5:3.5,4.5:b", "0.5,0.25,0.75,1.0:2.0,1.0,0.0,1.0:a"]
TARGETS = ["@targetLabel true" if line.startswith("@classLabel") else line for line in HEADER]


def ts(*lines: str, header=HEADER) -> bytes:
    return ("\n".join([*header, *lines]) + "\n").encode()


EXPECTED_FORMAT = (
    "expected a UEA/UCR header, @data, then one series a line (values separated by commas, variables by colons, "
    "the label last)"
)
NOT_FINITE = "expected finite numbers (fill in or drop missing values: the model cannot take them)"
#: Bad .ts files: (the recipe's data.task, bytes, the error after the path).
BAD_TS = {
    "empty": ("classification", b"", ": the file is empty"),
    "binary": (
        "classification",
        b"@data\n\x00\x01\x02",
        ", line 2: a NUL byte: this looks like a binary file, not text",
    ),
    "no-data-line": (
        "classification",
        ts(header=HEADER[:-1]),
        ": no @data line, expected a .ts header (@problemName, @classLabel or @targetLabel...) ending in @data, then "
        "one series per line",
    ),
    "no-series": ("classification", ts(), ": no series, expected at least one (one a line after @data)"),
    "blank-line": (
        "classification",
        ts(SERIES[0], "", SERIES[1]),
        ", line 10: a blank line after @data, expected one series on every line",
    ),
    "trailing-blank-line": (
        "classification",
        ts(*SERIES) + b"\n",
        ", line 12: a blank line after @data, expected one series on every line",
    ),
    "comment": (
        "classification",
        ts(SERIES[0], "# the rest", SERIES[1]),
        ", line 10: a comment after @data, expected one series on every line",
    ),
    "missing-value": (
        "classification",
        ts(SERIES[0], "1.5,?:3.5,4.5:b"),
        f", line 10 (series 1): value 2 of variable 1 is nan, {NOT_FINITE}",
    ),
    "nan": (
        "classification",
        ts(*SERIES, "1,2:3,NaN:b"),
        f", line 12 (series 3): value 2 of variable 2 is nan, {NOT_FINITE}",
    ),
    "inf": (
        "regression",
        ts("1,2:inf,4:0.5", header=TARGETS),
        f", line 9 (series 0): value 1 of variable 2 is inf, {NOT_FINITE}",
    ),
    "not-a-number": (
        "classification",
        ts(SERIES[0], "1.5,two:3.5,4.5:b"),
        f": aeon cannot read this .ts file (could not convert string to float: 'two'), {EXPECTED_FORMAT}",
    ),
    "variables-differ": (
        "classification",
        ts(SERIES[0], "1.5,2.5:b"),
        ": aeon cannot read this .ts file (Inconsistent number of dimensions in case 2. Expecting 2 but have read "
        f"1), {EXPECTED_FORMAT}",
    ),
    "label-only": (  # aeon reads it as a series of no variables (found by test_properties.py)
        "classification",
        ts("a", "b"),
        ", line 9 (series 0): no values, expected at least one value of each variable",
    ),
    "undeclared-class": (
        "classification",
        ts(*SERIES, "1,2:3,4:c"),
        ", line 12 (series 3): class 'c', expected one of the @classLabel classes ['a', 'b']",
    ),
    "no-classes": (
        "classification",
        ts("1,2:3,4:0.5", header=TARGETS),
        ": no class labels, expected @classLabel true <classes> and a class after each series (data.task is "
        "classification)",
    ),
    "no-targets": (
        "regression",
        ts(*SERIES),
        ": no regression targets, expected @targetLabel true and a number after each series (data.task is regression)",
    ),
    "nan-target": (
        "regression",
        ts("1,2:3,4:0.5", "1,2:3,4:?", header=TARGETS),
        ", line 10 (series 1): the target is nan, expected a finite number",
    ),
}


def series_recipe(files: dict, task: str = "classification"):
    data = {"task": task, "source": "local", "files": {split: str(path) for split, path in files.items()}}
    return recipe_from_dict({"name": "t", "kind": "timeseries", "model": {"config": {"hidden_size": 8}}, "data": data})


@pytest_aeon
@pytest.mark.parametrize("name", BAD_TS)
def test_a_bad_ts_file_gets_one_error_naming_the_file_and_line(name, tmp_path):
    task, content, message = BAD_TS[name]
    path = tmp_path / "train.ts"
    path.write_bytes(content)
    recipe = series_recipe({"train": path}, task)
    with pytest.raises(ValueError) as error:
        recipe.task_kind.load_data(recipe)
    assert_one_error(error, path, message)


@pytest_aeon
def test_ts_splits_need_two_classes_to_train_on_and_the_same_variables(tmp_path):
    train, test = tmp_path / "train.ts", tmp_path / "test.ts"
    train.write_bytes(ts(SERIES[0], SERIES[2]))
    test.write_bytes(ts(*SERIES))
    recipe = series_recipe({"train": train, "test": test})
    with pytest.raises(ValueError) as error:
        recipe.task_kind.load_data(recipe)
    assert_one_error(error, train, ": every series is of class 'a', expected at least two classes to learn")
    train.write_bytes(ts(*SERIES))
    test.write_bytes(ts("1,2:a", "3,4:b", header=[line.replace("2", "1") for line in HEADER]))
    with pytest.raises(ValueError) as error:
        recipe.task_kind.load_data(recipe)
    assert_one_error(error, test, f": series of 1 variable, expected 2 as in the train split ({train})")
    test.write_bytes(ts(*SERIES[1:]))  # one class in a split that is not trained on is fine
    data, label_names = recipe.task_kind.load_data(recipe)
    assert label_names == ("a", "b") and len(data["test"]) == 2


@pytest_aeon
def test_an_archive_with_missing_values_is_refused_naming_the_series(monkeypatch):
    import aeon.datasets

    from ea_hf.training.kinds.timeseries import load_uea

    values = [np.array([[1.0, 2.0, 3.0]]), np.array([[1.0, np.nan, 3.0]])]
    monkeypatch.setattr(aeon.datasets, "load_classification", lambda name, split: (values, np.array(["a", "b"])))
    with pytest.raises(ValueError) as error:
        load_uea("JapaneseVowels")
    assert_one_error(
        error, "the archive 'JapaneseVowels' (train split)", f", series 1: value 2 of variable 1 is nan, {NOT_FINITE}"
    )


# image: one folder per split, one sub-folder per class -------------------------------------------------------------


def png(path, size=4) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("L", (size, size), color=128).save(path)


def make_folder(root, layout: dict) -> str:
    """A folder from ``{relative path: "png" (a real image), "truncated" (one cut short), "cut-jpeg" (a JPEG cut
    in half, its header whole), bytes, or None (an empty folder)}``."""
    for name, content in layout.items():
        path = root / name
        if content is None:
            path.mkdir(parents=True, exist_ok=True)
        elif content == "cut-jpeg":
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.radial_gradient("L").resize((64, 64)).save(path, "JPEG")
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        elif content in ("png", "truncated"):
            png(path, size=32)
            if content == "truncated":
                path.write_bytes(path.read_bytes()[:-20])
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)
    root.mkdir(parents=True, exist_ok=True)
    return str(root)


GOOD = {"a/1.png": "png", "b/1.png": "png"}
NO_IMAGES = ": no images in this class folder, expected image files (.bmp, .gif, .jpeg, .jpg, .png, .webp...)"
#: Bad train folders: (what the folder holds, the entry the error names ("." the folder), the error after it).
BAD_FOLDERS = {
    "empty": ({}, ".", ": an empty folder, expected one sub-folder of images per class (train split)"),
    "image-outside-a-class": (
        {**GOOD, "0.png": "png"},
        "0.png",
        ": an image directly in the train split's folder, expected it in a sub-folder named after its class",
    ),
    "no-class-folders": (
        {"a.txt": b"a", "b.txt": b"b"},
        ".",
        ": no class sub-folders, expected one sub-folder of images per class",
    ),
    "empty-class": ({**GOOD, "c": None}, "c", NO_IMAGES),
    "class-of-text": ({**GOOD, "c/notes.txt": b"no images here"}, "c", NO_IMAGES),
    "not-an-image": (
        {**GOOD, "b/2.png": b"not a picture"},
        "b/2.png",
        ": not a readable image (cannot identify image file ...",
    ),
    "empty-image": ({**GOOD, "a/2.jpg": b""}, "a/2.jpg", ": not a readable image (..."),
    "truncated": ({**GOOD, "b/2.png": "truncated"}, "b/2.png", ": not a readable image (..."),
    # PIL's verify reads a JPEG's header alone: this one failed only in training, when its pixels were decoded.
    "jpeg-cut-after-its-header": (
        {**GOOD, "b/2.jpg": "cut-jpeg"},
        "b/2.jpg",
        ": not a readable image (image file is truncated ...",
    ),
    "nested": (
        {**GOOD, "b/more/2.png": "png"},
        "b/more",
        ": a folder of images inside the class folder 'b', expected the class's images directly in it",
    ),
    "one-class": (
        {"a/1.png": "png", "a/2.png": "png"},
        ".",
        ": one class folder (a), expected at least two: one sub-folder of images per class",
    ),
}


@pytest.mark.parametrize("name", BAD_FOLDERS)
def test_a_bad_image_folder_gets_one_error_naming_the_folder_or_file(name, tmp_path):
    layout, where, message = BAD_FOLDERS[name]
    folders = {"train": make_folder(tmp_path / "train", layout), "validation": make_folder(tmp_path / "val", GOOD)}
    with pytest.raises(ValueError) as error:
        load_image_data("local", None, folders)
    assert_one_error(error, tmp_path / "train" / where if where != "." else tmp_path / "train", message)


def test_image_folders_that_are_missing_or_carry_other_files(tmp_path):
    folders = {split: make_folder(tmp_path / split, GOOD) for split in ("train", "validation")}
    with pytest.raises(FileNotFoundError) as error:
        load_image_data("local", None, {**folders, "test": str(tmp_path / "test")})
    message = (
        ": image folders not found: no test split directory here, expected one directory per split with one "
        "sub-folder of images per class"
    )
    assert_one_error(error, tmp_path / "test", message)
    # Files that datasets' imagefolder skips (hidden, not images) and hidden folders are no error.
    (tmp_path / "train" / ".DS_Store").write_bytes(b"\x00\x01")
    (tmp_path / "train" / "a" / "notes.txt").write_text("taken on a sunny day")
    png(tmp_path / "train" / "b" / ".thumbnails" / "1.png")
    data = load_image_data("local", None, folders)
    assert data["train"].features["label"].names == ["a", "b"] and len(data["train"]) == 2


def test_a_few_thousand_images_check_in_seconds(digits_folders):
    start = time.perf_counter()
    check_image_folders(digits_folders)  # 1,797 PNGs, their checksums and pixels
    assert time.perf_counter() - start < 10


# Recipe overrides ------------------------------------------------------------------------------------------------

#: Overrides that ended in a traceback (TypeError, yaml's errors), in a report of more lines than problems, or in a
#: run that failed after writing its directory; all found by test_properties.py. (The override, the problem.)
BAD_OVERRIDES = {
    "kind-a-list": ("kind=[1]", "kind: expected the name of a task kind, got [1]"),
    "unclosed-flow-mapping": (
        "ea.alpha={a:",
        "ea.alpha: cannot read the value '{a:' as YAML (expected the node content, but found '<stream end>'); quote "
        "it to give a string",
    ),
    "reserved-character": (
        "ea.alpha=@x",
        "ea.alpha: cannot read the value '@x' as YAML (found character '@' that cannot start any token); quote it to "
        "give a string",
    ),
    "python-tag": (
        "model.name_or_path=!!python/name:os.system",
        "model.name_or_path: cannot read the value '!!python/name:os.system' as YAML (could not determine a "
        "constructor for the tag 'tag:yaml.org,2002:python/name:os.system'); quote it to give a string",
    ),
    "newline-in-a-key": ('train={"a\\nb": 1}', "train.a\\nb: unknown key"),
    "carriage-return-in-a-key": ("0\r0=1", "0\\r0: unknown key"),
    "nan-epochs": ("train.epochs=.nan", "train.epochs: expected a finite number, got nan"),
}


@pytest.mark.parametrize("name", BAD_OVERRIDES)
def test_a_bad_override_is_one_problem_on_one_line(name, capsys):
    override, problem = BAD_OVERRIDES[name]
    assert main(["validate", "quickstart", override]) == 2
    assert capsys.readouterr() == ("", f"ea-hf validate: error: 1 problem in the recipe:\n  {problem}\n")


def test_a_run_with_nan_epochs_stops_before_it_writes_its_directory(tmp_path, capsys):
    """Before: the Trainer failed at its first step ("cannot convert float NaN to integer", exit 2) and left the
    run directory with its recipe.yaml and checkpoints/ folder, which a rerun took for a run to --resume."""
    run_dir = tmp_path / "run"
    assert main(["run", "quickstart", *SST2_SAMPLE, "train.epochs=.nan", f"output_dir={run_dir}"]) == 2
    assert "train.epochs: expected a finite number, got nan" in capsys.readouterr().err
    assert not run_dir.exists()

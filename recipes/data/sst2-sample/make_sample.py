"""Write the synthetic SST-2-format sample used by the quickstart recipe (train.tsv, validation.tsv).

The sentences are generated from templates (this is not SST-2 data: the real corpus is on the Hub as
nyu-mll/glue); they only give the offline quickstart a small, learnable binary sentiment task with the
GLUE column names (sentence, label) and label ids (0 negative, 1 positive). Deterministic: re-running it
rewrites the same files.
"""

import csv
import random
from pathlib import Path

SUBJECTS = [
    "the film",
    "this movie",
    "the plot",
    "the acting",
    "the soundtrack",
    "the script",
    "the ending",
    "the cast",
    "the director's latest work",
    "the story",
    "the dialogue",
    "the cinematography",
]
POSITIVE = [
    "wonderful",
    "moving",
    "brilliant",
    "delightful",
    "gripping",
    "charming",
    "superb",
    "funny",
    "beautifully made",
    "a joy to watch",
]
NEGATIVE = [
    "dull",
    "boring",
    "clumsy",
    "tedious",
    "painful",
    "forgettable",
    "a mess",
    "lifeless",
    "predictable",
    "a waste of time",
]
VERBS = ["is", "was", "feels", "seemed", "turns out to be"]
ADVERBS = ["", "really ", "truly ", "rather ", "quite "]


def sentence(rng: random.Random) -> tuple[str, int]:
    label = rng.randint(0, 1)
    negated = rng.random() < 0.25
    adjective = rng.choice(POSITIVE if label != negated else NEGATIVE)
    verb = rng.choice(VERBS)
    negation = "not " if negated else ""
    text = f"{rng.choice(SUBJECTS)} {verb} {negation}{rng.choice(ADVERBS)}{adjective}"
    if rng.random() < 0.3:
        text += rng.choice([", honestly", " from start to finish", " in every way", ", as expected"])
    return text + " .", label


def main() -> None:
    rng = random.Random(2021)
    here = Path(__file__).parent
    for split, size in [("train", 480), ("validation", 120)]:
        with open(here / f"{split}.tsv", "w", newline="") as handle:
            writer = csv.writer(handle, delimiter="\t", quoting=csv.QUOTE_NONE, escapechar="\\", lineterminator="\n")
            writer.writerow(["sentence", "label"])
            for _ in range(size):
                writer.writerow(sentence(rng))


if __name__ == "__main__":
    main()

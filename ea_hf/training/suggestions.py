"""The one "did you mean" of ea_hf's error messages: recipe keys and choices, task kinds, GLUE tasks, recipe names."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'X'?)`` for the choice closest to ``name``, or ``""`` where none is close (difflib's
    ratio below 0.6); the text goes at the end of a message.

    Example:
        >>> "unknown key" + did_you_mean("learnig_rate", ["learning_rate", "epochs"])
        "unknown key (did you mean 'learning_rate'?)"
        >>> did_you_mean("zzz", ["learning_rate"])
        ''
    """
    close = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""

"""The built-in task kinds, registered here: one module per kind, one line per kind in the list below.

To add a kind, write ``<name>.py`` with a :class:`~ea_hf.training.task_kind.TaskKind` subclass (its recipe
class, checks, data, preprocessing, metrics and card information; ``image.py`` is a short example) and add it
to ``BUILTIN_KINDS``.
"""

from ..task_kind import register_task_kind
from .causal_lm import CausalLMKind
from .glue import GlueKind
from .image import ImageKind
from .timeseries import TimeSeriesKind

BUILTIN_KINDS = (GlueKind(), ImageKind(), TimeSeriesKind(), CausalLMKind())

for _kind in BUILTIN_KINDS:
    register_task_kind(_kind)

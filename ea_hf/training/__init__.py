"""Fine-tuning: recipes (``recipe.py``), the run-directory format (``run_dir.py``), Trainer set-up and runs
(``trainer.py``) and the task kinds as plugins (``task_kind.py``, ``kinds/``). Needs the ``train`` extra.

Importing this package registers the built-in task kinds.
"""

from . import kinds  # noqa: F401  (registers the built-in task kinds)
from .recipe import Recipe, RecipeError, expand_sweep, list_recipes, load_recipe, recipe_from_dict
from .run_dir import compare_runs, read_metrics, read_run_recipe
from .task_kind import TaskKind, get_task_kind, register_task_kind, task_kinds

__all__ = [
    "Recipe",
    "RecipeError",
    "TaskKind",
    "compare_runs",
    "expand_sweep",
    "get_task_kind",
    "list_recipes",
    "load_recipe",
    "read_metrics",
    "read_run_recipe",
    "recipe_from_dict",
    "register_task_kind",
    "task_kinds",
]

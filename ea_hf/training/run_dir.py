"""The run-directory format, and reading finished runs (``ea-hf eval``, ``compare``, ``card``, ``push``).

Run directory layout::

    recipe.yaml                  the resolved recipe (file + overrides + defaults)
    config.json, model.safetensors, modeling files, tokenizer files   the final model, as ea_hf.patch saves it
    adapter_config.json, adapter_model.safetensors                    instead, for a PEFT run: the adapter
    checkpoints/checkpoint-N/    Trainer checkpoints (resume from the last one with ``resume=True``)
    pretrained/                  a pre-training phase's model, for kinds that have one
    eval/<split>/metrics.json    metrics of each evaluated split
    eval/<split>/per_example.json   one score per example, in the split's order (kinds that have one)
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from ..integrations.peft import ADAPTER_CONFIG
from ..modeling.settings import EvolvingAttentionSettings
from .data_files import one_line
from .recipe import Recipe, recipe_from_dict
from .task_kind import get_task_kind

CHECKPOINTS = "checkpoints"
RECIPE_FILE = "recipe.yaml"
EVAL_DIR = "eval"
PRETRAINED_DIR = "pretrained"
CONFIG_FILE = "config.json"
TRAINER_STATE_FILE = "trainer_state.json"
PER_EXAMPLE_FILE = "per_example.json"

#: ea_hf 0.1 wrote every kind's data fields and a ``pretrain`` section into each run's recipe.yaml; a kind's
#: schema now has only its own. These keys are dropped where the run's kind does not have them.
V0_1_DATA_KEYS = (
    "task", "source", "archive", "hub_id", "files", "max_length", "image_column", "label_column", "image_size",
    "crop_scale", "horizontal_flip", "max_train_samples", "max_eval_samples", "validation_fraction", "split_seed",
)  # fmt: skip
V0_1_SECTIONS = ("pretrain",)


def read_run_recipe(run_dir: str | Path, *, check_environment: bool = True) -> Recipe:
    """The recipe a run ran with (its ``recipe.yaml``), also for runs written by ea_hf 0.1;
    ``check_environment=False``: without the checks of what this machine has installed (see
    :func:`~.recipe.recipe_from_dict`), to describe a run rather than to run it."""
    path = Path(run_dir) / RECIPE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no {RECIPE_FILE})")
    data = yaml.safe_load(path.read_text())
    cleaned = _without_v0_1_keys(data) if isinstance(data, Mapping) else data
    return recipe_from_dict(cleaned, check_environment=check_environment)


def _without_v0_1_keys(data: Mapping[str, Any]) -> dict[str, Any]:
    try:
        schema = get_task_kind(data.get("kind", Recipe.kind)).recipe_class
    except ValueError:
        return dict(data)  # the recipe check names the unknown kind
    sections = {field.name: field for field in dataclasses.fields(schema)}
    cleaned = {key: value for key, value in data.items() if key in sections or key not in V0_1_SECTIONS}
    if isinstance(cleaned.get("data"), Mapping):
        data_fields = {field.name for field in dataclasses.fields(sections["data"].default_factory())}
        cleaned["data"] = {
            key: value for key, value in cleaned["data"].items() if key in data_fields or key not in V0_1_DATA_KEYS
        }
    return cleaned


def write_atomically(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` so that a reader (or a process killed meanwhile) sees the old file or the new
    one, never half of one: a temporary file beside it, flushed, then renamed over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        with open(partial, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def write_metrics(run_dir: Path, split: str, metrics: dict[str, Any], folder: str = EVAL_DIR) -> Path:
    text = json.dumps(metrics, indent=2, sort_keys=True) + "\n"
    return write_atomically(run_dir / folder / split / "metrics.json", text)


def write_per_example(run_dir: Path, split: str, scores: Sequence[float], folder: str = EVAL_DIR) -> Path:
    text = json.dumps([float(score) for score in scores]) + "\n"
    return write_atomically(run_dir / folder / split / PER_EXAMPLE_FILE, text)


def write_evaluation(
    run_dir: Path, metrics: Mapping[str, dict[str, Any]], per_example: Mapping[str, Sequence[float]]
) -> Path:
    """Write a whole evaluation (every split's metrics, and per-example scores where there are some) so that
    ``eval/`` holds all of it or none: written into a folder beside it, then swapped in. A run whose ``eval/``
    exists was evaluated to the end, which is what ``--skip-finished`` relies on. Splits evaluated before and
    not now (a test split evaluated after a selection on validation) are kept."""
    final = run_dir / EVAL_DIR
    for stale in run_dir.glob(f"{EVAL_DIR}.partial-*"):  # left by a process killed while writing
        shutil.rmtree(stale, ignore_errors=True)
    partial = run_dir / f"{EVAL_DIR}.partial-{os.getpid()}"
    partial.mkdir(parents=True)
    for kept in final.iterdir() if final.is_dir() else ():
        if kept.is_dir() and kept.name not in metrics:
            shutil.copytree(kept, partial / kept.name)
    for split, values in metrics.items():
        write_metrics(run_dir, split, values, folder=partial.name)
    for split, scores in per_example.items():
        write_per_example(run_dir, split, scores, folder=partial.name)
    if final.exists():  # re-evaluated (ea-hf eval): the old evaluation goes once the new one is complete
        previous = run_dir / f"{EVAL_DIR}.partial-{os.getpid()}-previous"
        os.replace(final, previous)
        os.replace(partial, final)
        shutil.rmtree(previous)
    else:
        os.replace(partial, final)
    return final


def last_complete_checkpoint(run_dir: str | Path) -> str | None:
    """The Trainer checkpoint of ``run_dir`` to resume from: the latest one that was written to the end, or
    None if there is none.

    Trainer writes a checkpoint's files in turn and ``trainer_state.json`` last, and does not write them
    atomically: a process killed while saving leaves a newer folder without a readable state, which
    ``transformers.trainer_utils.get_last_checkpoint`` would still pick (and resuming from it fails).
    """
    folder = Path(run_dir) / CHECKPOINTS
    if not folder.is_dir():
        return None
    steps = []
    for path in folder.glob("checkpoint-*"):
        step = path.name.removeprefix("checkpoint-")
        if step.isdigit() and _readable_json(path / TRAINER_STATE_FILE):
            steps.append((int(step), path))
    return str(max(steps)[1]) if steps else None


#: Less free space than this, after a write failed, is taken for a full disk.
NEARLY_FULL = 1 << 20


def disk_full_error(error: BaseException, run_dir: str | Path) -> OSError | None:
    """An ``OSError(ENOSPC)`` that says where the disk filled up and how the run goes on, if ``error`` came from a
    full disk; else None.

    Libraries do not all say so: ``torch.save`` reports a short write as a ``RuntimeError`` ("unexpected pos"),
    so an error raised while the run directory's disk has almost no space left counts too.

    Example:
        >>> import errno, tempfile
        >>> disk_full_error(OSError(errno.ENOSPC, "No space left on device"), tempfile.mkdtemp()).errno == errno.ENOSPC
        True
        >>> disk_full_error(ValueError("a bad label"), tempfile.mkdtemp()) is None
        True
    """
    chain, cause = [], error
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    said = any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in chain)
    try:
        free = shutil.disk_usage(run_dir).free
    except OSError:
        free = None
    if not said and (free is None or free >= NEARLY_FULL):
        return None
    last = last_complete_checkpoint(run_dir)
    where = f"the last complete checkpoint is {last}" if last else "there is no complete checkpoint yet"
    return OSError(
        errno.ENOSPC,
        f"no space left on the disk of {run_dir} ({free if free is not None else 'unknown'} bytes free) while "
        f"the run was writing ({one_line(error)}); {where}. Free some space, "
        "then continue with --resume",
    )


def _readable_json(path: Path) -> bool:
    try:
        json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return True


def read_per_example(run_dir: str | Path, split: str) -> list[float] | None:
    """The per-example scores a run saved for ``split``; None if it saved none."""
    path = Path(run_dir) / EVAL_DIR / split / PER_EXAMPLE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def is_finished(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds a finished, evaluated run (what ``ea-hf run --skip-finished`` skips)."""
    try:
        check_finished(run_dir)
    except FileNotFoundError:
        return False
    return bool(read_metrics(run_dir))


def read_metrics(run_dir: str | Path) -> dict[str, dict]:
    """The metrics a run saved for each evaluated split (``eval/<split>/metrics.json``).

    Args:
        run_dir: a run directory, as ``ea-hf run`` writes it.

    Returns:
        The metrics by split name, in split-name order; empty where the run evaluated nothing (or the directory
        does not exist).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as run_dir:
        ...     _ = write_metrics(Path(run_dir), "validation", {"accuracy": 0.75})
        ...     read_metrics(run_dir)
        {'validation': {'accuracy': 0.75}}
    """
    root = Path(run_dir) / EVAL_DIR
    return {path.parent.name: json.loads(path.read_text()) for path in sorted(root.glob("*/metrics.json"))}


def check_finished(run_dir: str | Path) -> Path:
    """``run_dir`` as a Path if it holds a finished model (or adapter); FileNotFoundError saying what is missing."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {str(run_dir)!r} does not exist")
    if not (run_dir / CONFIG_FILE).is_file() and not (run_dir / ADAPTER_CONFIG).is_file():
        raise FileNotFoundError(
            f"{run_dir} holds no finished model ({CONFIG_FILE} or {ADAPTER_CONFIG}); did the run end?"
        )
    return run_dir


def describe_evolution(settings: EvolvingAttentionSettings) -> str:
    """A short label for a comparison table: ``a=0.2 b=0.2 k=3`` (``residual a=0.2``, ``echo S=2 scalar``,
    ``linear a=0 b=0.2 k=3``); learned gates add ``learned gates``, alpha and beta being their start.

    Example:
        >>> describe_evolution(EvolvingAttentionSettings.for_method("conv", gates="learned"))
        'a=0 b=0 k=3 learned gates'
    """
    gates = " learned gates" if settings.gates == "learned" else ""
    if settings.method == "echo":
        return f"echo S={settings.echoes} {settings.echo_state}"
    if settings.method == "residual":
        return f"residual a={settings.alpha:g}{gates}"
    method = "linear " if settings.method == "linear" else ""
    return f"{method}a={settings.alpha:g} b={settings.beta:g} k={settings.kernel_size}{gates}"


def compare_runs(run_dirs: list[str | Path], splits: Sequence[str] | None = None) -> str:
    """A table of runs side by side: task, EA settings and the task's metrics for every evaluated split (only
    ``splits`` where given)."""
    rows = []
    for run_dir in run_dirs:
        recipe = read_run_recipe(run_dir)
        names = recipe.task_kind.metric_names(recipe)
        ea = describe_evolution(recipe.evolution()) if recipe.ea.enabled else "off"
        for split, metrics in read_metrics(run_dir).items():
            if splits is not None and split not in splits:
                continue
            scores = " ".join(f"{name}={metrics[name]:.4f}" for name in names if name in metrics)
            rows.append((str(run_dir), recipe.task_kind.task_label(recipe), ea, split, scores))
    if not rows:
        return "no evaluated runs"
    header = ("run", "task", "ea", "split", "metrics")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in [header, *rows]]
    return "\n".join(lines)

"""Implementations of the ``ea-hf`` sub-commands (imported lazily: they pull in torch and transformers)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers

import ea_hf

from ..hub.upload import save_preprocessor
from . import settings_from_arguments


def _model_class(model: str, auto_class: str | None) -> type:
    if auto_class is not None:
        cls = getattr(transformers, auto_class, None)
        if cls is None:
            raise ValueError(f"transformers has no class {auto_class!r}")
        return cls
    config = transformers.AutoConfig.from_pretrained(model)
    for name in config.architectures or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModel


def _looks_like_path(name: str) -> bool:
    """Whether ``name`` can only be a local path: a Hub id is ``NAME`` or ``OWNER/NAME``, never absolute or
    relative (``./``, ``../``) or with more than one slash."""
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def patch(args: argparse.Namespace) -> int:
    out_dir = Path(args.out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty; choose a new directory")
    settings = settings_from_arguments(args)  # checked before the model is loaded
    if _looks_like_path(args.model) and not Path(args.model).exists():
        raise FileNotFoundError(f"{args.model} does not exist (neither a local directory nor a Hub id)")
    if args.sentence_transformers:
        return _patch_sentence_transformer(args, settings, out_dir)
    model = _model_class(args.model, args.auto_class).from_pretrained(args.model)
    torch.manual_seed(args.seed)
    ea_hf.patch(model, settings, decoder=args.decoder, cross=args.cross)
    model.save_pretrained(out_dir)
    preprocessor = save_preprocessor(args.model, out_dir)
    print(ea_hf.summary(model))
    print(f"saved {type(model).__name__} to {out_dir}" + (f" with its {preprocessor}" if preprocessor else ""))
    return 0


def _patch_sentence_transformer(
    args: argparse.Namespace, settings: ea_hf.EvolvingAttentionSettings, out_dir: Path
) -> int:
    from ..integrations.sentence_transformers import (
        import_sentence_transformers,
        patch_sentence_transformer,
        transformers_models,
    )

    if args.auto_class is not None:
        raise ValueError("--auto-class does not apply with --sentence-transformers (it loads MODEL with AutoModel)")
    sentence_transformers = import_sentence_transformers()
    # sentence-transformers reads the folder's modules.json, or wraps a plain checkpoint with mean pooling. On
    # the CPU the new weights are drawn as without --sentence-transformers (same seed, same weights).
    model = sentence_transformers.SentenceTransformer(args.model, device="cpu")
    torch.manual_seed(args.seed)
    patch_sentence_transformer(model, settings, decoder=args.decoder, cross=args.cross)
    model.save(str(out_dir))
    for inner in transformers_models(model):
        print(ea_hf.summary(inner))
    print(f"saved a SentenceTransformer ({', '.join(type(module).__name__ for module in model)}) to {out_dir}")
    return 0


def summary(args: argparse.Namespace) -> int:
    model = transformers.AutoModel.from_pretrained(args.model)
    if not ea_hf.is_patched(model):
        raise ValueError(f"{args.model} is not an evolving attention checkpoint")
    print(ea_hf.summary(model))
    return 0


def ls(args: argparse.Namespace) -> int:
    from ..training.recipe import list_recipes, load_recipe, recipe_name

    paths = list_recipes()
    width = max((len(recipe_name(path)) for path in paths), default=0)  # the longest name sets the column
    for path in paths:
        try:
            description = load_recipe(path).description
        except ValueError as error:
            description = f"(invalid: {error})"
        print(f"{recipe_name(path):<{width}}  {description}")
    return 0


def cp(args: argparse.Namespace) -> int:
    import yaml

    from ..training.recipe import load_recipe, resolve_recipe_path

    source = resolve_recipe_path(args.name)
    dest = Path(args.dest)
    if dest.is_dir():
        dest = dest / source.name
    if dest.exists():
        raise FileExistsError(f"{dest} exists; not overwriting it")
    text = source.read_text()
    # Data paths in a recipe are relative to it; point the copy's at the shipped files (comments kept).
    raw_files = (yaml.safe_load(text).get("data") or {}).get("files") or {}
    for raw, resolved in zip(raw_files.values(), load_recipe(source).data.files.values(), strict=True):
        if raw != resolved:
            text = text.replace(f" {raw}", f" {resolved}")
    dest.write_text(text)
    print(f"copied {source.stem} to {dest}")
    return 0


def validate(args: argparse.Namespace) -> int:
    from ..training.recipe import expand_sweep, load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    runs = expand_sweep(recipe)
    print(f"{args.recipe}: valid ({len(runs)} run{'s' if len(runs) != 1 else ''})")
    for run in runs:
        print(f"  {run.output_dir}")
    return 0


def _launch(args: argparse.Namespace) -> int:
    """Re-run this ``ea-hf run`` in ``args.nproc_per_node`` processes under torchrun; its exit status."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc_per_node}"]
    command += ["-m", "ea_hf.cli", "run", args.recipe, *args.overrides]
    command += [flag for flag, on in (("--resume", args.resume), ("--skip-finished", args.skip_finished)) if on]
    return subprocess.call(command)


def run(args: argparse.Namespace) -> int:
    from ..training.recipe import expand_sweep, load_recipe

    runs = expand_sweep(load_recipe(args.recipe, args.overrides))  # every combination validated up front
    if args.nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node must be at least 1, got {args.nproc_per_node}")
    if args.nproc_per_node > 1:
        if "WORLD_SIZE" in os.environ:
            raise ValueError("--nproc-per-node inside a distributed launch; use one or the other")
        return _launch(args)
    status = _run_each(args, runs)
    if "WORLD_SIZE" in os.environ:  # one of torchrun's processes
        _leave_process_group()
    return status


def _leave_process_group() -> None:
    """Destroy the process group that a torchrun process's training joined, before the interpreter exits. Left to
    the exit, gloo's worker threads are torn down during interpreter finalisation, and a rank may abort
    ("terminate called without an active exception", exit -6) after its run has finished and saved (pytorch
    #190489). Only after a run that succeeded: a rank that failed may leave the others in a collective, which
    the destruction would wait on."""
    import torch.distributed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _run_each(args: argparse.Namespace, runs: list) -> int:
    from ..training.evidence import pools_seeds, seed_evidence
    from ..training.run_dir import compare_runs

    if runs[0].select.metric is not None:
        status = _run_selection(args, runs)
    else:
        _train_each(args, runs)
        status = 0
        if _is_main():
            run_dirs = [recipe.output_dir for recipe in runs]
            print(compare_runs(run_dirs))
            if pools_seeds(run_dirs):
                print(seed_evidence(run_dirs))
    notes = dict.fromkeys(recipe.evidence for recipe in runs if recipe.evidence and recipe.ea.enabled)
    if _is_main() and notes:
        print("\n".join(["", *notes]))
    return status


def _is_main() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _train_each(args: argparse.Namespace, runs: list, eval_splits: list[str] | None = None) -> None:
    """Train and evaluate each run in turn (``eval_splits``: only these), skipping the finished ones where asked."""
    from ..training.run_dir import is_finished
    from ..training.trainer import run_recipe

    durations: list[float] = []
    for index, recipe in enumerate(runs):
        if args.skip_finished and is_finished(recipe.output_dir):
            if _is_main():
                print(
                    f"[ea-hf] run {index + 1} of {len(runs)}: {recipe.output_dir} is finished; skipped", file=sys.stderr
                )
            continue
        if _is_main() and len(runs) > 1:  # where a long sweep stands: to stderr, beside Trainer's progress bars
            print(progress_line(index, len(runs), recipe.output_dir, durations), file=sys.stderr, flush=True)
        start = time.monotonic()
        run_recipe(recipe, resume=args.resume, eval_splits=eval_splits)  # its metrics: in the table that follows
        durations.append(time.monotonic() - start)


def _run_selection(args: argparse.Namespace, runs: list) -> int:
    """Selection on validation (``ea_hf.training.selection``): every run trained and evaluated on the selection
    split, the choice, then the test split for the chosen configuration and the baseline only."""
    from ..training.run_dir import read_metrics
    from ..training.selection import held_out_report, select, selected_runs, write_selection
    from ..training.trainer import evaluate_run

    settings = runs[0].select
    _train_each(args, runs, eval_splits=[settings.split])
    _wait_for_everyone()  # the main process wrote every run's scores
    selection = select(runs)
    if _is_main():
        write_selection(_common_folder(runs), selection)
        print(selection.table())
    chosen = selected_runs(runs, selection)
    for recipe in chosen:
        if args.skip_finished and settings.test_split in read_metrics(recipe.output_dir):
            continue
        evaluate_run(recipe.output_dir, splits=[settings.test_split])
    _wait_for_everyone()
    if _is_main():
        print(held_out_report(runs, selection))
    return 0


def _common_folder(runs: list) -> Path:
    """The folder that holds every run of a sweep (its ``output_dir``)."""
    return Path(os.path.commonpath([recipe.output_dir for recipe in runs]))


def _wait_for_everyone() -> None:
    """A barrier between the processes of a distributed launch (none in one process)."""
    import torch.distributed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def progress_line(index: int, total: int, name: str, durations: list[float]) -> str:
    """Which run of a multi-run recipe starts, and (once one has finished) the time taken and an estimate of the
    time left, from the mean duration of the finished runs.

    Example:
        >>> progress_line(0, 9, "runs/jv/transformer/seed=1", [])
        '[ea-hf] run 1 of 9: runs/jv/transformer/seed=1'
        >>> progress_line(3, 9, "runs/jv/dc/seed=1", [50.0, 70.0, 60.0])
        '[ea-hf] run 4 of 9: runs/jv/dc/seed=1 (3 done in 3 min 0 s; about 6 min 0 s left)'
    """
    line = f"[ea-hf] run {index + 1} of {total}: {name}"
    if not durations:
        return line
    left = sum(durations) / len(durations) * (total - index)
    return f"{line} ({len(durations)} done in {_minutes(sum(durations))}; about {_minutes(left)} left)"


def _minutes(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s"


def eval(args: argparse.Namespace) -> int:  # noqa: A001  (the sub-command's name)
    from ..training.run_dir import compare_runs
    from ..training.trainer import evaluate_run

    print(compare_runs([args.run_dir], splits=list(evaluate_run(args.run_dir))))
    return 0


def compare(args: argparse.Namespace) -> int:
    from ..training.evidence import seed_evidence
    from ..training.run_dir import compare_runs

    if not args.seeds and (args.reference or args.metric or args.split):
        raise ValueError("--reference, --metric and --split go with --seeds")
    if args.seeds:
        print(seed_evidence(args.run_dirs, reference=args.reference, metric=args.metric, split=args.split))
    else:
        print(compare_runs(args.run_dirs))
    return 0


def card(args: argparse.Namespace) -> int:
    from ..hub.runs import run_card
    from ..training.run_dir import write_atomically

    text = str(run_card(args.run_dir, args.repo_id))
    if args.output is None:
        print(text)
    else:
        write_atomically(args.output, text)  # a card being written is never left half-written
        print(f"wrote the model card of {args.run_dir} to {args.output}")
    return 0


def export(args: argparse.Namespace) -> int:
    from ..integrations.onnx import export_checkpoint
    from ..training.run_dir import check_finished

    run_dir = check_finished(args.run_dir)
    output = Path(args.output) if args.output else run_dir / "onnx"
    exported = export_checkpoint(run_dir, output)
    print(f"wrote {exported.path} ({exported.head.task}) with its config and preprocessor files to {output}")
    return 0


def push(args: argparse.Namespace) -> int:
    from ..hub.runs import push_run

    commit = push_run(
        args.run_dir,
        args.repo_id,
        private=args.private or None,
        revision=args.revision,
        endpoint=args.endpoint,
        commit_message=args.commit_message,
    )
    print(f"pushed {args.run_dir} to {commit.repo_url} ({commit.oid[:12]}): {commit.commit_url}")
    return 0


def _viz_inputs(model_path: str, args: argparse.Namespace):
    """Model inputs and axis labels for ``ea-hf viz``: tokenised text, or a processed image."""
    if args.text is not None:
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
        inputs = tokenizer(args.text, return_tensors="pt")
        return dict(inputs), tokenizer.convert_ids_to_tokens(inputs["input_ids"][0])
    from PIL import Image

    processor = transformers.AutoImageProcessor.from_pretrained(model_path)
    return dict(processor(images=Image.open(args.image).convert("RGB"), return_tensors="pt")), None


def viz(args: argparse.Namespace) -> int:
    from ..training.models import resolve_model_path
    from ..training.run_dir import RECIPE_FILE, read_run_recipe
    from ..visualization import plot_attention

    model = transformers.AutoModel.from_pretrained(args.run_dir).eval()
    inputs, tokens = _viz_inputs(args.run_dir, args)
    models = {f"{'EA' if ea_hf.is_patched(model) else 'model'} ({Path(args.run_dir).name})": model}
    if args.compare is not None:
        name = args.compare
        if name == "base":
            if not (Path(args.run_dir) / RECIPE_FILE).is_file():
                raise ValueError(f"{args.run_dir} is not a run directory: name the model to compare with")
            name = read_run_recipe(args.run_dir).model.name_or_path
        base = transformers.AutoModel.from_pretrained(resolve_model_path(name)).eval()
        models[f"{'EA' if ea_hf.is_patched(base) else 'base'} ({name})"] = base
    figure = plot_attention(models, inputs, layers=args.layers, heads=args.heads, tokens=tokens)
    figure.savefig(args.output, dpi=150)
    print(f"wrote the attention maps of {', '.join(models)} to {args.output}")
    return 0

"""``ea-hf``: the command-line entry point.

Sub-commands:
    ea-hf patch MODEL OUT_DIR [--alpha A --beta B ...]   patch a checkpoint and save it as an EA checkpoint
                                                          (seq2seq: --decoder/--cross JSON settings or off;
                                                          --sentence-transformers: as a SentenceTransformer)
    ea-hf summary MODEL                                   list the evolving attention modules of a checkpoint
    ea-hf ls                                              list the shipped recipes
    ea-hf cp NAME DEST                                    copy a shipped recipe to edit it
    ea-hf validate RECIPE [key=value ...]                 check a recipe without loading any model
    ea-hf run RECIPE [key=value ...] [--resume] [--skip-finished] [--nproc-per-node N]
                                                          fine-tune and evaluate (every sweep combination)
    ea-hf eval RUN_DIR                                    re-evaluate the final model of a run
    ea-hf compare RUN_DIR ... [--seeds [--reference NAME]]
                                                          print the runs' metrics side by side; --seeds: pool
                                                          runs that differ only by seed (mean ± std, paired
                                                          bootstrap CI and sign test against the reference)
    ea-hf viz RUN_DIR --text "..." [--compare [MODEL]]    plot a run's attention maps layer by layer (PNG)
    ea-hf card RUN_DIR [-o README.md]                     render a run's model card (no network)
    ea-hf export --onnx RUN_DIR [--output DIR]            write model.onnx with its config and tokenizer
                                                          (default DIR: RUN_DIR/onnx), checked in onnxruntime
    ea-hf push RUN_DIR --repo-id USER/NAME [--private] [--revision BRANCH] [--endpoint URL]
                                                          upload a run with its model card (token: HF_TOKEN
                                                          or `hf auth login`)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import typing
from collections.abc import Sequence

from .. import __version__
from ..modeling.settings import METHOD_DEFAULTS, METHOD_DEPENDENT, EvolvingAttentionSettings


def _layers(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices, got {text!r}") from None


def _role_settings(text: str) -> dict | bool:
    """``off`` or a JSON object of settings, e.g. ``{"alpha": 0.1, "layers": [0, 1]}``."""
    if text.strip().lower() == "off":
        return False
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f'expected "off" or a JSON object such as \'{{"alpha": 0.1}}\', got {text!r}')
    return value


def add_settings_arguments(parser: argparse.ArgumentParser, settings_class: type = EvolvingAttentionSettings) -> None:
    """One option per field of the settings dataclass (``--kernel-size`` for ``kernel_size``), with its type,
    choices, default and help from the field: a setting added there is an option here."""
    hints = typing.get_type_hints(settings_class)
    for field in dataclasses.fields(settings_class):
        annotation = hints[field.name]
        options = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
        base_type = typing.get_origin(options[0]) or options[0]
        choices = field.metadata.get("choices")
        default = None if field.name in METHOD_DEPENDENT else field.default
        if field.name in METHOD_DEPENDENT:
            shown = _method_defaults(field.name)
        else:
            shown = field.metadata.get("unset", "none") if default is None else default
        parser.add_argument(
            f"--{field.name.replace('_', '-')}",
            type=_layers if base_type in (tuple, list) else base_type,
            choices=choices,
            default=default,
            metavar=None if choices else field.name.upper(),
            help=f"{field.metadata.get('help', field.name)} (default: {shown})",
        )


def _method_defaults(name: str) -> str:
    """The default of a setting that depends on the method, as ``--help`` states it: the value for the default
    method, then the others.

    Example:
        >>> _method_defaults("beta")
        '0.2; 0 for residual and echo'
    """
    index = METHOD_DEPENDENT.index(name)
    by_value: dict[float, list[str]] = {}
    for method, values in METHOD_DEFAULTS.items():
        by_value.setdefault(values[index], []).append(method)
    usual = METHOD_DEFAULTS[EvolvingAttentionSettings.method][index]
    others = [f"{value:g} for {' and '.join(methods)}" for value, methods in by_value.items() if value != usual]
    return "; ".join([f"{usual:g}", *others])


def settings_from_arguments(args: argparse.Namespace, settings_class: type = EvolvingAttentionSettings):
    """The settings the options of :func:`add_settings_arguments` describe (checked before any model loads)."""
    return settings_class.from_arguments(**{f.name: getattr(args, f.name) for f in dataclasses.fields(settings_class)})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ea-hf", description="Evolving Attention for Hugging Face Transformers")
    parser.add_argument("--version", action="version", version=f"ea_hf {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    patch = commands.add_parser("patch", help="patch a checkpoint with evolving attention and save it")
    patch.add_argument("model", help="Hub id or local directory of a supported checkpoint")
    patch.add_argument("out_dir", help="directory to write the EA checkpoint to (must not exist or be empty)")
    add_settings_arguments(patch)
    for role, what in [("decoder", "decoder self-attention"), ("cross", "encoder-decoder attention")]:
        patch.add_argument(
            f"--{role}",
            type=_role_settings,
            default=None,
            metavar="JSON|off",
            help=f"seq2seq models: {what} settings overriding the defaults (alpha 0, the encoder's beta, "
            "kernel and init), as a JSON object, or off",
        )
    patch.add_argument("--seed", type=int, default=0, help="seed for the new convolution weights (default: 0)")
    patch.add_argument(
        "--auto-class",
        default=None,
        help="transformers class to load MODEL with, e.g. AutoModelForSequenceClassification "
        "(default: the checkpoint's own architecture)",
    )
    patch.add_argument(
        "--sentence-transformers",
        action="store_true",
        help="load MODEL as a SentenceTransformer (a plain checkpoint gets mean pooling) and save a "
        "sentence-transformers folder (needs the sentence-transformers extra)",
    )

    summary = commands.add_parser("summary", help="list the evolving attention modules of an EA checkpoint")
    summary.add_argument("model", help="Hub id or local directory of an EA checkpoint")

    commands.add_parser("ls", help="list the shipped recipes")
    copy = commands.add_parser("cp", help="copy a shipped recipe to edit it")
    copy.add_argument("name", help="name of a shipped recipe (see ea-hf ls)")
    copy.add_argument("dest", help="file or directory to copy it to (an existing file is not overwritten)")
    for name, help_text in [
        ("validate", "check a recipe (and overrides) without loading any model"),
        ("run", "fine-tune and evaluate a recipe; a sweep runs every combination"),
    ]:
        command = commands.add_parser(name, help=help_text)
        command.add_argument("recipe", help="recipe file, or the name of a shipped recipe")
        command.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. ea.alpha=0.4")
        if name == "run":
            command.add_argument("--resume", action="store_true", help="continue from the last checkpoint of the run")
            command.add_argument(
                "--skip-finished",
                action="store_true",
                help="leave out the runs whose directory holds a finished, evaluated run (a sweep built up over "
                "several sittings: with --resume, an interrupted run continues)",
            )
            command.add_argument(
                "--nproc-per-node",
                type=int,
                default=1,
                metavar="N",
                help="data-parallel training in N processes on this machine, launched with torchrun "
                "(gloo on CPU; default: 1); `accelerate launch -m ea_hf.cli run ...` works too",
            )
    evaluate = commands.add_parser("eval", help="re-evaluate the final model of a run directory")
    evaluate.add_argument("run_dir")
    compare = commands.add_parser("compare", help="print the metrics of runs side by side")
    compare.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    compare.add_argument(
        "--seeds",
        action="store_true",
        help="pool runs that differ only by seed (runs/NAME/VARIANT/seed=S): mean ± std per group, and the "
        "reference's per-seed differences from each other group with a bootstrap CI and a sign test",
    )
    compare.add_argument(
        "--reference", default=None, help="the group the others are compared with (default: the first)"
    )
    compare.add_argument("--metric", default=None, help="the metric to compare (default: the task's headline metric)")
    compare.add_argument("--split", default=None, help="the split to compare (default: test if every run has it)")

    viz = commands.add_parser("viz", help="plot the attention maps of a run (or model) for one input, as a PNG")
    viz.add_argument("run_dir", help="run directory, EA checkpoint or any supported model (Hub id or directory)")
    source = viz.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="the input text")
    source.add_argument("--image", help="the input image (a file)")
    viz.add_argument("--layers", type=_layers, default=None, help="comma-separated layers to show (default: all)")
    viz.add_argument(
        "--heads", type=_layers, default=None, help="comma-separated heads, one row each (default: their mean)"
    )
    viz.add_argument(
        "--compare",
        nargs="?",
        const="base",
        default=None,
        metavar="MODEL",
        help="also plot MODEL on the same input, below (default: the run's base checkpoint, unpatched)",
    )
    viz.add_argument("--output", "-o", default="attention.png", help="PNG file to write (default: attention.png)")

    card = commands.add_parser("card", help="render the model card of a run directory (no network)")
    card.add_argument("run_dir")
    card.add_argument("--repo-id", default=None, help="repository id the card names (default: the recipe's name)")
    card.add_argument("--output", "-o", default=None, help="write the card to this file instead of printing it")
    export = commands.add_parser("export", help="export the model of a run directory to ONNX, for onnxruntime")
    export.add_argument(
        "--onnx", action="store_true", required=True, help="write model.onnx (the one format so far; onnx extra)"
    )
    export.add_argument("run_dir", help="run directory or saved (EA) checkpoint")
    export.add_argument("--output", "-o", default=None, help="directory to write, new or empty (default: RUN_DIR/onnx)")
    push = commands.add_parser("push", help="upload a run directory to the Hugging Face Hub with its model card")
    push.add_argument("run_dir")
    push.add_argument("--repo-id", required=True, help="USER/NAME or ORG/NAME of the model repository")
    push.add_argument("--private", action="store_true", help="create the repository as private")
    push.add_argument("--revision", default=None, metavar="BRANCH", help="branch to push to (created if needed)")
    push.add_argument("--endpoint", default=None, help="Hub endpoint (default: HF_ENDPOINT or huggingface.co)")
    push.add_argument("--commit-message", default=None)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may follow options (`run R --resume a=b c=d`), which argparse leaves unparsed.
    overrides = [arg for arg in extra if "=" in arg and not arg.startswith("-")] if hasattr(args, "overrides") else []
    unknown = [arg for arg in extra if arg not in overrides]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if overrides:
        args.overrides += overrides
    from .. import register_extensions

    register_extensions()  # left to here by the ea-hf command's entry point (ea_hf_cli), which parses without torch
    from . import commands

    try:
        return getattr(commands, args.command)(args)
    except BrokenPipeError:  # the reader went away (`ea-hf ls | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    except (ValueError, NotImplementedError, OSError, ImportError) as error:  # ImportError: a missing extra
        print(f"ea-hf {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

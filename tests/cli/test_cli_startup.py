"""``ea-hf --help``, ``--version`` and each command's ``--help`` answer without importing torch or transformers
(ea_hf_cli.py): they run in a fresh interpreter here, as the installed ``ea-hf`` script runs them, and the test
reads which modules it imported."""

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import ea_hf
from ea_hf.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ["torch", "transformers"]
# What the installed ea-hf script does (pip writes `from ea_hf_cli import main; sys.exit(main())`), then which of
# the heavy modules that left imported.
SCRIPT = """
import json, sys
from ea_hf_cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps([name for name in {heavy!r} if name in sys.modules]))
"""


def imported_by(*arguments: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(heavy=HEAVY), *arguments],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(result.stdout.splitlines()[-1])


def commands() -> list[str]:
    subparsers = next(action for action in build_parser()._actions if action.dest == "command")
    return sorted(subparsers.choices)


def test_every_command_is_checked():
    assert commands() == sorted(
        ["patch", "summary", "ls", "cp", "validate", "run", "eval", "compare", "viz", "card", "export", "push"]
    )


@pytest.mark.parametrize("arguments", [["--version"], ["--help"], *[[command, "--help"] for command in commands()]])
def test_help_and_version_import_neither_torch_nor_transformers(arguments):
    assert imported_by(*arguments) == []


def test_a_command_registers_the_auto_classes_before_it_runs(tmp_path):
    """The entry point leaves the registration to the command: ``ea-hf summary`` of an EA checkpoint loads it
    with transformers' AutoModel, which only knows ``ea-bert`` once registered."""
    from testing import tiny_model

    ea_hf.patch(tiny_model("bert"), alpha=0.2, beta=0.2).save_pretrained(tmp_path)
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(heavy=HEAVY), "summary", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "evolving attention modules" in result.stdout and json.loads(result.stdout.splitlines()[-1]) == HEAVY


def test_importing_ea_hf_registers_the_auto_classes():
    """What a user's ``import ea_hf`` does, in a fresh interpreter: transformers' AutoConfig knows the EA types."""
    code = "import ea_hf, transformers; print(transformers.AutoConfig.for_model('ea-bert').model_type)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["ea-bert"]


@pytest.mark.parametrize("package", ["ea_hf", "ea_hf.modeling"])
def test_the_lazy_public_names_are_the_ones_type_checkers_see(package):
    """A package that imports its public names on first use (``_PUBLIC``) also imports them under
    ``TYPE_CHECKING``, for type checkers and documentation tools: the same names from the same modules, and
    ``__all__`` lists them all."""
    module = importlib.import_module(package)
    tree = ast.parse(Path(module.__file__).read_text())
    guarded = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    seen = {
        alias.name: "." * statement.level + (statement.module or "")
        for statement in guarded.body
        for alias in statement.names
    }
    assert seen == module._PUBLIC
    assert set(module.__all__) == set(module._PUBLIC)
    assert all(getattr(module, name) is not None for name in module.__all__)  # each one imports

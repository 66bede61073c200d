"""Every dotted name the package's text cites exists: the ``ea_hf.x.y`` names in ea_hf's source (docstrings,
comments, messages), the docs pages, README.md and the READMEs of bench/, and the Sphinx roles of the docstrings
(``:func:`~.step.packed_gate```, ``:class:`Recipe```), resolved as Sphinx and the API reference's griffe extension
(docs/hooks/api_reference.py) resolve them. A name resolves when importing its longest module prefix and taking
the attributes after it succeeds; a dataclass's or NamedTuple's fields count as its attributes. So does every
file of the repository that the same text cites by its path (``ea_hf/ops/cpu/binding.py``,
``tests/ops/triton/test_evolution.py``).

Remote code: the files of ``ea_hf/modeling/`` are copied beside saved checkpoints, where the package is not
``ea_hf``; their relative roles (``.step``) must therefore name a sibling file, which a checkpoint's copy has too.
Their ``ea_hf.`` names cite the installed package (a reader of a copy finds them there) and resolve like any other.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ea_hf"
MODELING = PACKAGE / "modeling"
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", *sorted((ROOT / "bench").glob("**/README.md"))]

_spec = importlib.util.spec_from_file_location("api_reference", ROOT / "docs" / "hooks" / "api_reference.py")
api_reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(api_reference)

#: ``ea_hf.x.y`` as text cites it: not part of a longer dotted name (``torch.ops.ea_hf.convolve``), a path or a
#: URL, and without a trailing full stop.
DOTTED = re.compile(r"(?<![\w./-])ea_hf(?:\.[A-Za-z_]\w*)+")


def _fields(owner: Any) -> set[str]:
    if dataclasses.is_dataclass(owner):
        return {field.name for field in dataclasses.fields(owner)}
    return set(getattr(owner, "_fields", ()))


def resolve(dotted: str) -> Any:
    """The object a dotted name names; LookupError if none."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:end]))
        except ModuleNotFoundError as error:
            if error.name is not None and ".".join(parts[:end]).startswith(error.name):
                continue  # no such module: a shorter prefix, and attributes after it
            raise
        for name in parts[end:]:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # ea_hf.ADAPTERS, the table's name before 0.2
                if hasattr(obj, name):
                    obj = getattr(obj, name)
                elif name in _fields(obj):
                    obj = None  # a field without a class-level default
                else:
                    raise LookupError(f"{'.'.join(parts[:end])} has no {'.'.join(parts[end:])}")
        return obj
    raise LookupError(f"no module {parts[0]}")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _classes(tree: ast.Module, name: str) -> list[tuple[int, int, str]]:
    """(first line, last line, dotted path) of every class of a module, nested ones included."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                found.append((child.lineno, child.end_lineno, f"{prefix}.{child.name}"))
                visit(child, f"{prefix}.{child.name}")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, prefix)

    visit(tree, name)
    return found


def role_target(target: str, path: Path, line: int, classes: list[tuple[int, int, str]]) -> str:
    """The absolute dotted name of a role's target written at ``line`` of ``path``: relative to the package, a name
    of the enclosing class or of the module, or absolute."""
    module = module_name(path)
    relative = api_reference.absolute_target(target, module, path.name == "__init__.py")
    if relative is not None:
        return relative
    first = target.split(".")[0]
    enclosing = sorted((c for c in classes if c[0] <= line <= c[1]), key=lambda c: c[1] - c[0])
    for _, _, owner in enclosing:  # innermost first, as Sphinx looks
        try:
            cls = resolve(owner)
        except LookupError:
            continue
        if hasattr(cls, first) or first in _fields(cls):
            return f"{owner}.{target}"
    if hasattr(importlib.import_module(module), first):
        return f"{module}.{target}"
    return target


def _references() -> list[tuple[str, str, str]]:
    """(where, as written, dotted name) of every reference."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        where = path.relative_to(ROOT).as_posix()
        classes = _classes(ast.parse(text), module_name(path))
        for line, row in enumerate(text.splitlines(), start=1):
            for match in DOTTED.finditer(row):
                found.append((f"{where}:{line}", match[0], match[0]))
            for match in api_reference.ROLE.finditer(row):
                found.append((f"{where}:{line}", match[0], role_target(match["target"], path, line, classes)))
    for path in PAGES:
        for line, row in enumerate(path.read_text().splitlines(), start=1):
            for match in DOTTED.finditer(row):
                found.append((f"{path.relative_to(ROOT).as_posix()}:{line}", match[0], match[0]))
    return found


REFERENCES = _references()

#: A repository path as text cites it (``ea_hf/ops/cpu/csrc/evolve_cpu.cpp``, ``bench/results/x/y.{json,md}``):
#: a top-level folder of the repository, then folders and a file name, with at most one brace alternative.
CITED_PATH = re.compile(
    r"(?<![\w./-])((?:ea_hf|tests|bench|docs|recipes|model_cards)/[\w./*-]*(?:\{[\w.,]+\})?[\w.*/]*)"
)
#: What a cited path must end with to be checked: a file's suffix, or a folder's slash.
CHECKED = re.compile(r"(\.(py|cpp|md|json|yaml|toml|sh|safetensors|tar\.gz)|/)$")


#: Folders that runs write and the repository does not hold: the wheels of bench/fetch_wheels.sh and the results
#: of the benchmarks' CPU dry runs.
WRITTEN_BY_RUNS = ("bench/wheels/", "bench/results/cpu/")


def cited_paths(text: str) -> list[str]:
    """The repository paths ``text`` cites, a brace alternative (``x.{json,md}``) expanded to each path."""
    found = []
    for match in CITED_PATH.finditer(text):
        head, *brace = re.split(r"\{([\w.,]+)\}", match[1].rstrip("."), maxsplit=1)
        found += [f"{head}{choice}{brace[1]}" for choice in brace[0].split(",")] if brace else [head]
    return [path for path in found if CHECKED.search(path) and not path.startswith(WRITTEN_BY_RUNS)]


def _path_references() -> list[tuple[str, str]]:
    """(where, path) of every repository path that ea_hf's source, the docs pages and .ci/run cite."""
    found = []
    for path in [*sorted(PACKAGE.rglob("*.py")), *sorted(PACKAGE.rglob("*.cpp")), *PAGES, ROOT / ".ci" / "run"]:
        for line, row in enumerate(path.read_text().splitlines(), start=1):
            found += [(f"{path.relative_to(ROOT).as_posix()}:{line}", cited) for cited in cited_paths(row)]
    return found


PATH_REFERENCES = _path_references()


def test_the_references_are_found():
    """The scan finds what it looks for: names in the docs and the source, and roles of each form."""
    forms = {
        "a dotted name in the docs": r"^docs/.*\| ea_hf\.",
        "a dotted name in the source": r"^ea_hf/.*\| ea_hf\.",
        "a role, relative and shortened": r"\| :\w+:`~\.",
        "a role, relative": r"\| :\w+:`\.",
        "a role by a plain name": r"\| :\w+:`\w+`",
    }
    written = [f"{where} | {reference}" for where, reference, _ in REFERENCES]
    for form, pattern in forms.items():
        assert sum(bool(re.search(pattern, line)) for line in written) >= 3, form


def test_references_in_double_backticks_are_found_in_docstrings_and_docs():
    """``ea_hf.x.y`` in a docstring's double backticks and `ea_hf.x.y` in a docs page's backticks are scanned."""
    assert DOTTED.findall("the same in ``ea_hf.ops.cpu.binding.backward_pass``.") == [
        "ea_hf.ops.cpu.binding.backward_pass"
    ]
    assert DOTTED.findall("(`ea_hf.ops.triton`, not `torch.ops.ea_hf.convolve`)") == ["ea_hf.ops.triton"]
    written = {(where.split(":")[0], reference) for where, reference, _ in REFERENCES}
    assert ("ea_hf/modeling/convolution.py", "ea_hf.ops.cpu.binding.backward_pass") in written  # a docstring's
    assert any(where.startswith("docs/") and ref.startswith("ea_hf.ops") for where, ref in written)


def test_cited_paths_are_read_as_written():
    assert cited_paths("built by ``ea_hf/ops/cpu/build.py`` from ea_hf/ops/cpu/csrc/, see docs/performance.md.") == [
        "ea_hf/ops/cpu/build.py",
        "ea_hf/ops/cpu/csrc/",
        "docs/performance.md",
    ]
    assert cited_paths("`bench/results/x/bench_cpu.{json,md}` and tests/ops/triton/test_{evolution,tail}.py") == [
        "bench/results/x/bench_cpu.json",
        "bench/results/x/bench_cpu.md",
        "tests/ops/triton/test_evolution.py",
        "tests/ops/triton/test_tail.py",
    ]
    assert cited_paths("recipes/data, torch/ops/x.py, https://host/docs/x.md, bench/wheels/") == []


def test_every_cited_path_exists():
    assert len(PATH_REFERENCES) >= 50
    missing = [f"{where}: {path}" for where, path in PATH_REFERENCES if not any(ROOT.glob(path.rstrip("/")))]
    assert not missing, "\n".join(missing)


def test_every_reference_names_an_object():
    unresolved = []
    for where, written, dotted in REFERENCES:
        try:
            resolve(dotted)
        except LookupError as error:
            unresolved.append(f"{where}: {written} ({error})")
    assert not unresolved, "\n".join(unresolved)


def test_relative_references_in_the_remote_code_name_sibling_files():
    siblings = {path.stem for path in MODELING.glob("*.py")} - {"__init__"}
    outside = [
        f"{where}: {written}"
        for where, written, dotted in REFERENCES
        if where.startswith("ea_hf/modeling/")
        and re.search(r"`~?\.", written)
        and dotted.removeprefix("ea_hf.modeling.").split(".")[0] not in siblings
    ]
    assert not outside, "\n".join(outside)


@pytest.mark.parametrize(
    ("dotted", "resolves"),
    [
        ("ea_hf.modeling.kernels.FusedKernel", True),
        ("ea_hf.modeling.patching.PatchSummary.added_parameters", True),  # a field without a default
        ("ea_hf.ops.triton.attention_tail", True),
        ("ea_hf.ops.triton_kernels", False),
        ("ea_hf.modeling.step.FusedKernel", False),
        ("ea_hf.training.recipe.Recipe.no_such_field", False),
    ],
)
def test_resolve(dotted, resolves):
    if resolves:
        resolve(dotted)
    else:
        with pytest.raises(LookupError):
            resolve(dotted)


def test_role_targets_resolve_as_sphinx_does():
    path = MODELING / "kernels.py"
    classes = _classes(ast.parse(path.read_text()), "ea_hf.modeling.kernels")
    inside = next(first for first, _, name in classes if name.endswith(".FusedKernel")) + 1
    assert role_target(".step.packed_gate", path, 1, classes) == "ea_hf.modeling.step.packed_gate"
    assert role_target("fused_kernel", path, 1, classes) == "ea_hf.modeling.kernels.fused_kernel"
    assert role_target("evolve", path, inside, classes) == "ea_hf.modeling.kernels.FusedKernel.evolve"
    assert role_target("transformers.PreTrainedModel", path, 1, classes) == "transformers.PreTrainedModel"
    assert resolve(role_target("torch.Tensor", path, 1, classes)) is torch.Tensor  # kernels' own torch
    assert role_target(".modeling", PACKAGE / "__init__.py", 1, []) == "ea_hf.modeling"


def test_the_api_reference_links_the_roles_as_they_resolve():
    """The griffe extension of the API reference turns each role into an optional link to the name the test above
    resolves it to, and the project's ``Example:`` sections into griffe's doctest sections."""
    import griffe

    kernels = '''from .step import packed_gate


class Kernel:
    """Reads :func:`~.step.packed_gate`."""

    def evolve(self):
        """Before :meth:`backward`, as :func:`helper` and :class:`torch.Tensor`.

        Example:
            >>> 1
            1
        """

    def backward(self): ...


def helper(): ...
'''
    modules = {"__init__.py": "", "step.py": "def packed_gate(): ...\n", "kernels.py": kernels}
    with griffe.temporary_pypackage("pkg", modules) as package:
        loaded = griffe.load(
            "pkg", search_paths=[package.tmpdir], extensions=griffe.load_extensions(api_reference.ReferenceDocstrings)
        )
        link = re.compile(r'<autoref identifier="([\w.]+)" optional><code>([\w.]+)</code>')
        links = [link.findall(loaded[name].docstring.value) for name in ("kernels.Kernel", "kernels.Kernel.evolve")]
        evolve = loaded["kernels.Kernel.evolve"].docstring.value
    assert links == [
        [("pkg.step.packed_gate", "packed_gate")],
        [
            ("pkg.kernels.Kernel.backward", "backward"),
            ("pkg.kernels.helper", "helper"),
            ("torch.Tensor", "torch.Tensor"),
        ],
    ]
    assert "\nExamples:\n    >>> 1\n    1" in evolve
    assert not re.search(r"^\s*Example:", evolve, flags=re.M)

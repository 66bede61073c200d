"""The README's Python snippets run as written (offline, on the MiniLM checkpoint)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_the_quickstart():
    assert any("ea_hf.patch(model, alpha=0.2, beta=0.2)" in block for block in BLOCKS)


def test_readme_test_command_is_the_one_ci_runs():
    text = README.read_text()
    command = re.search(r"<!-- test-command -->\n```bash\n(.*?)\n```", text, flags=re.S).group(1)
    assert command == "python -m pytest -q"
    ci = (README.parent / ".ci" / "run").read_text()
    assert "test-command" in ci  # .ci/run reads the command from the README rather than repeating it


@pytest.mark.slow
def test_readme_python_blocks_run_in_order(tmp_path):
    """All blocks run in one fresh interpreter, in order (later blocks use what earlier ones saved)."""
    script = "\n\n".join(BLOCKS)
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "6 evolving attention modules, 7,848 added parameters" in run.stdout
    assert "EABertForSequenceClassification ea-bert" in run.stdout
    assert (tmp_path / "out" / "model.safetensors").exists()
    assert "EABertForSequenceClassification\n" in run.stdout  # the Trainer example's saved model loads as EA
    assert (tmp_path / "out-trainer" / "model_classes.py").exists()
    # The evidence section's reference: what predicting the training mean scores on the regression archives.
    assert "Covid3Month: predicting the training mean gives test RMSE 0.0447" in run.stdout
    assert "CardanoSentiment: predicting the training mean gives test RMSE 0.3003" in run.stdout


def test_readme_names_every_supported_architecture():
    """Each model_type of the architecture table appears in the README's tables, in backticks."""
    from ea_hf.modeling.architectures import supported_model_types

    text = README.read_text()
    assert not [model_type for model_type in supported_model_types() if f"`{model_type}`" not in text]

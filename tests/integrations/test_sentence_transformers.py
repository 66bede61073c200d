"""Sentence Transformers with evolving attention: all-MiniLM-L6-v2 patched as a ``SentenceTransformer`` encodes,
trains with a sentence-transformers loss on real pairs, saves, and loads back with ea_hf and without it
(``trust_remote_code``); ``ea-hf patch --sentence-transformers`` writes such a folder."""

import json
import math
import sys

import pytest
import torch
import transformers
from testing import SENTENCES, run_without_ea_hf

import ea_hf
from ea_hf.cli import main
from ea_hf.integrations.sentence_transformers import (
    patch_sentence_transformer,
    python_docs_pairs,
    transformers_models,
)

sentence_transformers = pytest.importorskip(
    "sentence_transformers", reason="Sentence Transformers is the optional sentence-transformers extra"
)
SentenceTransformer = sentence_transformers.SentenceTransformer

#: One short sentence among longer ones: in a batch it is padded.
LONGER = [
    "Evolving attention convolves the attention maps of the previous layer and mixes them into the next one.",
    "The for statement is used to iterate over the elements of a sequence or other iterable object.",
]


def encode(model, sentences=SENTENCES) -> torch.Tensor:
    return model.encode(sentences, convert_to_tensor=True, batch_size=32)


def minilm_sentence_transformer(path) -> "sentence_transformers.SentenceTransformer":
    return SentenceTransformer(str(path), device="cpu")


def evolution_weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for n, p in model.named_parameters() if n.endswith("evolving_attention.weight")]


ENCODE_WITHOUT_EA_HF = """
import json, sys
sys.modules["ea_hf"] = None  # ea_hf is not importable in this interpreter
from sentence_transformers import SentenceTransformer
results = {}
for folder in sys.argv[2:]:
    model = SentenceTransformer(folder, device="cpu", trust_remote_code=True)
    inner = model[0].auto_model
    embeddings = model.encode(json.loads(sys.argv[1]), convert_to_tensor=True, batch_size=32)
    results[folder] = {"class": type(inner).__module__ + "." + type(inner).__name__, "embeddings": embeddings.tolist()}
print(json.dumps(results))
"""


def encode_without_ea_hf(tmp_path, *folders) -> dict[str, dict]:
    """Each folder loaded by ``SentenceTransformer(folder, trust_remote_code=True)`` in an interpreter without
    ea_hf: its transformers model's class and the embeddings of SENTENCES."""
    return run_without_ea_hf(ENCODE_WITHOUT_EA_HF, json.dumps(SENTENCES), *map(str, folders), folder=tmp_path)


def test_patching_with_alpha_and_beta_zero_leaves_the_embeddings_as_they_were(minilm_path):
    model = minilm_sentence_transformer(minilm_path)
    before = encode(model)
    assert patch_sentence_transformer(model, alpha=0.0, beta=0.0) is model
    assert [type(inner).__name__ for inner in transformers_models(model)] == ["EABertModel"]
    assert len(ea_hf.summary(model[0].auto_model).modules) == 6
    assert (encode(model) - before).abs().max() <= 1e-6  # measured: 1.5e-7
    with pytest.raises(ValueError, match="holds no transformers model"):
        patch_sentence_transformer(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_padding_changes_no_embedding(minilm_path):
    model = patch_sentence_transformer(minilm_sentence_transformer(minilm_path), alpha=0.4, beta=0.4)
    unpatched = encode(minilm_sentence_transformer(minilm_path))
    batched = encode(model, SENTENCES + LONGER)
    assert (batched[: len(SENTENCES)] - unpatched).abs().max() > 1e-2  # the evolution does change them
    for i, sentence in enumerate(SENTENCES):
        assert (encode(model, [sentence])[0] - batched[i]).abs().max() <= 1e-5  # measured: 1.6e-7


@pytest.mark.full_table  # CI's second stage: fast: `ea-hf patch` to a folder
def test_trains_with_a_sentence_transformers_loss_and_loads_with_and_without_ea_hf(minilm_path, tmp_path):
    pytest.importorskip("datasets", reason="training needs the train extra (datasets, accelerate)")
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    try:
        from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    except ImportError:  # before sentence-transformers 6
        from sentence_transformers.losses import MultipleNegativesRankingLoss

    model = patch_sentence_transformer(minilm_sentence_transformer(minilm_path), alpha=0.2, beta=0.2)
    model.max_seq_length = 32  # (seconds on two CPU cores)
    # (section title, its first paragraph) of the Python documentation: 64 real pairs, 4 batches of 16.
    titles, descriptions = zip(*python_docs_pairs()[:64], strict=True)
    pairs = Dataset.from_dict({"anchor": list(titles), "positive": list(descriptions)})
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path / "trainer"),
        num_train_epochs=1,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=16,
        learning_rate=1e-4,
        batch_sampler="no_duplicates",  # in-batch negatives: no text twice in a batch
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
    )
    loss = MultipleNegativesRankingLoss(model)
    trainer = SentenceTransformerTrainer(
        model=model, args=args, train_dataset=pairs, eval_dataset=pairs.select(range(16)), loss=loss
    )
    before, weights = trainer.evaluate()["eval_loss"], evolution_weights(model)
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 4 and all(math.isfinite(value) for value in losses)
    assert after < before  # measured: 0.30 -> 0.17 (training losses 0.90, 0.40, 0.27, 0.13)
    trained = evolution_weights(model)
    assert len(weights) == len(trained) == 6 and not any(map(torch.equal, weights, trained))

    folder = tmp_path / "ea-minilm"
    model.save(str(folder))
    expected = encode(model)
    loaded = minilm_sentence_transformer(folder)
    assert type(loaded[0].auto_model).__name__ == "EABertModel" and [type(m).__name__ for m in loaded] == [
        "Transformer",
        "Pooling",
        "Normalize",
    ]
    assert (encode(loaded) - expected).abs().max() <= 1e-6  # measured: 0 (the same weights, the same kernel)

    result = encode_without_ea_hf(tmp_path, folder)[str(folder)]
    assert result["class"].startswith("transformers_modules.") and result["class"].endswith(".EABertModel")
    # Float rounding only: the copy without ea_hf evolves with torch operations, not the CPU kernel.
    assert (torch.tensor(result["embeddings"]) - expected).abs().max() <= 1e-5  # measured: 1.4e-7


def test_cli_patch_writes_a_sentence_transformers_folder(minilm_path, tmp_path, capsys):
    out = tmp_path / "st"
    arguments = ["--alpha", "0.3", "--beta", "0.1", "--layers", "1,3", "--seed", "5", "--sentence-transformers"]
    assert main(["patch", minilm_path, str(out), *arguments]) == 0
    printed = capsys.readouterr().out
    assert "2 evolving attention modules, 2,616 added parameters" in printed
    assert "saved a SentenceTransformer (Transformer, Pooling, Normalize)" in printed
    assert (out / "modules.json").exists() and (out / "model_classes.py").exists()
    loaded = minilm_sentence_transformer(out)
    assert [m.layer for m in ea_hf.summary(loaded[0].auto_model).modules] == [1, 3]
    torch.manual_seed(5)  # the command's seed: the same new weights
    reference = patch_sentence_transformer(minilm_sentence_transformer(minilm_path), alpha=0.3, beta=0.1, layers=[1, 3])
    expected = encode(reference)
    assert torch.equal(encode(loaded), expected)

    # A plain transformers checkpoint: sentence-transformers wraps it with mean pooling.
    plain = tmp_path / "plain"
    transformers.AutoModel.from_pretrained(minilm_path).save_pretrained(plain)
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_path)
    tokenizer.save_pretrained(plain)
    wrapped = tmp_path / "wrapped"
    assert main(["patch", str(plain), str(wrapped), "--alpha", "0.3", "--sentence-transformers"]) == 0
    assert "saved a SentenceTransformer (Transformer, Pooling)" in capsys.readouterr().out
    mean_pooled = minilm_sentence_transformer(wrapped)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():  # the folder is an EA transformers checkpoint too
        hidden = transformers.AutoModel.from_pretrained(wrapped).eval()(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1)
    assert (encode(mean_pooled) - (hidden * mask).sum(1) / mask.sum(1)).abs().max() <= 1e-5

    results = encode_without_ea_hf(tmp_path, out, wrapped)
    assert (torch.tensor(results[str(out)]["embeddings"]) - expected).abs().max() <= 1e-5
    assert (torch.tensor(results[str(wrapped)]["embeddings"]) - encode(mean_pooled)).abs().max() <= 1e-5


def test_cli_patch_sentence_transformers_errors_are_clear(minilm_path, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert main(["patch", minilm_path, str(out), "--sentence-transformers", "--auto-class", "AutoModel"]) == 2
    assert "--auto-class does not apply with --sentence-transformers" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)  # as if the extra were not installed
    assert main(["patch", minilm_path, str(out), "--sentence-transformers"]) == 2
    assert 'pip install "ea_hf[sentence-transformers]"' in capsys.readouterr().err
    assert not out.exists()

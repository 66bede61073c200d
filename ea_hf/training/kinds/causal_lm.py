"""Task kind ``causal_lm``: fine-tuning a decoder-only language model on text, scored by perplexity.

Text comes from local files (``.txt``: one row per line; ``.jsonl``/``.json``: the ``text_column``), from a Hub
dataset, or from ``python-docs``: the topic texts of the Python documentation that every Python installation
ships (``pydoc_data``, about 465,000 characters of real English prose and examples, PSF licence), an offline
corpus for quickstarts and tests. Documents are tokenised, joined with the end-of-sequence token and cut into
blocks of ``block_size`` tokens, as transformers' ``run_clm`` example does.

Example:
    >>> documents = python_docs()
    >>> len(documents["train"]) > 60 and len(documents["validation"]) > 5
    True
    >>> import numpy as np
    >>> token_losses = np.array([[2.0, 2.0], [6.0, 2.0]])  # per block: summed loss, tokens
    >>> perplexity_fn()((token_losses, None))["perplexity"] == float(np.exp(2.0))
    True
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
import transformers

from ..data_files import check_text_file, load_checked_file
from ..models import adapt_model, resolve_model_path
from ..recipe import DataSection, Recipe
from ..task_kind import CardInfo, Preprocessed, TaskKind

#: Every n-th document of a corpus without a validation split is held out for validation.
HOLD_OUT_EVERY = 10
_TEXT_FILES = {".txt": "text", ".json": "json", ".jsonl": "json"}
PYTHON_DOCS = "python-docs"


def python_docs() -> dict[str, list[str]]:
    """The Python documentation's topic texts (``pydoc_data.topics``) as train and validation documents
    (every tenth held out), in a fixed order. Topics that share a text (aliases) count once, so none is on
    both sides."""
    from pydoc_data.topics import topics

    documents = list(dict.fromkeys(topics[name].strip() for name in sorted(topics)))
    validation = [doc for i, doc in enumerate(documents) if i % HOLD_OUT_EVERY == 0]
    train = [doc for i, doc in enumerate(documents) if i % HOLD_OUT_EVERY != 0]
    return {"train": train, "validation": validation}


def load_text_data(data: CausalLMData):
    """A ``datasets.DatasetDict`` with a ``text`` column, and a validation split carved from the training
    documents when the source has none."""
    import datasets

    if data.source == PYTHON_DOCS:
        splits = {split: datasets.Dataset.from_dict({"text": docs}) for split, docs in python_docs().items()}
        return datasets.DatasetDict(splits)
    if data.source == "hub":
        loaded = datasets.DatasetDict(datasets.load_dataset(data.hub_id, data.hub_config))
    else:
        loaded = {}
        for split, path in data.files.items():
            path = Path(path)
            if not path.is_file():
                raise FileNotFoundError(f"data file for split {split!r} not found: {path}")
            builder = _TEXT_FILES[path.suffix.lower()]
            check_text_file(path, data.text_column)
            loaded[split] = load_checked_file(builder, path, split)
        loaded = datasets.DatasetDict(loaded)
    for split, dataset in loaded.items():
        if data.text_column not in dataset.column_names:
            raise ValueError(
                f"the {split} split has no text column {data.text_column!r} (columns: {dataset.column_names}); "
                "set data.text_column"
            )
        dataset = dataset.select_columns([data.text_column])
        loaded[split] = dataset if data.text_column == "text" else dataset.rename_column(data.text_column, "text")
    if "validation" not in loaded and "train" in loaded:
        indices = range(len(loaded["train"]))
        loaded["validation"] = loaded["train"].select([i for i in indices if i % HOLD_OUT_EVERY == 0])
        loaded["train"] = loaded["train"].select([i for i in indices if i % HOLD_OUT_EVERY != 0])
    return loaded


def token_blocks(dataset, tokenizer, block_size: int):
    """Tokenise every document, join them with the end-of-sequence token and cut the stream into blocks of
    ``block_size`` tokens (the remainder is dropped); labels are the inputs (the model shifts them)."""
    separator = [token for token in [special_token(tokenizer, "eos", "sep")] if token is not None]

    def blocks(batch: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        stream = [token for document in ids for token in (*document, *separator)]
        cut = len(stream) - len(stream) % block_size
        chunks = [stream[i : i + block_size] for i in range(0, cut, block_size)]
        return {"input_ids": chunks, "attention_mask": [[1] * block_size for _ in chunks], "labels": chunks}

    return dataset.map(
        blocks, batched=True, batch_size=1000, remove_columns=dataset.column_names, desc="Tokenizing into blocks"
    )


def special_token(tokenizer, *names: str) -> int | None:
    """The id of the first of the named special tokens (``eos``, ``sep``...) that the tokenizer has (BERT-style
    tokenizers have SEP and CLS where others have EOS and BOS); None if it has none."""
    ids = (getattr(tokenizer, f"{name}_token_id") for name in names)
    return next((token for token in ids if token is not None), None)


def token_losses(logits: torch.Tensor | tuple, labels: torch.Tensor) -> torch.Tensor:
    """Per block: the summed next-token loss and the number of predicted tokens, [B, 2]. Passed to Trainer as
    ``preprocess_logits_for_metrics`` so that evaluation keeps two numbers per block, not the logits."""
    if isinstance(logits, tuple):
        logits = logits[0]
    shifted = labels[:, 1:]
    losses = F.cross_entropy(logits[:, :-1].transpose(1, 2).float(), shifted, ignore_index=-100, reduction="none")
    return torch.stack([losses.sum(-1), (shifted != -100).sum(-1).to(losses.dtype)], dim=-1)


def block_losses(eval_prediction) -> np.ndarray:
    """Per block, its mean next-token loss: what two models are compared on block by block (lower is better).

    Example:
        >>> block_losses(([[6.0, 3.0], [2.0, 4.0]], None)).tolist()
        [2.0, 0.5]
    """
    totals = np.asarray(eval_prediction[0], dtype=float).reshape(-1, 2)
    return totals[:, 0] / np.maximum(totals[:, 1], 1.0)


def perplexity_fn():
    """``compute_metrics``: perplexity over every predicted token of the split (exp of the token-mean loss)."""

    def compute(eval_prediction) -> dict[str, float]:
        totals = eval_prediction[0].reshape(-1, 2).sum(0)
        loss = float(totals[0] / max(totals[1], 1.0))
        return {"perplexity": math.exp(loss), "token_loss": loss}

    return compute


@dataclasses.dataclass
class CausalLMData(DataSection):
    """Kind ``causal_lm``: ``source: local`` reads ``.txt`` (one row per line) or ``.json``/``.jsonl``
    (``text_column``) files; ``source: hub`` reads ``hub_id`` (config ``hub_config``); ``source: python-docs``
    is the Python documentation shipped with Python (offline). Without a validation split, every tenth
    document is held out. ``max_train_samples`` and ``max_eval_samples`` count documents (rows of the text,
    before it is cut into blocks). ``tokenizer``: for a model built from ``model.config`` (Hub id, directory or
    ``package:NAME``)."""

    source: Literal["hub", "local", "python-docs"] = "hub"
    hub_config: str | None = None
    text_column: str = "text"
    block_size: int = 128
    tokenizer: str | None = None


@dataclasses.dataclass
class CausalLMRecipe(Recipe):
    data: CausalLMData = dataclasses.field(default_factory=CausalLMData)


class CausalLMKind(TaskKind):
    """Causal language modelling on a decoder-only model (GPT-2, Llama, Mistral, Qwen, Gemma, Phi...), from a
    pretrained checkpoint (``model.name_or_path``) or a new model of ``model.config``."""

    name = "causal_lm"
    recipe_class = CausalLMRecipe
    auto_class = "AutoModelForCausalLM"
    preprocessor_class = "AutoTokenizer"
    peft_task_type = "CAUSAL_LM"
    per_example_score = "the block's mean token loss"
    per_example_lower_is_better = True

    def check(self, recipe: Recipe, problems: list[tuple[str, str]]) -> None:
        data = recipe.data
        if data.source == "hub" and not data.hub_id:
            problems.append(("data.hub_id", "is required with data.source: hub"))
        for split, path in data.files.items():
            if Path(path).suffix.lower() not in _TEXT_FILES:
                problems.append((f"data.files.{split}", f"unsupported file type {path!r} (txt, json, jsonl)"))
        if data.block_size <= 1:
            problems.append(("data.block_size", "must be at least 2 (a token and the next one)"))
        if not recipe.model.name_or_path:
            if recipe.model.config is None:
                problems.append(("model", "give a checkpoint (name_or_path) or the config of a new model (config)"))
            elif not data.tokenizer:
                problems.append(("data.tokenizer", "is required for a model built from model.config"))
            if recipe.peft.method is not None:
                problems.append(("peft.method", "adapts a pretrained checkpoint; give model.name_or_path"))

    def needs_checkpoint(self, recipe: Recipe) -> bool:
        return recipe.model.config is None

    def task_label(self, recipe: Recipe) -> str:
        return "causal_lm"

    def metric_names(self, recipe: Recipe) -> tuple[str, ...]:
        return ("perplexity", "token_loss")

    def example_losses(self, recipe: Recipe, config: transformers.PreTrainedConfig):
        return token_losses  # the loss over every predicted token of the split, as perplexity's

    def model_config(self, recipe: Recipe, label_names: tuple[str, ...] | None) -> dict[str, Any]:
        return {}  # a language-model head has no labels

    def card_info(self, recipe: Recipe) -> CardInfo:
        data = recipe.data
        if data.source == "hub":
            name, kind, hub = data.hub_id, data.hub_id, (data.hub_id,)
            text = f"{name} ({data.hub_config})" if data.hub_config else name
        elif data.source == PYTHON_DOCS:
            name, kind, hub = "Python documentation topics (pydoc_data)", PYTHON_DOCS, ()
            text = "the topic texts of the Python documentation (pydoc_data)"
        else:
            name, kind, hub = "local text files", "local", ()
            text = f"text in local files: {data.file_names()}"
        return CardInfo(
            pipeline_tag="text-generation",
            task_type="text-generation",
            task_text="causal language modelling",
            dataset_name=name,
            dataset_type=kind,
            dataset_config=data.hub_config if data.source == "hub" else None,
            hub_datasets=hub,
            data_text=text,
        )

    def load_data(self, recipe: Recipe):
        return load_text_data(recipe.data), None

    def load_model(self, recipe: Recipe, label_names: tuple[str, ...] | None, data: dict[str, Any]):
        if recipe.model.name_or_path:
            return None  # the checkpoint, through AutoModelForCausalLM
        tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model_path(recipe.data.tokenizer))
        settings = dict(recipe.model.config)
        model_type = settings.pop("model_type", "llama")
        special = {"bos_token_id": special_token(tokenizer, "bos", "cls")}
        special |= {"eos_token_id": special_token(tokenizer, "eos", "sep")}
        special |= {"pad_token_id": tokenizer.pad_token_id, "vocab_size": len(tokenizer)}
        config = transformers.AutoConfig.for_model(model_type, **special | settings)
        model = transformers.AutoModelForCausalLM.from_config(config)
        return adapt_model(recipe, model), tokenizer

    def preprocess(self, recipe, data, label_names, model, processor) -> Preprocessed:
        size = recipe.data.block_size
        splits = {split: token_blocks(dataset, processor, size) for split, dataset in data.items()}
        empty = [split for split, dataset in splits.items() if len(dataset) == 0]
        if empty:
            raise ValueError(f"split(s) {empty} hold fewer than data.block_size={size} tokens; lower it or add text")
        return Preprocessed(
            splits,
            transformers.default_data_collator,
            perplexity_fn(),
            preprocess_logits=token_losses,
            per_example_scores=block_losses,
        )

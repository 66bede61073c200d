"""TRL's ``SFTTrainer`` on an evolving attention decoder (a tiny Llama with a real tokenizer, fp32 on CPU): full
fine-tuning and LoRA, with TRL's packing and with padding-free batches. A packed or padding-free batch computes,
for every document, what the document computes alone (TRL flattens a batch into one row whose position ids restart
at each document, with flash attention's boundaries from TRL 1.16 on; the evolving layers unpack it by either);
training lowers the loss and moves the evolution convolutions; the saved model (full) or adapter (LoRA) loads back
with ea_hf, and without it through ``trust_remote_code``, and generates the same tokens. Passes on TRL 1.7 to 1.16
(the pyproject's lower bound)."""

import dataclasses
import json
import math
import textwrap

import pytest
import torch
import transformers
from testing import max_abs_diff, run_without_ea_hf, tiny_config

import ea_hf
from ea_hf.modeling.evolution import AttentionMapEvolution
from ea_hf.training.kinds.causal_lm import python_docs

trl = pytest.importorskip("trl", reason="TRL is the optional trl extra")
datasets = pytest.importorskip("datasets", reason="datasets comes with TRL")

SETTINGS = {"alpha": 0.4, "beta": 0.4}
#: TRL's two ways to a flattened batch: packing (best-fit decreasing into rows of max_length tokens, padding-free
#: on by itself) and padding-free batches of whole documents (TRL then wants max_length=None).
BATCHING = {
    "packing": {"packing": True, "max_length": 64},
    "padding_free": {"padding_free": True, "max_length": None},
}
TUNING = ["full", "lora"]
RUNS = [(tuning, batching) for tuning in TUNING for batching in BATCHING]
PROMPTS = ["The assert statement", "Assignment statements are used to"]
#: BERT's tokenizer returns token type ids, which a Llama does not take.
TOKENIZER_OPTIONS = {"return_tensors": "pt", "return_token_type_ids": False}


def documents(n: int = 32) -> list[str]:
    """Real text: the Python documentation's topics (offline), cut to 80 to 200 characters so that a packed row of
    64 tokens holds several documents of different lengths."""
    return [" ".join(text.split())[: 80 + 40 * (i % 4)] for i, text in enumerate(python_docs()["train"][:n])]


def sft_config(output_dir, batching: str, **overrides) -> "trl.SFTConfig":
    """fp32 (SFTConfig turns bf16 on by default) and TRL's default gradient checkpointing; BERT's tokenizer has
    no EOS token, so documents end with its SEP; seeded, so that the runs and their batches repeat."""
    settings = dict(
        per_device_train_batch_size=4,
        max_steps=4,
        learning_rate=3e-3,
        bf16=False,
        use_cpu=True,
        eos_token="[SEP]",
        save_strategy="no",
        logging_steps=1,
        report_to="none",
        seed=0,
        data_seed=0,
    )
    return trl.SFTConfig(str(output_dir), **settings | BATCHING[batching] | overrides)


def sft_trainer(model, tokenizer, batching: str, output_dir, peft_config=None) -> "trl.SFTTrainer":
    """An SFTTrainer on :func:`documents` (a model object, or a checkpoint's folder that TRL loads)."""
    train = datasets.Dataset.from_dict({"text": documents()})
    args = sft_config(output_dir, batching)
    return trl.SFTTrainer(model, args=args, train_dataset=train, processing_class=tokenizer, peft_config=peft_config)


@pytest.fixture(scope="module")
def tokenizer(minilm_path):
    """A WordPiece tokenizer of its own for this file (SFTTrainer sets its padding token)."""
    return transformers.AutoTokenizer.from_pretrained(minilm_path)


@pytest.fixture(scope="module")
def base(tmp_path_factory, tokenizer) -> str:
    """An EA checkpoint of a tiny Llama (3 layers, 4 query and 2 key/value heads) over the tokenizer's vocabulary."""
    config = tiny_config(
        "llama",
        vocab_size=len(tokenizer),
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id,
    )
    torch.manual_seed(0)
    model = ea_hf.patch(transformers.AutoModelForCausalLM.from_config(config), **SETTINGS)
    path = tmp_path_factory.mktemp("base")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def load(path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def evolution_weights(model) -> dict[str, torch.Tensor]:
    """The trainable evolution weights (under LoRA, peft's trained copies of the modules)."""
    return {
        f"{name}.{parameter_name}": parameter.detach().clone()
        for name, module in model.named_modules()
        if isinstance(module, AttentionMapEvolution)
        for parameter_name, parameter in module.named_parameters()
        if parameter.requires_grad
    }


def greedy(model, tokenizer) -> list[list[int]]:
    """8 new tokens of each prompt, greedily, the prompts left-padded into one batch."""
    prompts = tokenizer(PROMPTS, padding=True, padding_side="left", add_special_tokens=False, **TOKENIZER_OPTIONS)
    with torch.no_grad():
        tokens = model.generate(**prompts, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokens.tolist()


def first_batch(trainer) -> dict:
    return next(iter(trainer.get_train_dataloader()))


def trainer_loss(trainer, batch) -> float:
    """The loss TRL trains on (its fused LM head), on one batch."""
    with torch.no_grad():
        return trainer.compute_loss(trainer.model, dict(batch)).item()


@dataclasses.dataclass
class Run:
    logged_losses: list[float]
    loss_before: float
    loss_after: float
    evolution_before: dict[str, torch.Tensor]
    evolution_after: dict[str, torch.Tensor]
    trainable: list[str]
    saved: str  # the trainer's save_model folder: the model, or the adapter under LoRA
    checkpoint: str  # an EA checkpoint: the saved model, or the merged one under LoRA
    generated: list[list[int]]


@pytest.fixture(scope="module")
def runs(base, tokenizer, tmp_path_factory) -> dict[tuple[str, str], Run]:
    """Four short SFT runs: full fine-tuning (the trainer loads the EA checkpoint from its path) and LoRA (ea_hf's
    lora_config: LoRA on the attention projections, the evolution convolutions trained in full), each with
    packing and padding-free batches."""
    peft = pytest.importorskip("peft", reason="LoRA is the optional peft extra")
    from ea_hf.adapters import lora_config

    results = {}
    for tuning, batching in RUNS:
        folder = tmp_path_factory.mktemp(f"{tuning}-{batching}")
        if tuning == "full":
            model, peft_config = base, None  # TRL loads it through AutoModelForCausalLM (ea_hf is imported)
        else:
            model = load(base)
            peft_config = lora_config(model, r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM")
        trainer = sft_trainer(model, tokenizer, batching, folder / "out", peft_config)
        assert isinstance(trainer.model, peft.PeftModel) == (tuning == "lora")
        batch = first_batch(trainer)
        loss_before, evolution_before = trainer_loss(trainer, batch), evolution_weights(trainer.model)
        trainer.train()
        trainer.model.eval()
        loss_after, evolution_after = trainer_loss(trainer, batch), evolution_weights(trainer.model)
        trainable = [name for name, parameter in trainer.model.named_parameters() if parameter.requires_grad]
        logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        saved = str(folder / "saved")
        trainer.save_model(saved)
        generated = greedy(trainer.model, tokenizer)
        checkpoint = saved
        if tuning == "lora":  # (merging changes the model in place)
            checkpoint = str(folder / "merged")
            trainer.model.merge_and_unload().save_pretrained(checkpoint)
            tokenizer.save_pretrained(checkpoint)
        results[tuning, batching] = Run(
            logged, loss_before, loss_after, evolution_before, evolution_after, trainable, saved, checkpoint, generated
        )
    return results


# --------------------------------------------------------------------------------------------------
# TRL's batches: each packed document computes what it computes alone
# --------------------------------------------------------------------------------------------------


def bounds(batch) -> list[int]:
    """Where the documents of a flattened one-row batch start, and its end: its position ids restart at each."""
    starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist()
    return [*starts, batch["input_ids"].shape[1]]


def split(batch) -> list[torch.Tensor]:
    """The documents of a flattened one-row batch."""
    edges = bounds(batch)
    return [batch["input_ids"][0, a:b] for a, b in zip(edges, edges[1:], strict=False)]


@pytest.mark.parametrize("batching", BATCHING)
def test_trl_keeps_the_evolving_attention_and_flattens_its_batches(base, tokenizer, batching, tmp_path):
    """SFTTrainer keeps the model's attention implementation, and its collator flattens each batch into one row
    without an attention mask, with position ids that restart at each document (TRL 1.16 on adds flash attention's
    boundaries, cu_seq_lens_q/k, whatever the attention implementation): the evolving layers unpack the row by
    either (ea_hf.modeling.packing)."""
    trainer = sft_trainer(base, tokenizer, batching, tmp_path)
    assert type(trainer.model).__name__ == "EALlamaForCausalLM"
    assert trainer.model.config._attn_implementation == "evolving_attention"
    batch = first_batch(trainer)
    assert "attention_mask" not in batch and batch["input_ids"].shape[0] == 1
    assert len(bounds(batch)) > 4  # several documents in the row
    if "cu_seq_lens_q" in batch:
        assert batch["cu_seq_lens_q"].tolist() == batch["cu_seq_lens_k"].tolist() == bounds(batch)


@pytest.mark.parametrize("batching", BATCHING)
def test_a_flattened_batch_is_each_document_alone(base, tokenizer, batching, tmp_path):
    """Logits, TRL's loss and its gradients on a batch as TRL's collator builds it equal those of the documents
    run one by one (the loss: their summed next-token losses over their targets; the first token of a document has
    no target, as TRL's labels have it). The negative control: the same row run as one sequence differs."""
    trainer = sft_trainer(base, tokenizer, batching, tmp_path)
    model, batch = trainer.model.eval(), first_batch(trainer)
    docs = split(batch)
    inputs = {name: value for name, value in batch.items() if name != "labels"}
    with torch.no_grad():
        packed = model(**inputs, use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=doc[None], use_cache=False).logits[0] for doc in docs])
        one_sequence = model(input_ids=batch["input_ids"], use_cache=False).logits[0]
    assert max_abs_diff(packed, alone) <= 1e-5
    assert max_abs_diff(one_sequence, alone) > 1e-2

    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, dict(batch))
    loss.backward()
    packed_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    targets = sum(len(doc) - 1 for doc in docs)
    summed = sum(model(input_ids=doc[None], labels=doc[None], use_cache=False).loss * (len(doc) - 1) for doc in docs)
    expected = summed / targets
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-5
    evolution = [name for name in packed_grads if ".evolving_attention." in name]
    assert len(evolution) == 2 * model.config.num_hidden_layers  # weight and bias of every layer
    for name, parameter in model.named_parameters():
        assert max_abs_diff(packed_grads[name], parameter.grad) <= 1e-5, name
    model.zero_grad(set_to_none=True)


# --------------------------------------------------------------------------------------------------
# Training, saving, loading back
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("tuning", "batching"), RUNS)
def test_sft_training_lowers_the_loss_and_trains_the_evolution(runs, tuning, batching):
    run = runs[tuning, batching]
    assert len(run.logged_losses) == 4 and all(math.isfinite(loss) for loss in run.logged_losses)
    assert run.loss_after < run.loss_before - 0.05
    after = run.evolution_after
    assert after.keys() == run.evolution_before.keys() and len(after) == 2 * 3  # weight and bias, 3 layers
    for name, before in run.evolution_before.items():
        assert max_abs_diff(after[name], before) > 1e-4, name
    if tuning == "lora":  # only LoRA's matrices and the evolution convolutions train
        assert all(".lora_" in name or ".evolving_attention." in name for name in run.trainable)
        assert sum(".lora_" in name for name in run.trainable) == 2 * 4 * 3  # A and B of q, k, v, o in 3 layers


@pytest.mark.slow
@pytest.mark.parametrize(("tuning", "batching"), RUNS)
def test_the_saved_model_loads_back_with_ea_hf_and_generates_the_same_tokens(runs, base, tokenizer, tuning, batching):
    """Full fine-tuning: the saved checkpoint through AutoModelForCausalLM. LoRA: the adapter onto the base
    (ea_hf.adapters.load_adapter, and peft's AutoPeftModelForCausalLM, which finds the base by its path), and the
    merged checkpoint."""
    run = runs[tuning, batching]
    loaded = [load(run.checkpoint)]
    if tuning == "lora":
        import peft

        from ea_hf.adapters import load_adapter

        loaded.append(load_adapter(load(base), run.saved).eval())
        loaded.append(peft.AutoPeftModelForCausalLM.from_pretrained(run.saved).eval())
    for model in loaded:
        assert ea_hf.is_patched(model)
        assert greedy(model, tokenizer) == run.generated


REMOTE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.modules["ea_hf"] = None  # ea_hf is not importable in this interpreter
    import torch, transformers
    results = {}
    for path in json.loads(sys.argv[1]):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=True)  # (the config maps EA)
        prompts = tokenizer(json.loads(sys.argv[2]), padding=True, padding_side="left", add_special_tokens=False,
                            return_tensors="pt", return_token_type_ids=False)
        with torch.no_grad():
            tokens = model.generate(**prompts, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        results[path] = {"class": type(model).__module__ + "." + type(model).__name__, "tokens": tokens.tolist()}
    print(json.dumps(results))
    """
)


@pytest.mark.slow
@pytest.mark.full_table  # CI's second stage: the fast run loads checkpoints without ea_hf in test_model_classes
def test_the_saved_models_load_without_ea_hf_and_generate_the_same_tokens(runs, tmp_path):
    """Every run's EA checkpoint (the merged one under LoRA) in a Python where ea_hf cannot be imported."""
    paths = [run.checkpoint for run in runs.values()]
    results = run_without_ea_hf(REMOTE_SCRIPT, json.dumps(paths), json.dumps(PROMPTS), folder=tmp_path)
    for run in runs.values():
        result = results[run.checkpoint]
        assert result["class"].startswith("transformers_modules.")
        assert result["class"].endswith(".model_classes.EALlamaForCausalLM")
        assert result["tokens"] == run.generated

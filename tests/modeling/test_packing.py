"""Packed sequences (padding-free batches): several documents in one row, their position ids restarting, or with
flash attention's boundaries (``cu_seq_lens_q`` / ``cu_seq_lens_k``); transformers' ``DataCollatorWithFlattening``
makes both, as TRL's padding-free collator does. Neither the convolution nor the map passed between layers may
carry anything across a document's boundary: each document computes what it computes alone, and changing one
leaves the others as they were. Every decoder-only family, and the text encoders where flash-style boundaries
reach them (transformers masks no encoder by its position ids)."""

import functools

import pytest
import torch
import transformers
from testing import (
    CAUSAL_LM_FAMILIES,
    TEXT_ARCHITECTURES,
    VOCAB_SIZE,
    causal_lm,
    checkpointing_changes_no_gradient,
    max_abs_diff,
    routing_noise,
    table,
    tiny_model,
)

import ea_hf
from ea_hf.modeling import attention as attention_module

FAMILIES = list(CAUSAL_LM_FAMILIES)
EVOLVED = {"alpha": 0.4, "beta": 0.5}
LENGTHS = (5, 3, 6)
#: Families whose masks transformers makes without the position ids: given restarting positions and no attention
#: mask they attend across documents, unpatched (eager, sdpa) as patched. Flash-style boundaries keep them apart.
ACROSS_DOCUMENTS = ["biogpt", "opt", "gpt_oss", "bert-decoder", "roberta-decoder", "bart-causal", "mbart-causal"]
#: Hybrids whose linear-attention layers (gated delta nets) read across documents: transformers refuses
#: flash-style boundaries without flash-linear-attention, and position ids do not reach those layers.
LINEAR_ATTENTION = ["qwen3_5_text", "qwen3_5_moe_text"]
#: The families that transformers packs by position ids: it masks their documents apart.
MASKED_APART = [family for family in FAMILIES if family not in ACROSS_DOCUMENTS + LINEAR_ATTENTION]
#: Families whose positions do not follow the position ids alone (RoBERTa numbers them after its padding index,
#: the BART family from the first column): a packed document is not at the positions it has alone.
OWN_POSITIONS = ["roberta-decoder", "bart-causal", "mbart-causal"]
#: Text encoders whose positions do not follow the position ids (RoBERTa's numbering).
ENCODERS_OWN_POSITIONS = ["roberta", "xlm-roberta", "camembert", "roberta-prelayernorm", "xlm-roberta-xl"]
ENCODERS_OWN_POSITIONS += ["data2vec-text"]
ENCODERS = TEXT_ARCHITECTURES

COLLATORS = {
    "position-ids": transformers.DataCollatorWithFlattening(return_tensors="pt"),
    "flash-kwargs": transformers.DataCollatorWithFlattening(return_tensors="pt", return_flash_attn_kwargs=True),
}


@functools.cache
def evolved(family: str):
    """One evolved model per family for the whole file (building them is most of its time)."""
    return ea_hf.patch(causal_lm(family), **EVOLVED)


def documents(seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(5, VOCAB_SIZE, (n,), generator=generator).tolist() for n in LENGTHS]


def with_first_changed(docs: list[list[int]]) -> list[list[int]]:
    return [[(token + 7) % (VOCAB_SIZE - 5) + 5 for token in docs[0]], *docs[1:]]


def packed(docs: list[list[int]]) -> dict[str, torch.Tensor]:
    """The documents in one row, their positions restarting at 0, no attention mask."""
    positions = [position for doc in docs for position in range(len(doc))]
    return {"input_ids": torch.tensor([sum(docs, [])]), "position_ids": torch.tensor([positions])}


def collated(collator: str, docs: list[list[int]]) -> dict[str, torch.Tensor]:
    return COLLATORS[collator]([{"input_ids": doc} for doc in docs])


def logits(model, inputs: dict) -> torch.Tensor:
    """[N, V] logits of a one-row call. transformers masks packed documents apart only in a call without a KV
    cache (``use_cache=False``, as padding-free training passes it)."""
    inputs = {name: value for name, value in inputs.items() if name != "labels"}
    with torch.no_grad():
        return model(**inputs, use_cache=False).logits[0]


def alone(model, docs: list[list[int]]) -> torch.Tensor:
    """Each document's logits computed on its own, concatenated as the documents are packed."""
    return torch.cat([logits(model, {"input_ids": torch.tensor([doc])}) for doc in docs])


def first_document_changes_nothing_else(model, inputs, changed_inputs, noise: float) -> None:
    before, after = logits(model, inputs), logits(model, changed_inputs)
    first = LENGTHS[0]
    assert max_abs_diff(after[:first], before[:first]) > 1e-3  # the change does change the first document
    assert max_abs_diff(after[first:], before[first:]) <= noise


# --------------------------------------------------------------------------------------------------
# Documents packed by their position ids
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", table(MASKED_APART))
def test_packed_documents_compute_what_they_compute_alone(family):
    model, docs = evolved(family), documents()
    assert max_abs_diff(logits(model, packed(docs)), alone(model, docs)) <= 1e-5


@pytest.mark.parametrize("family", table(MASKED_APART))
def test_changing_one_packed_document_leaves_the_others_as_they_were(family):
    model, docs = evolved(family), documents()
    first_document_changes_nothing_else(model, packed(docs), packed(with_first_changed(docs)), routing_noise(family))


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "gpt2", "mixtral"])
def test_without_unpacking_the_convolution_reads_across_documents(family, monkeypatch):
    """The converse: attention over the packed row as it comes (the block-diagonal mask alone) moves the later
    documents when the first one changes, and away from what they compute alone (6e-4 to 8e-3 here)."""
    monkeypatch.setattr(attention_module, "find_packing", lambda *arguments: None)
    model, docs = evolved(family), documents()
    changed = logits(model, packed(with_first_changed(docs)))
    together = logits(model, packed(docs))
    first = LENGTHS[0]
    assert max_abs_diff(changed[first:], together[first:]) > 1e-4
    assert max_abs_diff(together, alone(model, docs)) > 1e-4


@pytest.mark.parametrize("family", table(ACROSS_DOCUMENTS + LINEAR_ATTENTION))
def test_families_that_transformers_does_not_pack_attend_across_documents_patched_too(family):
    """Where transformers does not mask packed documents apart (or a linear-attention layer reads across them),
    the unpatched model attends across documents, and so does the patched one: alpha = beta = 0 computes what
    the model computes on the packed row (evolving attention does not unpack against the model's own mask)."""
    model, docs = causal_lm(family), documents()
    reference = logits(model, packed(docs))
    assert max_abs_diff(reference, alone(model, docs)) > 1e-2  # the model does read across documents
    ea_hf.patch(model, alpha=0.0, beta=0.0)
    assert max_abs_diff(logits(model, packed(docs)), reference) <= 1e-5


# --------------------------------------------------------------------------------------------------
# Through transformers' collator: position ids, and flash attention's boundaries
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("collator", "family"),
    table([("position-ids", family) for family in MASKED_APART] + [("flash-kwargs", family) for family in FAMILIES], 1),
)
def test_collated_documents_are_kept_apart(collator, family):
    """``DataCollatorWithFlattening``'s batches: with position ids alone, the families transformers masks apart
    (the others attend across documents themselves, see the test above); with flash attention's boundaries
    (``return_flash_attn_kwargs=True``), every family whose layers all attend."""
    model, docs = evolved(family), documents()
    if family in LINEAR_ATTENTION:  # flash-style boundaries: transformers' gated delta net refuses them (5.24)
        try:
            logits(model, collated(collator, docs))
        except ValueError as error:
            assert "flash-linear-attention" in str(error)
            return
        pytest.skip(
            f"transformers {transformers.__version__}'s gated delta net takes flash-style boundaries where 5.24 "
            "refuses them; how its linear-attention layers read them is transformers' own, not EA's"
        )
    first_document_changes_nothing_else(
        model, collated(collator, docs), collated(collator, with_first_changed(docs)), routing_noise(family)
    )
    if family not in OWN_POSITIONS:
        assert max_abs_diff(logits(model, collated(collator, docs)), alone(model, docs)) <= 1e-5


@pytest.mark.parametrize("family", table(f for f in FAMILIES if f not in LINEAR_ATTENTION + OWN_POSITIONS))
def test_a_training_step_on_packed_documents_is_one_on_each_document(family):
    """The loss of a collated batch (``DataCollatorWithFlattening``'s labels: no target across a boundary) and its
    gradients are those of the documents alone, weighted by their targets. Position ids where transformers masks
    the documents apart, flash-style boundaries elsewhere."""
    model, docs = evolved(family), documents()
    batch = collated("position-ids" if family in MASKED_APART else "flash-kwargs", docs)
    model.zero_grad(set_to_none=True)
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    packed_grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    targets = sum(len(doc) - 1 for doc in docs)
    each = [model(input_ids=torch.tensor([doc]), labels=torch.tensor([doc]), use_cache=False).loss for doc in docs]
    expected = sum(doc_loss * (len(doc) - 1) / targets for doc_loss, doc in zip(each, docs, strict=True))
    expected.backward()
    alone_grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    assert abs(loss.item() - expected.item()) <= 1e-5
    assert packed_grads.keys() == alone_grads.keys()
    assert any(".evolving_attention." in name for name in packed_grads)
    for name, grad in packed_grads.items():
        assert max_abs_diff(grad, alone_grads[name]) <= 1e-5, name


def test_rows_packed_differently_in_one_batch():
    """Two rows: three documents in the first, one in the second; by position ids and by flash-style boundaries
    over the flattened batch (a document across two rows is refused)."""
    model, docs = evolved("llama"), documents()
    single = torch.randint(5, VOCAB_SIZE, (sum(LENGTHS),), generator=torch.Generator().manual_seed(3)).tolist()
    first, second = packed(docs), packed([single])
    inputs = {name: torch.cat([first[name], second[name]]) for name in first}
    bounds = torch.tensor([0, 5, 8, 14, 28], dtype=torch.int32)
    across = torch.tensor([0, 5, 16, 28], dtype=torch.int32)
    with torch.no_grad():
        by_positions = model(**inputs, use_cache=False).logits
        by_bounds = model(**inputs, use_cache=False, cu_seq_lens_q=bounds, cu_seq_lens_k=bounds).logits
        with pytest.raises(ValueError, match="spans rows 0 and 1"):
            model(**inputs, use_cache=False, cu_seq_lens_q=across, cu_seq_lens_k=across)
    for batch in (by_positions, by_bounds):
        assert max_abs_diff(batch[0], alone(model, docs)) <= 1e-5
        assert max_abs_diff(batch[1], alone(model, [single])) <= 1e-5


def test_gradient_checkpointing_replays_packed_layers():
    """Replayed layers find the call's packing again: the same gradients with checkpointing as without."""
    batch = collated("position-ids", documents())

    def make_model():
        model = ea_hf.patch(causal_lm("llama"), **EVOLVED)
        model.config.use_cache = False
        return model

    checkpointing_changes_no_gradient(make_model, **batch)


def test_packed_layers_return_no_attention_weights():
    """As sdpa and flash attention: each document's map has its own size, so none is returned."""
    inputs = packed(documents())
    with torch.no_grad():
        output = evolved("llama")(**inputs, use_cache=False, output_attentions=True)
    assert not output.attentions


# --------------------------------------------------------------------------------------------------
# KV caches
# --------------------------------------------------------------------------------------------------


def test_a_packed_prefill_into_an_empty_cache_is_kept_apart_and_not_decoded_on():
    """transformers' default config has use_cache on, so a training step makes an empty cache: flash-style
    boundaries still keep the documents apart. Decoding on from that cache, or a packed call after earlier
    tokens, is refused: the convolution keeps no rows for packed documents."""
    model, docs = evolved("llama"), documents()
    batch = {name: value for name, value in collated("flash-kwargs", docs).items() if name != "labels"}
    with torch.no_grad():
        output = model(**batch, use_cache=True)
        assert max_abs_diff(output.logits[0], alone(model, docs)) <= 1e-5
        with pytest.raises(RuntimeError, match="kept convolution rows for 0"):
            model(input_ids=torch.tensor([[7]]), past_key_values=output.past_key_values)
        prefix = model(input_ids=torch.tensor([docs[0]]), use_cache=True).past_key_values
        with pytest.raises(NotImplementedError, match="does not decode packed sequences"):
            model(**batch, past_key_values=prefix)


def test_position_ids_with_a_cache_are_not_packed():
    """transformers masks a call with a KV cache over the whole row (it looks for packed sequences only without
    one), so evolving attention does not unpack it: alpha = beta = 0 gives what the model gives."""
    model, inputs = causal_lm("llama"), packed(documents())
    with torch.no_grad():
        reference = model(**inputs, use_cache=True).logits
        ea_hf.patch(model, alpha=0.0, beta=0.0)
        assert max_abs_diff(model(**inputs, use_cache=True).logits, reference) <= 1e-5


# --------------------------------------------------------------------------------------------------
# Encoders
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", table(ENCODERS))
def test_encoders_keep_documents_apart_by_flash_style_boundaries(model_type):
    """transformers masks no encoder by its position ids (``create_bidirectional_mask`` takes none); flash
    attention's boundaries reach the encoders' attention, and keep the documents apart there too."""
    model, docs = ea_hf.patch(tiny_model(model_type), alpha=0.5, beta=0.5), documents()

    def hidden(docs):
        batch = {name: value for name, value in collated("flash-kwargs", docs).items() if name != "labels"}
        with torch.no_grad():
            return model(**batch)[0][0]

    together, changed = hidden(docs), hidden(with_first_changed(docs))
    first = LENGTHS[0]
    assert max_abs_diff(changed[:first], together[:first]) > 1e-3
    assert max_abs_diff(changed[first:], together[first:]) == 0.0
    if model_type not in ENCODERS_OWN_POSITIONS:
        with torch.no_grad():
            each = torch.cat([model(input_ids=torch.tensor([doc]))[0][0] for doc in docs])
        assert max_abs_diff(together, each) <= 1e-5

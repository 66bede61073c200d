"""PEFT/LoRA on evolving attention models: what trains, and the adapter round trip onto a freshly patched base."""

import pytest
import torch
import transformers
from testing import (
    ALL_ARCHITECTURES,
    AUDIO_ARCHITECTURES,
    IMAGE_ARCHITECTURES,
    SENTENCES,
    SEQ2SEQ_ARCHITECTURES,
    SHARED_LAYER_ARCHITECTURES,
    SPECTROGRAM_ARCHITECTURES,
    SPEECH_ARCHITECTURES,
    first_output,
    seq2seq_head,
    table,
    tiny_inputs,
    tiny_model,
)

import ea_hf
from ea_hf.integrations.peft import attention_projections, load_adapter, lora_config
from ea_hf.modeling.model_classes import auto_class_names

peft = pytest.importorskip("peft", reason="PEFT adapters are the optional peft extra")


def head_and_task(model_type):
    """A head with weights that start untrained (and peft's task type for it)."""
    if model_type in IMAGE_ARCHITECTURES:
        if "AutoModelForImageClassification" in auto_class_names(model_type):
            return transformers.AutoModelForImageClassification, None
        return transformers.AutoModel, None  # a backbone (DINOv3, CLIP's vision tower)
    if model_type in AUDIO_ARCHITECTURES + SPECTROGRAM_ARCHITECTURES:
        return transformers.AutoModelForAudioClassification, None
    if "AutoModelForSequenceClassification" in auto_class_names(model_type):
        return transformers.AutoModelForSequenceClassification, "SEQ_CLS"
    # No sequence-classification head in transformers (Marian, Granite): the language-modelling one.
    if model_type in SPEECH_ARCHITECTURES:  # peft's Whisper recipe: no task type (its seq2seq wrapper wants ids)
        return seq2seq_head(model_type), None
    if model_type in SEQ2SEQ_ARCHITECTURES:
        return transformers.AutoModelForSeq2SeqLM, "SEQ_2_SEQ_LM"
    return transformers.AutoModelForCausalLM, "CAUSAL_LM"


def pretend_training(model, seed=7):
    """Move every trainable parameter, as fine-tuning would (LoRA B starts at zero, so LoRA would be a no-op)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))


@pytest.mark.parametrize("model_type", table(ALL_ARCHITECTURES))
def test_adapter_round_trip_onto_a_freshly_patched_base(model_type, tmp_path):
    head, task_type = head_and_task(model_type)
    # DeiT has two image-classification heads; transformers picks by config.architectures.
    overrides = {"architectures": ["DeiTForImageClassification"]} if model_type == "deit" else {}
    model = ea_hf.patch(tiny_model(model_type, head, seed=0, **overrides))
    projections = attention_projections(model)
    num_evolving = len(ea_hf.summary(model).modules)
    peft_model = peft.get_peft_model(model, lora_config(model, r=4, lora_dropout=0.0, task_type=task_type))
    trainable = {name for name, p in peft_model.named_parameters() if p.requires_grad}
    evolution = {name for name in trainable if ".evolving_attention." in name}
    lora = {name for name in trainable if ".lora_" in name}
    # A and B of every projection: q, k, v (+ o), or a fused qkv and o (ModernBERT), in each of the 3 layers
    # (ALBERT: its one shared layer).
    layers = 1 if model_type in SHARED_LAYER_ARCHITECTURES else 3
    assert len(lora) == 2 * len(projections) and len(projections) >= 2 * layers
    assert len(evolution) == 2 * num_evolving  # weight and bias of every layer
    # Nothing else trains but the task head.
    assert all(".lora_" in n or ".evolving_attention." in n or "modules_to_save" in n for n in trainable)
    inputs = tiny_inputs(model_type)
    if task_type == "SEQ_CLS":
        inputs.pop("decoder_input_ids", None)  # seq2seq classification heads read the source through the decoder
    # The trainable copies of the evolution modules are the ones the forward pass uses: all of them get a
    # gradient. Only the weights' gradients must be non-zero: when the head reads a single query row of the
    # last layer, that layer's bias gradient is zero in exact arithmetic (softmax ignores a shift of the row),
    # so whether it comes out as 0.0 or 1e-14 is rounding that depends on the CPU.
    first_output(peft_model(**inputs)).square().sum().backward()
    for name, parameter in peft_model.named_parameters():
        if name in evolution:
            assert parameter.grad is not None, name
            if name.endswith("weight"):
                assert parameter.grad.abs().max() > 0, name
    pretend_training(peft_model)
    peft_model.eval()
    with torch.no_grad():
        expected = first_output(peft_model(**inputs))
    peft_model.save_pretrained(tmp_path / "adapter")

    # A fresh base, patched under another seed: its evolution weights are new random ones.
    fresh = tiny_model(model_type, head, seed=0, **overrides)
    torch.manual_seed(99)
    ea_hf.patch(fresh)
    with torch.no_grad():
        before = first_output(fresh(**inputs))
    assert (before - expected).abs().max() > 1e-3  # the negative control: the adapter has to bring the weights
    loaded = load_adapter(fresh, tmp_path / "adapter").eval()
    with torch.no_grad():
        reloaded = first_output(loaded(**inputs))
    assert (reloaded - expected).abs().max() <= 1e-6

    # Merging gives an ordinary EA checkpoint with the same outputs.
    merged = loaded.merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    restored = head.from_pretrained(tmp_path / "merged").eval()
    assert ea_hf.is_patched(restored)
    with torch.no_grad():
        assert (first_output(restored(**inputs)) - expected).abs().max() <= 1e-5


def test_load_adapter_refuses_a_base_that_does_not_match(tmp_path):
    model_type = "bert"
    head, _ = head_and_task(model_type)
    patched = ea_hf.patch(tiny_model(model_type, head))
    peft.get_peft_model(patched, lora_config(patched, r=2)).save_pretrained(tmp_path / "ea")
    plain = tiny_model(model_type, head)
    peft.get_peft_model(plain, lora_config(plain, r=2)).save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="trains evolving attention modules; patch the base model"):
        load_adapter(tiny_model(model_type, head), tmp_path / "ea")
    with pytest.raises(ValueError, match="trained on a plain model"):
        load_adapter(ea_hf.patch(tiny_model(model_type, head)), tmp_path / "plain")
    with pytest.raises(FileNotFoundError, match="holds no PEFT adapter"):
        load_adapter(plain, tmp_path)


def test_lora_on_the_real_checkpoint_trains_a_fraction_of_the_weights(minilm_path, minilm_tokenizer):
    model = transformers.AutoModelForSequenceClassification.from_pretrained(minilm_path, num_labels=2)
    ea_hf.patch(model)
    peft_model = peft.get_peft_model(model, lora_config(model))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    # r=8 on q, k, v of 6 layers (384 wide): 6 * 3 * 2 * 8 * 384; 6 evolution convolutions (12 heads, 3x3);
    # the 2-label classifier.
    assert trainable == 6 * 3 * 2 * 8 * 384 + 6 * (12 * 12 * 9 + 12) + (384 * 2 + 2)
    assert trainable / total < 0.01
    batch = minilm_tokenizer(SENTENCES, padding=True, return_tensors="pt")
    assert peft_model(**batch).logits.shape == (3, 2)

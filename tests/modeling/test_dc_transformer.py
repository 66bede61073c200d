"""EA-DC-Transformer on tiny configs: shapes, padding invariance, the baselines from the same classes, save and
load through the Auto classes (and as remote code), the pre-training loss, and a short run that learns."""

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers

import ea_hf  # noqa: F401  (registers the Auto classes)
from ea_hf.modeling.dc_transformer import (
    DilatedConvolution,
    EADCTransformerConfig,
    EADCTransformerForPreTraining,
    EADCTransformerForTimeSeriesClassification,
    EADCTransformerForTimeSeriesRegression,
    EADCTransformerModel,
)
from ea_hf.modeling.evolution import AttentionMapEvolution

TINY = dict(input_size=3, hidden_size=16, num_layers=3, num_attention_heads=2, attention_ratio=0.25, dropout=0.0)
TINY |= dict(alpha=0.5, beta=0.5, max_position_embeddings=32, num_labels=4, num_targets=2)
HEADS = [
    EADCTransformerModel,
    EADCTransformerForTimeSeriesClassification,
    EADCTransformerForTimeSeriesRegression,
    EADCTransformerForPreTraining,
]


def tiny(cls=EADCTransformerModel, seed=0, **overrides):
    torch.manual_seed(seed)
    model = cls(EADCTransformerConfig(**{**TINY, **overrides})).eval()
    with torch.no_grad():  # sharper attention than the 0.02 initialisation gives, so the evolution matters
        for name, parameter in model.named_parameters():
            if name.endswith(("query.weight", "key.weight")):
                parameter.normal_(0.0, 0.5)
    return model


def batch(seed=1, lengths=(9, 6, 4), channels=3):
    """Series of different lengths, right-padded to the longest, with random values under the padding."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(len(lengths), max(lengths), channels, generator=generator)
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    return values, mask


def outputs(model, values, mask, **kwargs):
    """The head's main output (hidden states, logits or reconstruction)."""
    if isinstance(model, EADCTransformerForPreTraining):
        kwargs.setdefault("value_mask", torch.zeros_like(values, dtype=torch.bool))
    out = model(values, attention_mask=mask, **kwargs)
    return out[0] if not isinstance(model, EADCTransformerForPreTraining) else out.reconstruction


def test_shapes_of_every_head():
    values, mask = batch()
    with torch.no_grad():
        base = tiny()(values, attention_mask=mask, output_attentions=True)
        assert base.last_hidden_state.shape == (3, 9, 16)
        assert len(base.attentions) == 3 and base.attentions[0].shape == (3, 2, 9, 9)  # 2 heads of width 2
        assert tiny(HEADS[1])(values, mask).logits.shape == (3, 4)
        assert tiny(HEADS[2])(values, mask).logits.shape == (3, 2)
        pretraining = tiny(HEADS[3])(values, mask)
    assert pretraining.reconstruction.shape == values.shape and pretraining.value_mask.shape == values.shape


@pytest.mark.parametrize("head", HEADS, ids=lambda cls: cls.__name__)
def test_padding_changes_nothing_for_the_real_steps(head):
    model = tiny(head)
    values, mask = batch()
    other = values.clone()
    other[mask == 0] = 100.0  # whatever sits under the padding
    with torch.no_grad():
        batched = outputs(model, values, mask)
        assert (outputs(model, other, mask) - batched).abs().max() <= 1e-5
        for row, length in enumerate(mask.sum(dim=1).tolist()):
            alone = outputs(model, values[row : row + 1, :length], None)[0]
            got = batched[row] if batched.dim() == 2 else batched[row, :length]
            assert (got - alone).abs().max() <= 1e-5


def test_the_baselines_come_from_the_same_classes():
    def modules(model, kind):
        return sum(isinstance(module, kind) for module in model.modules())

    ea = tiny()
    dc = tiny(alpha=0.0, beta=0.0)
    transformer = tiny(alpha=0.0, beta=0.0, attention_ratio=1.0)
    assert (modules(ea, AttentionMapEvolution), modules(ea, DilatedConvolution)) == (3, 3)
    assert (modules(dc, AttentionMapEvolution), modules(dc, DilatedConvolution)) == (0, 3)
    assert (modules(transformer, AttentionMapEvolution), modules(transformer, DilatedConvolution)) == (0, 0)
    evolution = sum(p.numel() for m in ea.modules() if isinstance(m, AttentionMapEvolution) for p in m.parameters())
    assert evolution == 3 * (2 * 2 * 9 + 2)  # 2 heads, 3x3 kernels
    assert sum(p.numel() for p in ea.parameters()) - sum(p.numel() for p in dc.parameters()) == evolution
    values, mask = batch()
    with torch.no_grad():  # the evolution changes what the same weights compute
        same = dict(dc.state_dict())
        ea_same = tiny()
        ea_same.load_state_dict(same, strict=False)
        assert (outputs(ea_same, values, mask) - outputs(dc, values, mask)).abs().max() > 1e-3
    with pytest.raises(ValueError, match="attention_ratio must be in"):
        EADCTransformerConfig(attention_ratio=1.5)
    with pytest.raises(ValueError, match="must split evenly into 3 heads"):
        EADCTransformerConfig(hidden_size=16, attention_ratio=0.25, num_attention_heads=3)
    with pytest.raises(ValueError, match="the model takes at most 32"):
        tiny()(torch.randn(1, 33, 3))


AUTO = {
    EADCTransformerModel: transformers.AutoModel,
    EADCTransformerForTimeSeriesClassification: transformers.AutoModelForSequenceClassification,
    EADCTransformerForPreTraining: transformers.AutoModelForPreTraining,
    EADCTransformerForTimeSeriesRegression: EADCTransformerForTimeSeriesRegression,  # no Auto class of its own
}


@pytest.mark.parametrize("head", HEADS, ids=lambda cls: cls.__name__)
def test_save_and_load_through_the_auto_classes(head, tmp_path):
    model = tiny(head)
    model.save_pretrained(tmp_path)
    assert {"config.json", "model.safetensors", "dc_transformer.py", "attention.py"} <= set(os.listdir(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "ea-dc-transformer" and config["alpha"] == 0.5
    loaded = AUTO[head].from_pretrained(tmp_path).eval()
    assert type(loaded) is head
    values, mask = batch()
    with torch.no_grad():
        assert torch.equal(outputs(loaded, values, mask), outputs(model, values, mask))


def test_fine_tuning_heads_start_from_a_pretraining_checkpoint(tmp_path):
    pretrained = tiny(EADCTransformerForPreTraining)
    pretrained.save_pretrained(tmp_path)
    loaded, info = EADCTransformerForTimeSeriesClassification.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["unexpected_keys"]  # the reconstruction layer is dropped without a warning
    assert {key.split(".")[0] for key in info["missing_keys"]} == {"classifier"}  # the new head, reported
    reference = pretrained.dc_transformer.state_dict()
    assert all(torch.equal(value, reference[key]) for key, value in loaded.dc_transformer.state_dict().items())


REMOTE = """
import json, sys
sys.modules["ea_hf"] = None
import torch, transformers
model = transformers.AutoModelForSequenceClassification.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
with torch.no_grad():
    logits = model(torch.ones(1, 5, 3)).logits
print(json.dumps({"class": type(model).__module__ + "." + type(model).__name__, "logits": logits.tolist()}))
"""


@pytest.mark.slow
def test_loads_without_ea_hf_as_remote_code(tmp_path):
    model = tiny(EADCTransformerForTimeSeriesClassification)
    model.save_pretrained(tmp_path / "model")
    env = {**os.environ, "PYTHONPATH": "", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    run = subprocess.run(
        [sys.executable, "-c", REMOTE, str(tmp_path / "model")], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["class"].startswith("transformers_modules.") and result["class"].endswith("Classification")
    with torch.no_grad():
        expected = model(torch.ones(1, 5, 3)).logits
    # Float rounding only: the copy without ea_hf evolves with torch operations, not the CPU kernel.
    assert (torch.tensor(result["logits"]) - expected).abs().max() <= 1e-5


def test_the_pretraining_loss_counts_only_hidden_values_of_real_steps():
    model = tiny(EADCTransformerForPreTraining)
    values, mask = batch()
    hidden = torch.rand(values.shape, generator=torch.Generator().manual_seed(3)) < 0.15
    out = model(values, attention_mask=mask, value_mask=hidden)
    counted = hidden & mask.bool()[..., None]
    error = (out.reconstruction - values) ** 2
    assert counted.sum() < hidden.sum()  # some hidden values sit under the padding and must not count
    assert abs(out.loss.item() - error[counted].mean().item()) <= 1e-6
    assert abs(out.loss.item() - error.mean().item()) > 1e-3
    # Only the counted values carry gradient back to the reconstruction.
    (gradient,) = torch.autograd.grad(out.loss, out.reconstruction)
    assert torch.equal(gradient != 0, counted)
    # Hidden values never reach the model: changing them changes no reconstruction.
    changed = values.masked_fill(hidden, 50.0)
    with torch.no_grad():
        again = model(changed, attention_mask=mask, value_mask=hidden).reconstruction
    assert torch.equal(again, out.reconstruction.detach())
    # Without a mask, about mask_ratio of the values are hidden.
    drawn = model(torch.randn(8, 32, 3)).value_mask
    assert 0.12 <= drawn.float().mean().item() <= 0.18


def test_a_short_training_run_lowers_the_loss():
    """Two classes of series (a sine and a square wave of random phase, with noise); 60 AdamW steps."""
    generator = torch.Generator().manual_seed(0)
    steps = torch.arange(20).float()
    phase = torch.rand(64, 1, generator=generator) * 6.28
    labels = torch.arange(64) % 2
    sine = torch.sin(steps / 2 + phase)
    wave = torch.where(labels[:, None] == 0, sine, torch.sign(sine))
    values = (wave[..., None] + 0.3 * torch.randn(64, 20, 3, generator=generator)).float()
    model = tiny(EADCTransformerForTimeSeriesClassification, num_labels=2).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        loss = model(values, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        evolution_grads = [m.weight.grad for m in model.modules() if isinstance(m, AttentionMapEvolution)]
        optimizer.step()
        losses.append(loss.item())
    assert all(g is not None and g.abs().max() > 0 for g in evolution_grads)
    assert losses[0] > 0.6 and max(losses[-5:]) < 0.25 * losses[0]

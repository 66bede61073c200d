"""ONNX export: EA models round-trip through torch's ONNX exporter and onnxruntime (BERT and ModernBERT
classifiers, a Llama prefill, a ViT classifier), with padding in the batch and at another shape than the traced
one; the fused kernels step aside while a trace runs; ``ea-hf export --onnx`` writes the folder optimum and
onnxruntime read, and says clearly what it cannot export."""

import json

import numpy as np
import pytest
import torch
import transformers
from testing import SENTENCES, causal_lm, left_padded_inputs, patched_model, tiny_checkpoint, tiny_inputs, tiny_model

import ea_hf
from ea_hf.cli import main
from ea_hf.integrations.onnx import CHECK_SHAPE, TRACE_SHAPE, export_model, head_of
from ea_hf.ops.cpu import binding as cpu_binding
from ea_hf.ops.cpu import evolution as cpu_evolution
from ea_hf.ops.fused_step import tracing_without_kernels
from ea_hf.ops.triton import common as triton_common

onnxruntime = pytest.importorskip("onnxruntime", reason="ONNX export is the optional onnx extra")
pytest.importorskip("onnxscript", reason="ONNX export is the optional onnx extra")

SETTINGS = {"alpha": 0.3, "beta": 0.3}


def onnx_logits(path, inputs: dict[str, torch.Tensor]) -> np.ndarray:
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {name: tensor.numpy() for name, tensor in inputs.items()})[0]  # the first: logits


def torch_logits(model, inputs: dict[str, torch.Tensor], **options) -> np.ndarray:
    with torch.no_grad():
        return model(**inputs, **options).logits.numpy()


def test_the_kernels_step_aside_while_a_trace_runs_and_only_then(monkeypatch):
    maps, weight = torch.randn(1, 4, 5, 5), torch.randn(4, 4, 3, 3)
    monkeypatch.setenv("EA_HF_TRITON", "1")
    cuda = torch.device("cuda")  # the Triton kernels' judgement of CUDA maps, which needs no GPU
    outside = (
        tracing_without_kernels(),
        cpu_evolution.applicable(maps, weight=weight),
        triton_common.enabled(cuda, maps.dtype),
    )
    inside = []

    def probe(x):
        triton_enabled = triton_common.enabled(cuda, x.dtype)
        inside.append((tracing_without_kernels(), cpu_evolution.applicable(x, weight=weight), triton_enabled))
        return x * 2

    torch.jit.trace(probe, maps, check_trace=False)
    assert outside == (False, cpu_binding.kernel_available(), triton_common.triton is not None)
    assert inside == [(True, False, False)]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")  # inside torch's exporter
def test_the_reported_torch_onnx_export_of_a_patched_bert_classifier_runs_in_onnxruntime(tmp_path):
    """The call of the bug report (static shapes; the export command's test runs BERT at other shapes): the
    default CPU kernel no longer stops the exporter."""
    model = patched_model("bert", SETTINGS, transformers.AutoModelForSequenceClassification)
    inputs = tiny_inputs("bert")  # right-padded rows
    program = torch.onnx.export(model, (inputs["input_ids"], inputs["attention_mask"]), dynamo=True, verbose=False)
    program.save(str(tmp_path / "model.onnx"))
    # The graph's inputs take the names of forward's parameters.
    assert np.abs(onnx_logits(tmp_path / "model.onnx", inputs) - torch_logits(model, inputs)).max() <= 1e-5


@pytest.mark.slow
def test_a_classifier_with_learned_gates_exports_them_as_they_are(tmp_path):
    """Learned gates (the quickstart's setting), off their exact start: the exporter traces them as tensors (their
    values read as numbers would stop it), and onnxruntime computes what the model does."""
    model = patched_model("bert", {**SETTINGS, "gates": "learned"}, transformers.AutoModelForSequenceClassification)
    exported = export_model(model, tmp_path / "model.onnx")
    assert exported.max_difference <= 1e-5  # onnxruntime at CHECK_SHAPE, padded
    inputs = tiny_inputs("bert", batch=3, length=10, seed=5)
    assert np.abs(onnx_logits(exported.path, inputs) - torch_logits(model, inputs)).max() <= 1e-5


@pytest.mark.full_table  # CI's second stage: fast: BERT and Llama round trips
@pytest.mark.slow
def test_a_modernbert_classifier_round_trips_with_padding_at_another_shape(tmp_path):
    # Global and sliding-window layers (a window of 2 tokens each side): the exported masks keep both.
    model = patched_model("modernbert", SETTINGS, transformers.AutoModelForSequenceClassification)
    exported = export_model(model, tmp_path / "model.onnx")
    assert exported.head.task == "text-classification" and exported.inputs == ("input_ids", "attention_mask")
    assert exported.max_difference <= 1e-5  # onnxruntime at CHECK_SHAPE, padded
    inputs = tiny_inputs("modernbert", batch=4, length=11, seed=3)
    assert (4, 11) not in (TRACE_SHAPE, CHECK_SHAPE)
    assert np.abs(onnx_logits(exported.path, inputs) - torch_logits(model, inputs)).max() <= 1e-5


@pytest.mark.slow
def test_a_llama_prefill_round_trips_with_left_padding_and_position_ids(tmp_path):
    model = ea_hf.patch(causal_lm("llama"), **SETTINGS)
    exported = export_model(model, tmp_path / "model.onnx")
    assert exported.head.task == "text-generation"
    assert exported.inputs == ("input_ids", "attention_mask", "position_ids")
    assert exported.max_difference <= 1e-5
    for inputs in (left_padded_inputs(), left_padded_inputs(batch=2, length=13, seed=4)):
        mask = inputs["attention_mask"]
        inputs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate counts them
        onnx, expected = onnx_logits(exported.path, inputs), torch_logits(model, inputs, use_cache=False)
        real = mask.bool().numpy()
        assert onnx.shape == expected.shape and np.abs(onnx[real] - expected[real]).max() <= 1e-5


@pytest.mark.full_table  # CI's second stage: fast: BERT and Llama round trips
@pytest.mark.slow
def test_a_vit_classifier_round_trips_with_a_dynamic_batch(tmp_path):
    model = ea_hf.patch(tiny_model("vit", transformers.AutoModelForImageClassification, num_labels=3), **SETTINGS)
    exported = export_model(model, tmp_path / "model.onnx")
    assert exported.head.task == "image-classification" and exported.inputs == ("pixel_values",)
    assert exported.max_difference <= 1e-5
    inputs = tiny_inputs("vit", batch=20)  # past the batch sizes where torch's shapes might branch (16)
    assert np.abs(onnx_logits(exported.path, inputs) - torch_logits(model, inputs)).max() <= 1e-5


@pytest.mark.slow
def test_the_export_command_writes_what_onnxruntime_and_transformers_read(minilm_tokenizer, tmp_path, capsys):
    run_dir = tmp_path / "run"  # the final model of a run: an EA checkpoint saved with its tokenizer
    model = ea_hf.patch(
        transformers.AutoModelForSequenceClassification.from_pretrained(
            tiny_checkpoint("bert", minilm_tokenizer, tmp_path / "base")
        ),
        **SETTINGS,
    )
    model.save_pretrained(run_dir)
    minilm_tokenizer.save_pretrained(run_dir)

    assert main(["export", "--onnx", str(run_dir)]) == 0
    captured = capsys.readouterr()
    output = run_dir / "onnx"
    assert f"wrote {output / 'model.onnx'}" in captured.out
    assert "checked: onnxruntime's logits match PyTorch's within" in captured.err  # progress on stderr
    assert {"model.onnx", "config.json", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in output.iterdir()
    }
    # The config is the architecture's own (the graph holds the evolution): it loads without ea_hf's classes.
    config = json.loads((output / "config.json").read_text())
    assert config["model_type"] == "bert" and config["architectures"] == ["BertForSequenceClassification"]
    assert "auto_map" not in config and "evolving_attention" not in config
    assert type(transformers.AutoConfig.from_pretrained(output)) is transformers.BertConfig

    # What a user of the folder runs: its tokenizer, padded batches of two shapes, its graph.
    tokenizer = transformers.AutoTokenizer.from_pretrained(output)
    for texts in (SENTENCES[:2], SENTENCES[:3] + ["a much longer sentence than the others, to pad them all"]):
        inputs = dict(tokenizer(texts, padding=True, return_tensors="pt"))
        assert inputs["attention_mask"].min() == 0
        assert np.abs(onnx_logits(output / "model.onnx", inputs) - torch_logits(model, inputs)).max() <= 1e-5

    # A second export never writes over the first.
    assert main(["export", "--onnx", str(run_dir)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err


def test_what_cannot_be_exported_says_so_in_one_clear_error(tmp_path, capsys):
    adapter = tmp_path / "lora-run"  # a LoRA run that saved its adapter, not merged
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    assert main(["export", "--onnx", str(adapter)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "holds a LoRA adapter, not a whole model" in error and "peft.merge=true" in error

    series = tmp_path / "series-run"  # a time-series run: no head that exports
    series.mkdir()
    (series / "config.json").write_text(json.dumps({"architectures": ["EADCTransformerForTimeSeriesClassification"]}))
    assert main(["export", "--onnx", str(series)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "EADCTransformerForTimeSeriesClassification does not export to ONNX" in error
    assert "ForSequenceClassification (text-classification)" in error

    assert main(["export", "--onnx", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the format is named
        main(["export", str(series)])
    assert "--onnx" in capsys.readouterr().err
    assert head_of("EALlamaForCausalLM").task == "text-generation"

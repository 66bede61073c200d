"""``torch.compile(model, fullgraph=True)`` of EA models: no graph break in inference or a training step, and the
same outputs and gradients as eager mode.

Compiled graphs call the CPU kernel as the torch operators ``ea_hf::evolve_with_gate_bits`` and
``ea_hf::evolve_backward_one_map`` (asserted below), and the map-reuse of inference is skipped before it reads a
reference count. Where the maps are larger than a layer's keys and values, a training step recomputes S and P inside a
selective activation checkpoint (``compiled_core``; what it keeps is tested in ``test_attention_core.py``).
The backend is ``aot_eager``: it traces forward and backward through AOTAutograd like inductor does, in seconds
rather than the minute inductor's C++ build takes here (inductor gave the same outputs to 3e-9 and gradients to
1.5e-8 on the tiny BERT). ``torch.export`` of an EA encoder is tested at the end.
"""

import pytest
import torch
import transformers
from testing import FULL_TABLE, SEQ2SEQ_ARCHITECTURES, defined, patched_model, tiny_inputs
from torch._dynamo.backends.common import aot_autograd

import ea_hf
from ea_hf.modeling.architectures import release
from ea_hf.ops.cpu import binding as cpu_binding

#: One family of each kind: encoder, vision, encoder-decoder (T5 and BART, forward), decoder-only.
FAMILIES = {
    "bert": transformers.AutoModelForSequenceClassification,
    "vit": transformers.AutoModelForImageClassification,
    "t5": transformers.AutoModelForSeq2SeqLM,
    "llama": transformers.AutoModelForCausalLM,
    "bart": transformers.AutoModelForSeq2SeqLM,
}
TOLERANCE = 1e-5
#: The oldest torch whose dynamo traces transformers' own encoder-decoder forward in one graph: on 2.10 and 2.12
#: unpatched BART and T5 break it too (EncoderDecoderCache copies the config, copy.deepcopy / __reduce_ex__).
SEQ2SEQ_COMPILE_TORCH = (2, 13)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def training_step(model, inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The first output and the gradients of every parameter (by name, without torch.compile's prefix) of one
    backward pass of a loss that reads every output."""
    model.zero_grad()
    output = model(**inputs)[0]
    output.float().pow(2).mean().backward()
    grads = {
        name.removeprefix("_orig_mod."): p.grad.clone() for name, p in model.named_parameters() if p.grad is not None
    }
    return output.detach(), grads


def assert_compiles_like_eager(model, model_type: str, length: int = 9) -> None:
    """No graph break; inference, and for all but the encoder-decoder families a training step, through
    ``torch.compile(fullgraph=True)`` give eager mode's outputs and gradients within TOLERANCE."""
    if model_type in SEQ2SEQ_ARCHITECTURES and release(torch.__version__) < SEQ2SEQ_COMPILE_TORCH:
        pytest.skip(f"transformers' own {model_type} forward has graph breaks on torch {torch.__version__}")
    inputs = tiny_inputs(model_type, length=length)
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(**inputs)
        assert explanation.graph_break_count == 0, [str(reason.reason) for reason in explanation.break_reasons]
        expected = model(**inputs)[0]
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        got = compiled(**inputs)[0]
    assert (defined(model_type, inputs, got) - defined(model_type, inputs, expected)).abs().max() <= TOLERANCE

    if model_type in SEQ2SEQ_ARCHITECTURES:  # the encoder-decoder families: forward only (the scope)
        return
    # A training step in eval mode: dropout would draw different masks in the two runs.
    eager_output, eager_grads = training_step(model, inputs)
    compiled_output, compiled_grads = training_step(torch.compile(model, fullgraph=True, backend="aot_eager"), inputs)
    assert (compiled_output - eager_output).abs().max() <= TOLERANCE
    # A gradient that only one of them gives is zero: the first layer's learned alpha (it has no A_prev), which
    # eager mode's gated step gives a zero gradient and the traced step, whose graph does not use it, none.
    for name in compiled_grads.keys() ^ eager_grads.keys():
        assert not {**eager_grads, **compiled_grads}[name].any(), name
    assert any(".evolving_attention." in name for name in eager_grads)  # the evolution is trained through it
    for name in compiled_grads.keys() & eager_grads.keys():
        assert (compiled_grads[name] - eager_grads[name]).abs().max() <= TOLERANCE, name


@pytest.mark.slow
@pytest.mark.parametrize(  # t5: CI's second stage (bart is the fast run's encoder-decoder)
    "model_type", [pytest.param(m, marks=FULL_TABLE if m == "t5" else ()) for m in sorted(FAMILIES)]
)
def test_fullgraph_compile_matches_eager_in_inference_and_training(model_type):
    model = patched_model(model_type, {"alpha": 0.3, "beta": 0.4}, head=FAMILIES[model_type])
    assert_compiles_like_eager(model, model_type)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", [pytest.param("bert", marks=FULL_TABLE), "llama"])  # bert: CI's second stage
def test_learned_gates_compile_like_eager(model_type):
    """Learned gates (here at 0.3 and 0.4, off the exact start) are tensors while dynamo traces: their values are
    not read (a data-dependent guard would break ``fullgraph``), and the compiled step gives eager mode's outputs
    and gradients, the gates' included."""
    settings = {"alpha": 0.3, "beta": 0.4, "gates": "learned"}
    model = patched_model(model_type, settings, head=FAMILIES[model_type])
    assert_compiles_like_eager(model, model_type)
    assert any(name.endswith("beta_gate") and p.grad is not None for name, p in model.named_parameters())


@pytest.mark.slow
@pytest.mark.skipif(
    cpu_binding.cpu_kernel() is None, reason="no C++ compiler: compiled_core checkpoints the CPU kernel only"
)
@pytest.mark.parametrize("model_type", [pytest.param("bert", marks=FULL_TABLE), "llama"])  # bert: CI's second stage
def test_fullgraph_compile_of_large_maps_recomputes_them_like_eager(model_type):
    """Sequences longer than twice the heads' width (8 here): a compiled training step runs each layer inside a
    selective activation checkpoint, still without a graph break and with eager mode's gradients."""
    model = patched_model(model_type, {"alpha": 0.3, "beta": 0.4}, head=FAMILIES[model_type])
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    assert 24 > 2 * head_dim
    assert_compiles_like_eager(model, model_type, length=24)


@pytest.mark.slow
@pytest.mark.parametrize(  # the fast run: a decoder's remote code (the test above: every kind)
    "model_type", [pytest.param(m, marks=() if m == "llama" else FULL_TABLE) for m in sorted(FAMILIES)]
)
def test_a_loaded_ea_checkpoint_compiles_like_eager(model_type, tmp_path):
    """An EA checkpoint saved and loaded back with the Auto class (remote code) compiles like the patched model."""
    model = patched_model(model_type, {"alpha": 0.2, "beta": 0.3}, head=FAMILIES[model_type])
    model.save_pretrained(tmp_path)
    loaded = FAMILIES[model_type].from_pretrained(tmp_path).eval()
    assert ea_hf.is_patched(loaded)
    assert_compiles_like_eager(loaded, model_type)


@pytest.mark.skipif(cpu_binding.cpu_kernel() is None, reason="no C++ compiler on this machine: no CPU kernel to call")
def test_compiled_graphs_call_the_kernel_operators():
    """The forward graph of inference and the forward and backward graphs of a training step call the kernel
    (one operator per layer each), not a torch-operations copy of it."""
    model = patched_model("bert", {"alpha": 0.3, "beta": 0.4})
    inputs = tiny_inputs("bert")
    called: list[str] = []

    def record(graph, example_inputs):
        called.extend(str(node.target) for node in graph.graph.nodes if str(node.target).startswith("ea_hf."))
        return graph

    backend = aot_autograd(fw_compiler=record, bw_compiler=record)
    with torch.no_grad():
        torch.compile(model, fullgraph=True, backend=backend)(**inputs)
    assert called == ["ea_hf.evolve_with_gate_bits.default"] * 3
    called.clear()
    torch.compile(model, fullgraph=True, backend=backend)(**inputs)[0].pow(2).mean().backward()
    assert sorted(called) == ["ea_hf.evolve_backward_one_map.default"] * 3 + ["ea_hf.evolve_with_gate_bits.default"] * 3


@pytest.mark.parametrize("strict", [False, True])
def test_torch_export_of_an_ea_encoder(tmp_path, strict):
    """torch.export of a patched BERT: the exported program computes what the model does, also after a save
    and load, and holds the kernel operator where there is one."""
    model = patched_model("bert", {"alpha": 0.3, "beta": 0.4})
    inputs = tiny_inputs("bert")
    with torch.no_grad():
        expected = model(**inputs).last_hidden_state
        program = torch.export.export(model, args=(), kwargs=inputs, strict=strict)
        torch.export.save(program, tmp_path / "bert.pt2")
        loaded = torch.export.load(tmp_path / "bert.pt2")
        for exported in (program, loaded):
            assert (exported.module()(**inputs).last_hidden_state - expected).abs().max() <= TOLERANCE
    operators = [str(node.target) for node in program.graph.nodes if str(node.target).startswith("ea_hf.")]
    assert operators == (["ea_hf.evolve_with_gate_bits.default"] * 3 if cpu_binding.cpu_kernel() is not None else [])


def test_torch_export_of_learned_gates_reads_them_in_the_graph():
    """torch.export of a BERT with learned gates: the program computes what the model does, and takes the gates as
    its parameters (their trained values are not baked in as numbers)."""
    model = patched_model("bert", {"alpha": 0.3, "beta": 0.4, "gates": "learned"})
    inputs = tiny_inputs("bert")
    with torch.no_grad():
        expected = model(**inputs).last_hidden_state
        program = torch.export.export(model, args=(), kwargs=inputs)
        assert (program.module()(**inputs).last_hidden_state - expected).abs().max() <= TOLERANCE
        gates = [name for name in program.state_dict if name.endswith(("alpha_gate", "beta_gate"))]
        assert len(gates) == 2 * model.config.num_hidden_layers
        for name in gates:  # the gates moved in the program's parameters move its output as they move the model's
            program.state_dict[name].fill_(0.0)
        zeroed = program.module()(**inputs).last_hidden_state
        for name, parameter in model.named_parameters():
            if name.endswith(("alpha_gate", "beta_gate")):
                parameter.fill_(0.0)
        at_zero = model(**inputs).last_hidden_state
    assert (zeroed - at_zero).abs().max() <= TOLERANCE
    assert (at_zero - expected).abs().max() > 10 * TOLERANCE

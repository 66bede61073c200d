"""The fused attention tail (``ea_hf.ops.triton.attention_tail``: masked softmax and product with the values without
forming P) against torch's operations in float64, and in the attention core: every test runs in Triton's
interpreter on CPU tensors and compiled on a CUDA GPU where there is one (the ``device`` fixture)."""

import os

# As in test_evolution.py: set before this module imports triton, restored after it.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from testing import METHODS, patched_model, spy_on, tiny_inputs  # noqa: E402

from ea_hf.modeling import kernels as registry  # noqa: E402
from ea_hf.modeling.attention_tail import attend_values, softmax_probabilities  # noqa: E402
from ea_hf.modeling.masks import AttentionMask  # noqa: E402
from ea_hf.modeling.scores import grouped_product  # noqa: E402
from ea_hf.ops.triton import attention_tail as tail  # noqa: E402
from ea_hf.ops.triton import common, evolution  # noqa: E402

triton = pytest.importorskip(
    "triton", minversion=common.MIN_TRITON, reason="the Triton kernels need the optional triton package"
)

#: Max error relative to the reference's largest magnitude, for float32.
FP32_TOLERANCE = 1e-5
#: The rounding of one value in each dtype (half an ulp at 1, relative).
ROUNDING = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@pytest.fixture(autouse=True)
def triton_on(monkeypatch, device):
    monkeypatch.setenv("EA_HF_TRITON", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1" if device == "cpu" else "0")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # float32 accuracy on a GPU
    # One configuration (on a GPU too: autotune does not choose), with tiles that split the test maps into
    # several, the last ones partial.
    small = ({"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 3},)
    monkeypatch.setattr(tail, "CONFIGS", {kind: dict.fromkeys(tail.CONFIGS[kind], small) for kind in tail.CONFIGS})


def masks(kind: str, batch: int, rows: int, cols: int, generator: torch.Generator):
    """(allowed, additive) of one kind of attention mask: right padding whose last example's keys are all
    masked for some query rows (a fully masked row), causal, an additive padding mask, or none."""
    if kind == "none":
        return None, None
    if kind == "padding":
        lengths = torch.tensor([cols, 3])[:batch]
        allowed = (torch.arange(cols) < lengths[:, None])[:, None, None, :].expand(batch, 1, rows, cols).clone()
        allowed[-1, :, rows // 2] = False  # a fully masked row: uniform weights, as in eager attention
        return allowed, None
    if kind == "causal":
        return torch.ones(rows, cols, dtype=torch.bool).tril(cols - rows), None
    additive = torch.randn(batch, 1, 1, cols, generator=generator)
    additive[:, :, :, -4:] = torch.finfo(torch.float32).min
    return None, additive


def reference(logits, allowed, additive, value, keep, scale):
    """The tail in float64 as eager attention computes it (float32's minimum where a bool mask fills)."""
    logits = logits.double()
    if allowed is not None:
        logits = logits.masked_fill(~allowed, torch.finfo(torch.float32).min)
    if additive is not None:
        logits = logits + additive.double()
    weights = logits.softmax(-1)
    if keep is not None:
        weights = weights * keep * scale
    return grouped_product(weights, value.double())


def max_error(got, want):
    return (got.cpu().double() - want.cpu().double()).abs().max().item()


DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Every dtype with every mask; dropout with one mask per dtype.
ACCURACY_CASES = [(dtype, mask, 0.0) for dtype in DTYPES for mask in ("none", "padding", "causal", "additive")] + [
    (torch.float32, "padding", 0.25),
    (torch.bfloat16, "causal", 0.25),
    (torch.float16, "additive", 0.25),
]


@pytest.mark.parametrize(("dtype", "mask", "dropout"), ACCURACY_CASES, ids=str)
def test_tail_meets_flash_attentions_accuracy_rule(device, dtype, mask, dropout):
    """Output, and the gradients of the logits and the values, against float64: float32 within 1e-5 of the
    largest value; half precision within 2x the error of torch's own operations in that dtype (the attention
    core's :func:`attend_values` and autograd) plus the dtype's rounding of the exact result. Grouped-query
    values (4 heads over 2), 21 x 35 maps (partial tiles of 16), dropout by a given mask."""
    generator = torch.Generator().manual_seed(0)
    batch, heads, rows, cols, head_dim = 2, 4, 21, 35, 24
    logits = (3 * torch.randn(batch, heads, rows, cols, generator=generator)).to(dtype)
    value = torch.randn(batch, 2, cols, head_dim, generator=generator).to(dtype)
    grad_output = torch.randn(batch, heads, rows, head_dim, generator=generator).to(dtype)
    allowed, additive = masks(mask, batch, rows, cols, generator)
    keep = torch.rand(batch, heads, rows, cols, generator=generator) >= dropout if dropout else None
    scale = 1.0 / (1.0 - dropout)

    exact_logits = logits.double().requires_grad_()
    exact_value = value.double().requires_grad_()
    want = reference(exact_logits, allowed, additive, exact_value, keep, scale)
    want.backward(grad_output.double())

    on = [None if t is None else t.to(device) for t in (logits, allowed, additive, value, keep, grad_output)]
    assert tail.applicable(on[0], on[1], on[2], on[3])
    output, stats = tail.forward(*on[:5], scale)
    grad_logits, grad_value = tail.backward(*on[:5], scale, stats, on[5], dtype)
    assert (output.dtype, grad_logits.dtype, grad_value.dtype) == (dtype, dtype, dtype)
    assert output.shape == want.shape and grad_value.shape == value.shape

    got = {"output": output, "logits": grad_logits, "value": grad_value}
    exact = {"output": want, "logits": exact_logits.grad, "value": exact_value.grad}
    if dtype == torch.float32:
        for name in got:
            assert max_error(got[name], exact[name]) <= FP32_TOLERANCE * exact[name].abs().max().item(), name
        return
    # torch's operations in this dtype: the core's tail (fp32 softmax, weights and product in the values' dtype).
    torch_logits, torch_value = logits.clone().requires_grad_(), value.clone().requires_grad_()
    if keep is None:
        torch_output = attend_values(torch_logits, AttentionMask(allowed, additive), torch_value, 0.0)[0]
    else:
        weights = softmax_probabilities(torch_logits, AttentionMask(allowed, additive)).to(dtype) * keep * scale
        torch_output = grouped_product(weights, torch_value)
    torch_output.backward(grad_output)
    in_torch = {"output": torch_output, "logits": torch_logits.grad, "value": torch_value.grad}
    for name in got:
        bound = 2 * max_error(in_torch[name], exact[name]) + ROUNDING[dtype] * exact[name].abs().max().item()
        assert max_error(got[name], exact[name]) <= bound, name


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_adds_the_addend_as_it_writes_the_logits_gradient(device, dtype):
    """With an addend (the next layer's gradient of A_logit, the attention core's), the logits' gradient is the
    tail's own plus the addend, also where a bool mask filled (the softmax's gradient is zero there, the addend's
    is not): float32 within 1e-5 of the largest value; half precision within one rounding of each (the sum is
    rounded once, in float32, where adding to the rounded gradient rounds twice). The values' gradient is the
    same bits, the addend is not written, and ``addend=None`` gives the call without one bit for bit. A
    non-contiguous addend is read as its values."""
    generator = torch.Generator().manual_seed(1)
    batch, heads, rows, cols, head_dim = 2, 4, 21, 35, 24
    logits = (3 * torch.randn(batch, heads, rows, cols, generator=generator)).to(dtype)
    value = torch.randn(batch, 2, cols, head_dim, generator=generator).to(dtype)
    grad_output = torch.randn(batch, heads, rows, head_dim, generator=generator).to(dtype)
    addend = torch.randn(batch, heads, cols, rows, generator=generator).to(dtype).transpose(-1, -2)
    allowed, additive = masks("padding", batch, rows, cols, generator)
    on = [None if t is None else t.to(device) for t in (logits, allowed, additive, value, None, grad_output, addend)]
    addend_before = on[6].clone()
    _, stats = tail.forward(*on[:5], 1.0)
    alone, grad_value = tail.backward(*on[:5], 1.0, stats, on[5], dtype)
    summed, grad_value_summed = tail.backward(*on[:5], 1.0, stats, on[5], dtype, on[6])
    none, grad_value_none = tail.backward(*on[:5], 1.0, stats, on[5], dtype, None)

    assert torch.equal(none, alone) and torch.equal(grad_value_none, grad_value)
    assert torch.equal(grad_value_summed, grad_value) and torch.equal(on[6], addend_before)
    assert summed.dtype == dtype and summed.shape == logits.shape
    want = alone.cpu().double() + addend.double()
    filled = ~allowed.expand(logits.shape)
    assert torch.equal(alone.cpu()[filled], torch.zeros_like(alone.cpu()[filled]))
    assert torch.equal(summed.cpu()[filled], addend[filled])  # 0 + addend: exact in any dtype
    if dtype == torch.float32:
        bound = FP32_TOLERANCE * want.abs().max().item()
    else:
        bound = ROUNDING[dtype] * (want.abs().max().item() + alone.abs().max().item())
    assert max_error(summed, want) <= bound
    assert max_error(summed, alone.cpu().double()) > 10 * bound  # the addend was added


def test_fully_masked_rows_weigh_every_key_alike(device):
    """A row whose keys are all masked (a bool mask) averages every value, as eager attention's softmax over
    float32's minimum does, forward and backward (its logits get no gradient)."""
    logits = torch.randn(1, 1, 20, 20)
    value = torch.randn(1, 1, 20, 8)
    allowed = torch.ones(1, 1, 20, 20, dtype=torch.bool)
    allowed[..., 7, :] = False
    output, stats = tail.forward(*(t.to(device) for t in (logits, allowed)), None, value.to(device))
    assert torch.allclose(output[0, 0, 7].cpu(), value[0, 0].mean(0), atol=1e-6)
    grad_logits, _ = tail.backward(
        *(t.to(device) for t in (logits, allowed)), None, value.to(device), None, 1.0, stats,
        torch.ones_like(output), torch.float32,
    )  # fmt: skip
    assert grad_logits[0, 0, 7].abs().max().item() == 0.0


def test_applicable_only_where_opted_in_and_the_shapes_fit(device, monkeypatch):
    """The tail takes [B, H, Q, K] logits, values whose heads divide the logits' and whose keys are the maps'
    columns, masks that broadcast; only with ``EA_HF_TRITON=1``."""
    logits, value = torch.randn(2, 4, 5, 6, device=device), torch.randn(2, 2, 6, 8, device=device)
    assert tail.applicable(logits, torch.ones(6, dtype=torch.bool, device=device), None, value)
    assert not tail.applicable(logits, None, None, torch.randn(2, 3, 6, 8, device=device))  # 4 heads over 3
    assert not tail.applicable(logits, None, None, torch.randn(2, 2, 5, 8, device=device))  # 5 keys, 6 columns
    assert not tail.applicable(logits, torch.ones(3, 6, dtype=torch.bool, device=device), None, value)
    assert not tail.applicable(logits, None, None, torch.randn(2, 2, 6, tail.MAX_HEAD_DIM + 1, device=device))
    monkeypatch.setenv("EA_HF_TRITON", "0")
    assert not tail.applicable(logits, None, None, value)


@pytest.mark.parametrize("gates", ["fixed", "learned"])
def test_patched_model_runs_the_tail_unless_the_weights_are_read(monkeypatch, device, gates):
    """A whole EA BERT in training on the Triton kernels runs the fused tail in every layer (forward and
    backward), with the outputs and gradients of the torch tail within 1e-5; asked for its attention weights
    (``output_attentions=True``) it forms them with torch's softmax instead and returns them.

    With dropout (on CPU) both tails draw the kept weights with torch's generator (``bernoulli_`` of the same
    shape), so that under one seed they drop the same weights; on CUDA torch's dropout draws in a kernel of its
    own, so there the two would drop different weights, and the model runs without dropout."""
    calls = spy_on(monkeypatch, tail, names=("forward", "backward"))
    monkeypatch.setattr(registry, "FUSED_KERNELS", [evolution])
    inputs = {key: value.to(device) for key, value in tiny_inputs("bert").items()}
    dropout = 0.1 if device == "cpu" else 0.0
    settings = {**METHODS["conv"], "gates": gates}  # learned gates train in the core too, the tail's gradient theirs
    model = patched_model("bert", settings, attention_probs_dropout_prob=dropout, hidden_dropout_prob=0.0)
    model = model.to(device).train()

    def step(tails):
        monkeypatch.setattr(registry, "FUSED_ATTENTION_TAILS", tails)
        model.zero_grad()
        torch.manual_seed(3)
        output = model(**inputs).last_hidden_state
        (output * torch.linspace(-1, 1, output.shape[-1], device=device)).sum().backward()
        return output.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    (got, got_grads), (want, want_grads) = step([tail]), step([])
    assert calls == ["forward"] * 3 + ["backward"] * 3
    assert (gates == "learned") == any(name.endswith("beta_gate") for name in want_grads)
    assert max_error(got, want) <= FP32_TOLERANCE * want.abs().max().item()
    scale = max(grad.abs().max().item() for grad in want_grads.values())
    assert got_grads.keys() == want_grads.keys()
    for name, want_grad in want_grads.items():
        assert max_error(got_grads[name], want_grad) <= FP32_TOLERANCE * scale, name

    calls.clear()
    monkeypatch.setattr(registry, "FUSED_ATTENTION_TAILS", [tail])
    attentions = model(**inputs, output_attentions=True).attentions
    assert calls == []
    assert len(attentions) == 3 and all(a.shape == (3, 4, 9, 9) for a in attentions)


@pytest.mark.parametrize("model_type", ["bert", "llama"])
def test_inference_runs_the_tail(monkeypatch, device, model_type):
    """Without autograd (inference, and each decoding step of ``generate``) the tail's forward replaces the
    softmax and the product: BERT's output within 1e-5 of the torch tail's, and Llama's greedy continuation the
    same tokens, with the kernel called in every layer of every step."""
    calls = spy_on(monkeypatch, tail, names=("forward",))
    monkeypatch.setattr(registry, "FUSED_KERNELS", [evolution])
    head = transformers.AutoModelForCausalLM if model_type == "llama" else transformers.AutoModel
    model = patched_model(model_type, METHODS["conv"], head=head).to(device).eval()
    inputs = {key: value.to(device) for key, value in tiny_inputs(model_type).items()}
    results = []
    for tails in ([tail], []):
        monkeypatch.setattr(registry, "FUSED_ATTENTION_TAILS", tails)
        with torch.no_grad():
            if model_type == "bert":
                results.append(model(**inputs).last_hidden_state)
            else:
                results.append(model.generate(**inputs, max_new_tokens=3, do_sample=False, pad_token_id=0))
    got, want = results
    if model_type == "bert":
        assert calls == ["forward"] * 3
        assert max_error(got, want) <= FP32_TOLERANCE * want.abs().max().item()
    else:
        assert len(calls) == 3 * 3  # three layers, a prefill and two decoding steps
        assert torch.equal(got, want)


@pytest.mark.parametrize("dropout", [pytest.param(0.0, marks=pytest.mark.full_table), 0.1])  # 0.0: CI's second stage
def test_compiled_model_runs_the_tail_as_operators(monkeypatch, device, dropout):
    """Under ``torch.compile(fullgraph=True)`` the tail runs as the operators of ``ea_hf.ops.triton.operators``:
    in inference one per layer; in training one per layer in the forward graph and its backward operator in the
    backward graph, the forward one not recomputed there (the selective checkpoint keeps its row statistics).
    Without dropout the compiled model gives the torch tail's outputs and gradients within 1e-5; with it (whose
    draws compiled and eager graphs make apart), dropout's mask is drawn once, in the forward graph, and not
    again in the backward graph's replay."""
    from torch._dynamo.backends.common import aot_autograd

    monkeypatch.setattr(registry, "FUSED_KERNELS", [evolution])
    model = patched_model("bert", METHODS["conv"], hidden_dropout_prob=0.0, attention_probs_dropout_prob=dropout)
    model = model.to(device).train()
    inputs = {key: value.to(device) for key, value in tiny_inputs("bert").items()}
    graphs: list[list[str]] = []

    def record(graph, example_inputs):
        names = ("attention_tail", "bernoulli")
        calls = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
        graphs.append([target for target in calls if any(name in target for name in names)])
        return graph

    def step(run, tails):
        monkeypatch.setattr(registry, "FUSED_ATTENTION_TAILS", tails)
        model.zero_grad()
        output = run(**inputs).last_hidden_state
        (output * torch.linspace(-1, 1, output.shape[-1], device=device)).sum().backward()
        named = model.named_parameters()
        return output.detach(), {name: p.grad.clone() for name, p in named if p.grad is not None}

    forward_op, backward_op = "ea_hf.triton_attention_tail.default", "ea_hf.triton_attention_tail_backward.default"
    backend = aot_autograd(fw_compiler=record, bw_compiler=record)
    torch._dynamo.reset()
    try:
        monkeypatch.setattr(registry, "FUSED_ATTENTION_TAILS", [tail])
        with torch.no_grad():
            torch.compile(model.eval(), fullgraph=True, backend=backend)(**inputs)
        assert graphs == [[forward_op] * 3]
        graphs.clear()
        got, got_grads = step(torch.compile(model.train(), fullgraph=True, backend=backend), [tail])
        draws = ["aten.bernoulli.p"] if dropout else []
        assert graphs == [(draws + [forward_op]) * 3, [backward_op] * 3]
    finally:
        torch._dynamo.reset()
    if dropout:
        return
    want, want_grads = step(model, [])
    assert max_error(got, want) <= FP32_TOLERANCE * want.abs().max().item()
    scale = max(grad.abs().max().item() for grad in want_grads.values())
    for name, want_grad in want_grads.items():  # (compiled, the unused pooler gets zeros, not None)
        assert max_error(got_grads[name], want_grad) <= FP32_TOLERANCE * scale, name


@pytest.mark.parametrize("requires_grad", [False, True])
def test_the_tail_operators_pass_opcheck(device, requires_grad):
    """torch.library's checks of the tail's operators: schema, fake implementation (shapes, dtypes), autograd
    registration, and a traced graph's results against the eager call; the backward's with and without an
    addend."""
    generator = torch.Generator().manual_seed(5)
    batch, heads, value_heads, rows, cols, head_dim = 2, 4, 2, 5, 7, 8
    logits = torch.randn(batch, heads, rows, cols, generator=generator)
    value = torch.randn(batch, value_heads, cols, head_dim, generator=generator)
    allowed, additive = masks("padding", batch, rows, cols, generator)[0], None
    keep = torch.rand(batch, heads, rows, cols, generator=generator) > 0.2
    logits, value, allowed, keep = (t.to(device) for t in (logits, value, allowed, keep))
    logits.requires_grad_(requires_grad)
    value.requires_grad_(requires_grad)
    torch.library.opcheck(torch.ops.ea_hf.triton_attention_tail.default, (logits, allowed, additive, value, keep, 1.25))
    output, stats = tail.forward(logits.detach(), allowed, additive, value.detach(), keep, 1.25)
    grad_output = torch.randn_like(output)
    arguments = (logits.detach(), allowed, additive, value.detach(), keep, 1.25, stats, grad_output)
    torch.library.opcheck(torch.ops.ea_hf.triton_attention_tail_backward.default, arguments)
    addend = torch.randn(logits.shape, generator=generator).to(device)
    torch.library.opcheck(torch.ops.ea_hf.triton_attention_tail_backward.default, (*arguments, addend))


def test_gradient_checkpointing_replays_the_tail(monkeypatch, device):
    """With gradient checkpointing each layer's replay in backward takes the fused tail as its forward did
    (transformers' recording of the outputs has ended by then: asked anew, the weights would count as read, the
    replay would take the torch tail and save other tensors, which checkpointing refuses), and the gradients are
    those of the same model without checkpointing, within 1e-5."""
    calls = spy_on(monkeypatch, tail, names=("forward", "backward"))
    monkeypatch.setattr(registry, "FUSED_KERNELS", [evolution])
    monkeypatch.setattr(registry, "FUSED_ATTENTION_TAILS", [tail])
    inputs = {key: value.to(device) for key, value in tiny_inputs("bert").items()}
    model = patched_model("bert", METHODS["conv"], attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
    model = model.to(device).train()

    def gradients(checkpointing):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        model.zero_grad()
        output = model(**inputs).last_hidden_state
        (output * torch.linspace(-1, 1, output.shape[-1], device=device)).sum().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    want = gradients(checkpointing=False)
    calls.clear()
    got = gradients(checkpointing=True)
    assert sorted(calls) == ["backward"] * 3 + ["forward"] * 6  # each layer's forward, then its replay
    scale = max(grad.abs().max().item() for grad in want.values())
    assert got.keys() == want.keys()
    for name, want_grad in want.items():
        assert max_error(got[name], want_grad) <= FP32_TOLERANCE * scale, name

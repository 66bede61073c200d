"""Learned gates (``gates: learned``: alpha and beta as parameters of each layer) and the identity-start ``linear``
method: exactness at their start on every kind of model, the gates' range under training, saving and loading with
and without ea_hf, the CPU kernel against torch operations, and the gates' gradients against finite differences."""

import json
import textwrap

import pytest
import torch
import transformers
from testing import (
    cached_and_uncached_generation,
    first_output,
    left_padded_inputs,
    max_abs_diff,
    run_without_ea_hf,
    spy_on,
    tiny_inputs,
    tiny_model,
)

import ea_hf
from ea_hf.modeling import kernels
from ea_hf.modeling.evolution import AttentionMapEvolution
from ea_hf.modeling.gates import GatedEvolveConvolution, evolve_with_autograd
from ea_hf.modeling.step import EvolutionStep, StepMaps
from ea_hf.ops.cpu import binding as cpu_binding
from ea_hf.ops.cpu import evolution as cpu_evolution

#: One family per kind: encoder, vision encoder, audio encoder, seq2seq, decoder-only.
KINDS = {
    "bert": transformers.AutoModel,
    "vit": transformers.AutoModel,
    "wav2vec2": transformers.AutoModel,
    "t5": transformers.AutoModelForSeq2SeqLM,
    "llama": transformers.AutoModelForCausalLM,
}
#: Settings that start as the checkpoint: learned gates (from 0), the linear method at its identity start with a
#: non-zero beta (alpha 0, its default), and both.
EXACT_STARTS = {
    "learned": {"gates": "learned"},
    "linear": {"method": "linear", "beta": 0.7},
    "linear-learned": {"method": "linear", "gates": "learned", "beta": 0.5},
}


def evolution_modules(model) -> list[AttentionMapEvolution]:
    return [m for m in model.modules() if isinstance(m, AttentionMapEvolution)]


def real_positions(model_type: str, inputs: dict, output: torch.Tensor) -> torch.Tensor:
    """The output at real tokens: a padded query's row is zero in the convolution's input, so the linear branch
    moves the outputs of padding positions (which nothing reads); real ones see every kept entry unchanged."""
    if model_type in ("bert", "llama"):
        return output[inputs["attention_mask"].bool()]
    if model_type == "wav2vec2":  # the clips without padding (frames of a padded clip are not samples)
        return output[inputs["attention_mask"].all(-1)]
    return output  # ViT has no padding; T5's output is the decoder's, whose inputs are unpadded


def set_gates(model, values: list[tuple[float, float]]) -> None:
    with torch.no_grad():
        for module, (alpha, beta) in zip(evolution_modules(model), values, strict=False):
            module.alpha_gate.fill_(alpha)
            module.beta_gate.fill_(beta)


@pytest.mark.parametrize("start", EXACT_STARTS)
@pytest.mark.parametrize("model_type", KINDS)
def test_the_exact_starts_compute_the_checkpoint(model_type, start):
    head = KINDS[model_type]
    inputs = tiny_inputs(model_type)
    with torch.no_grad():
        expected = real_positions(model_type, inputs, first_output(tiny_model(model_type, head)(**inputs)))
    model = ea_hf.patch(tiny_model(model_type, head), **EXACT_STARTS[start])
    modules = evolution_modules(model)
    assert modules and all(m.beta == EXACT_STARTS[start].get("beta", 0.0) for m in modules)
    with torch.no_grad():  # the inference path
        inferred = real_positions(model_type, inputs, first_output(model(**inputs)))
    trained = real_positions(model_type, inputs, first_output(model(**inputs)))  # the autograd path
    assert max_abs_diff(inferred, expected) < 1e-5
    assert max_abs_diff(trained, expected) < 1e-5
    # The start is exact, not inert: the same settings with the gates (or the kernel) moved change the model.
    with torch.no_grad():
        for module in modules:
            if module.learned_gates:
                module.alpha_gate.fill_(0.5)
                module.beta_gate.fill_(0.5)
            else:
                module.weight.add_(0.3 * torch.randn_like(module.weight))
        moved = real_positions(model_type, inputs, first_output(model(**inputs)))
    assert max_abs_diff(moved, expected) > 1e-4  # ten times the tolerance of exactness


def test_gates_stay_in_range_under_training_and_come_back():
    model = ea_hf.patch(tiny_model("bert"), gates="learned").train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    inputs = tiny_inputs("bert")
    modules = evolution_modules(model)
    gates = [p for m in modules for p in (m.alpha_gate, m.beta_gate)]
    optimizer = torch.optim.SGD(gates, lr=1e3)
    for sign in (1.0, -1.0):
        for _ in range(3):
            optimizer.zero_grad()
            (sign * first_output(model(**inputs)).pow(2).mean()).backward()
            optimizer.step()
        raw = torch.stack([g.detach() for g in gates])
        assert (raw < 0).any() or (raw > 1).any()  # the large steps pushed gates out of [0, 1]...
        values = [v for m in modules for v in (m.alpha, m.beta)]
        assert all(0.0 <= v <= 1.0 for v in values)  # ...and the layers use them clamped
        assert ea_hf.summary(model).modules[0].beta == modules[0].beta
    # Out of range, a gate still gets its gradient (the clamp passes it through), so it can come back.
    optimizer.zero_grad()
    first_output(model(**inputs)).pow(2).mean().backward()
    outside = [g for g in gates[1:] if not 0.0 <= float(g.detach()) <= 1.0]
    assert outside and all(g.grad is not None and g.grad.abs() > 0 for g in outside)


def test_summary_and_repr_show_the_gates():
    model = ea_hf.patch(tiny_model("bert"), gates="learned")
    set_gates(model, [(0.25, 0.5), (0.75, 1.5)])
    rows = ea_hf.summary(model).modules
    assert [(row.alpha, row.beta) for row in rows[:2]] == [(0.25, 0.5), (0.75, 1.0)]  # clamped
    assert rows[0].parameters == 4 * 4 * 3 * 3 + 4 + 2
    assert "gates='learned'" in repr(evolution_modules(model)[0])
    with pytest.raises(AttributeError, match="learned gate"):
        evolution_modules(model)[0].alpha = 0.1


REMOTE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.modules["ea_hf"] = None  # ea_hf is not importable in this interpreter
    import torch, transformers
    path, input_path = sys.argv[1], sys.argv[2]
    model = transformers.AutoModel.from_pretrained(path, trust_remote_code=True).eval()
    with torch.no_grad():
        output = model(**torch.load(input_path))[0]
    gates = [[float(m.alpha_gate), float(m.beta_gate)] for n, m in model.named_modules() if hasattr(m, "alpha_gate")]
    print(json.dumps({"output": output.tolist(), "gates": gates}))
    """
)


@pytest.mark.parametrize("method", ["conv", "linear"])
def test_learned_gates_save_and_load_with_and_without_ea_hf(tmp_path, method):
    model = ea_hf.patch(tiny_model("bert"), gates="learned", method=method)
    gates = [(0.25 + 0.125 * i, 0.75 - 0.25 * i) for i in range(len(evolution_modules(model)))]
    set_gates(model, gates)
    inputs = tiny_inputs("bert")
    with torch.no_grad():
        expected = first_output(model(**inputs))
    model.save_pretrained(tmp_path / "model")
    stored = json.loads((tmp_path / "model" / "config.json").read_text())["evolving_attention"]
    assert stored["encoder"]["gates"] == "learned" and stored["encoder"]["method"] == method
    loaded = transformers.AutoModel.from_pretrained(tmp_path / "model").eval()
    assert [(m.alpha, m.beta) for m in evolution_modules(loaded)] == [pytest.approx(g) for g in gates]
    with torch.no_grad():
        assert max_abs_diff(first_output(loaded(**inputs)), expected) == 0.0
    torch.save(inputs, tmp_path / "inputs.pt")
    result = run_without_ea_hf(REMOTE_SCRIPT, str(tmp_path / "model"), str(tmp_path / "inputs.pt"), folder=tmp_path)
    assert result["gates"] == [pytest.approx(list(g)) for g in gates]
    assert (torch.tensor(result["output"]) - expected).abs().max() <= 1e-5


@pytest.mark.skipif(
    cpu_binding.cpu_kernel() is None, reason="no C++ compiler on this machine: no CPU kernel to compare"
)
@pytest.mark.parametrize("gates", [[(0.0, 0.0), (0.0, 0.0)], [(0.3, 0.4), (0.6, 0.8)]], ids=["start", "interior"])
@pytest.mark.parametrize("model_type", ["bert", "llama"])
def test_learned_gates_on_the_cpu_kernel_equal_the_torch_path(monkeypatch, model_type, gates):
    inputs = tiny_inputs(model_type)

    def outputs_and_gradients():
        model = ea_hf.patch(tiny_model(model_type, KINDS[model_type]), gates="learned")
        set_gates(model, gates)
        output = first_output(model(**inputs))
        mask = inputs["attention_mask"].bool()
        output[mask].pow(2).mean().backward()
        named = {n: p.grad for n, p in model.named_parameters() if "evolving_attention" in n}
        named["query"] = next(p.grad for n, p in model.named_parameters() if "q_proj" in n or "query" in n)
        return output[mask].detach(), named

    with monkeypatch.context() as patched:
        calls = spy_on(patched, cpu_evolution, ("evolve", "backward"))
        on_kernel, kernel_gradients = outputs_and_gradients()
    assert "evolve" in calls and "backward" in calls  # the kernel ran the step, forward and backward
    monkeypatch.setattr(kernels, "FUSED_KERNELS", [])
    on_torch, torch_gradients = outputs_and_gradients()
    assert max_abs_diff(on_kernel, on_torch) < 1e-5
    assert set(kernel_gradients) == set(torch_gradients)
    for name, gradient in torch_gradients.items():
        assert gradient is not None, name
        scale = 1.0 + gradient.abs().max().item()
        assert max_abs_diff(kernel_gradients[name], gradient) < 1e-4 * scale, name
    assert any(name.endswith("beta_gate") and g.abs() > 0 for name, g in torch_gradients.items())


@pytest.mark.parametrize("gates", [[(0.0, 0.0), (0.0, 0.0)], [(0.3, 0.4), (0.6, 0.8)]], ids=["start", "interior"])
@pytest.mark.parametrize("model_type", ["bert", "llama"])
def test_learned_gates_train_in_the_fused_core_as_the_gated_step_does(monkeypatch, model_type, gates):
    """In training, learned gates take the attention core (which keeps A_logit and the ReLU gate, not S and P),
    at the exact start (beta = 0) too, and give the outputs and every gradient, the gates' included, of the gated
    step (:class:`GatedEvolveConvolution`, the path they took through unfused attention)."""
    from ea_hf.modeling import attention_core

    model = ea_hf.patch(tiny_model(model_type, KINDS[model_type]), gates="learned")
    set_gates(model, gates)
    inputs = tiny_inputs(model_type)
    mask = inputs["attention_mask"].bool()

    def outputs_and_gradients():
        model.zero_grad()
        output = first_output(model(**inputs))
        output[mask].pow(2).mean().backward()
        return output[mask].detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    with monkeypatch.context() as patched:
        cores = spy_on(patched, attention_core.EvolvingAttentionCore, ("apply",))
        in_core, core_gradients = outputs_and_gradients()
    assert len(cores) == len(evolution_modules(model))
    monkeypatch.setattr(AttentionMapEvolution, "fuses_attention", lambda self, history: False)
    gated, gated_gradients = outputs_and_gradients()
    assert max_abs_diff(in_core, gated) < 1e-5
    assert core_gradients.keys() == gated_gradients.keys()
    for name, gradient in gated_gradients.items():
        assert max_abs_diff(core_gradients[name], gradient) < 1e-5 * (1.0 + gradient.abs().max().item()), name
    assert any(name.endswith("beta_gate") and g.abs() > 0 for name, g in gated_gradients.items())
    assert any(name.endswith("alpha_gate") and g.abs() > 0 for name, g in gated_gradients.items())


def step_function(keep: torch.Tensor | None, causal: bool):
    """A_logit of :class:`GatedEvolveConvolution` as a function of its tensors, the step's numbers taken from the
    gates at each call (as the layer does), so that finite differences move both."""

    def evolve(scores, previous, weight, bias, alpha, beta):
        step = EvolutionStep(float(alpha.detach()), float(beta.detach()), context_rows=1, causal=causal)
        return GatedEvolveConvolution.apply(step, scores, previous, keep, weight, bias, alpha, beta)

    return evolve


def step_tensors(causal: bool, alpha: float, beta: float, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    rows = 2 if causal else 3
    tensors = [draw(2, 3, 6, 7), draw(2, 3, 6, 7), draw(3, 3, rows, 3), draw(3)]
    tensors += [torch.tensor(alpha, dtype=torch.float64), torch.tensor(beta, dtype=torch.float64)]
    return [t.requires_grad_() for t in tensors]


def causal_keep() -> torch.Tensor:
    keep = torch.ones(6, 7, dtype=torch.float64).tril(1)
    keep[:, -1] = 0.0  # a padded key
    return keep.expand(2, 1, 6, 7)


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "causal"])
def test_gate_gradients_match_finite_differences_at_interior_values(causal):
    keep = causal_keep() if causal else None
    assert torch.autograd.gradcheck(step_function(keep, causal), step_tensors(causal, 0.3, 0.6), atol=1e-6)


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "causal"])
def test_gate_gradients_match_finite_differences_at_the_start(causal):
    """At the start (both gates 0) the step is differentiated from the side the clamp allows: one-sided
    differences (for beta < 0 the beta-scaled kernel is not beta * ReLU(Conv), and the clamp never gives it)."""
    keep = causal_keep() if causal else None
    evolve = step_function(keep, causal)
    tensors = step_tensors(causal, 0.0, 0.0)
    direction = torch.randn(2, 3, 6, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    (evolve(*tensors) * direction).sum().backward()
    step = 1e-7
    for index in (4, 5):
        moved = [t.detach().clone() for t in tensors]
        moved[index] += step
        with torch.no_grad():
            numeric = ((evolve(*moved) - evolve(*[t.detach() for t in tensors])) * direction).sum() / step
        assert tensors[index].grad.item() == pytest.approx(numeric.item(), rel=1e-5, abs=1e-6)
        assert abs(numeric.item()) > 1e-3  # a gradient that moves the gate off its start
    # The convolution's own gradient is beta times its unscaled one: zero at beta = 0.
    assert tensors[2].grad.abs().max() == 0.0


def test_the_gated_step_equals_the_plain_formulation_with_autograd():
    for causal in (False, True):
        keep = causal_keep().float() if causal else None
        tensors = [t.detach().float().requires_grad_() for t in step_tensors(causal, 0.35, 0.45)]
        plain = [t.detach().clone().requires_grad_() for t in tensors]
        step = EvolutionStep(0.35, 0.45, context_rows=1, causal=causal)
        direction = torch.randn(2, 3, 6, 7)
        (step_function(keep, causal)(*tensors) * direction).sum().backward()
        scores, previous, weight, bias, alpha, beta = plain
        expected = evolve_with_autograd(alpha, beta, StepMaps(scores, previous, keep), weight, bias, step, linear=False)
        (expected * direction).sum().backward()
        for got, want in zip(tensors, plain, strict=True):
            assert max_abs_diff(got.grad, want.grad) < 1e-4 * (1.0 + want.grad.abs().max().item())


def test_the_linear_method_at_its_start_is_the_identity_on_kept_entries_at_the_borders():
    """The dirac kernel's centre tap reads only its own entry: at the map's borders (zero padding) and beside masked
    entries (zeroed in the input) A_logit = A_in exactly; masked entries themselves differ, and the softmax masks
    them."""
    module = AttentionMapEvolution(3, alpha=0.0, beta=0.6, kernel_size=5, init="dirac", role="decoder", method="linear")
    scores = torch.randn(2, 3, 7, 7)
    conv_mask = torch.ones(7, 7, dtype=torch.bool).tril().expand(2, 1, 7, 7)
    logits = module(scores.clone(), conv_mask, {})
    assert torch.equal(logits[conv_mask.expand_as(logits)], scores[conv_mask.expand_as(scores)])
    masked = ~conv_mask.expand_as(logits)
    assert (logits[masked] - scores[masked]).abs().max() > 0.1  # lerp(A_in, 0, beta) there


def test_gates_learning_rate_reaches_the_optimizer():
    from ea_hf.training.trainer import EvolvingAttentionTrainer

    model = ea_hf.patch(tiny_model("bert"), gates="learned")
    args = transformers.TrainingArguments(output_dir="unused", learning_rate=1e-5, report_to=[], use_cpu=True)
    trainer = EvolvingAttentionTrainer(model=model, args=args, ea_learning_rate=1e-3, gates_learning_rate=0.1)
    optimizer = trainer.create_optimizer()
    by_parameter = {id(p): group["lr"] for group in optimizer.param_groups for p in group["params"]}
    modules = evolution_modules(model)
    assert by_parameter[id(modules[0].alpha_gate)] == 0.1
    assert by_parameter[id(modules[0].weight)] == 1e-3
    assert by_parameter[id(model.embeddings.word_embeddings.weight)] == 1e-5


def test_model_cards_show_learned_gates():
    from ea_hf.hub.cards import model_card

    model = ea_hf.patch(tiny_model("bert"), gates="learned")
    set_gates(model, [(0.25, 0.5)] * len(evolution_modules(model)))
    text = model_card(model, "user/ea-gates").text
    assert " gates |" in text and "| learned |" in text
    assert "| encoder.layer.0.attention.self.evolving_attention | 0.25 | 0.5 |" in text
    fixed = model_card(ea_hf.patch(tiny_model("bert")), "user/ea").text
    assert "learned gates" not in fixed and "| gates |" not in fixed


def test_learned_gates_train_and_save_with_lora(tmp_path):
    peft = pytest.importorskip("peft", reason="PEFT adapters are the optional peft extra")
    from ea_hf.integrations.peft import load_adapter, lora_config

    head = transformers.AutoModelForSequenceClassification
    model = ea_hf.patch(tiny_model("bert", head), gates="learned")
    peft_model = peft.get_peft_model(model, lora_config(model, r=2))
    named = dict(peft_model.named_parameters())
    gates = {n: p for n, p in named.items() if n.endswith(("alpha_gate", "beta_gate")) and "modules_to_save" in n}
    # An alpha and a beta gate per trained copy; the model holds the copies and the frozen originals.
    assert len(gates) == len(evolution_modules(model)) == 2 * model.config.num_hidden_layers
    assert all(p.requires_grad for p in gates.values())
    inputs = tiny_inputs("bert")
    optimizer = torch.optim.SGD([p for p in peft_model.parameters() if p.requires_grad], lr=0.5)
    for _ in range(2):
        optimizer.zero_grad()
        peft_model(**inputs).logits.pow(2).sum().backward()
        optimizer.step()
    assert any(float(p.detach()) != 0.0 for p in gates.values())  # the gates moved off their start
    peft_model.eval()
    with torch.no_grad():
        expected = peft_model(**inputs).logits
    peft_model.save_pretrained(tmp_path / "adapter")
    loaded = load_adapter(ea_hf.patch(tiny_model("bert", head), gates="learned"), tmp_path / "adapter").eval()
    with torch.no_grad():
        assert max_abs_diff(loaded(**inputs).logits, expected) <= 1e-6


@pytest.mark.parametrize(
    "settings", [{"method": "linear", "beta": 0.6}, {"gates": "learned"}], ids=["linear", "learned"]
)
def test_cached_generation_equals_uncached_with_moved_gates_and_kernels(settings):
    """The linear method's decoding steps convolve the kept rows of earlier steps as torch operations; learned gates
    decode with their values as numbers. Kernels and gates moved off their start, so that the evolution counts."""
    model = ea_hf.patch(tiny_model("llama", transformers.AutoModelForCausalLM), **settings)
    torch.manual_seed(5)
    with torch.no_grad():
        for module in evolution_modules(model):
            module.weight.add_(0.5 * torch.randn_like(module.weight))
            if module.learned_gates:
                module.alpha_gate.fill_(0.4)
                module.beta_gate.fill_(0.7)
    inputs = left_padded_inputs()
    with torch.no_grad():
        plain = tiny_model("llama", transformers.AutoModelForCausalLM)(**inputs).logits
        assert max_abs_diff(model(**inputs).logits, plain) > 1e-3  # the evolution changes the model
    cached_and_uncached_generation(model, inputs)


def test_recipes_and_settings_take_gates_and_the_linear_method():
    from ea_hf.training.recipe import recipe_from_dict

    base = {"name": "d", "model": {"name_or_path": "m"}, "data": {"task": "sst2"}}
    recipe = recipe_from_dict(
        base, ["ea.gates=learned", "ea.method=linear", "ea.init=dirac", "ea.gates_learning_rate=0.01"]
    )
    assert recipe.evolution() == ea_hf.EvolvingAttentionSettings(  # beta: the identity start keeps it exact
        alpha=0.0, beta=0.2, method="linear", init="dirac", gates="learned"
    )
    assert recipe.ea.gates_learning_rate == 0.01
    with pytest.raises(ValueError, match="ea.ramp_ratio: ramps fixed alpha and beta"):
        recipe_from_dict(base, ["ea.gates=learned", "ea.ramp_ratio=0.1"])
    with pytest.raises(ValueError, match="method 'echo' has no alpha and beta to learn"):
        ea_hf.EvolvingAttentionSettings(method="echo", alpha=0.0, beta=0.0, gates="learned")
    with pytest.raises(ValueError, match="gates must be one of fixed, learned, got 'lerned'"):
        ea_hf.EvolvingAttentionSettings(gates="lerned")
    # Learned gates start where the settings say (0 unless given); the linear method at the identity, alpha 0.
    assert ea_hf.EvolvingAttentionSettings.for_method("conv", gates="learned", beta=0.3).beta == 0.3
    linear = ea_hf.EvolvingAttentionSettings.for_method("linear")
    assert (linear.alpha, linear.beta, linear.init) == (0.0, 0.2, "dirac")
    assert "gates" not in ea_hf.EvolvingAttentionSettings().to_dict()  # fixed settings are stored as before


def test_residual_attention_learns_its_alpha_from_an_exact_start():
    model = ea_hf.patch(tiny_model("bert"), method="residual", gates="learned")
    modules = evolution_modules(model)
    assert all(m.beta_gate is None and m.beta == 0.0 for m in modules)
    inputs = tiny_inputs("bert")
    with torch.no_grad():
        expected = first_output(tiny_model("bert")(**inputs))
    output = first_output(model(**inputs))
    assert max_abs_diff(output, expected) < 1e-5
    output.pow(2).mean().backward()
    assert modules[0].alpha_gate.grad is None  # the chain's first layer has no previous logits to mix in
    assert all(m.alpha_gate.grad.abs() > 0 for m in modules[1:])


def test_the_linear_method_with_learned_gates_starts_where_its_convolution_learns():
    """Its default start keeps beta at the method's 0.2, exact with the identity kernel: the kernels get a gradient
    at once, and beta one as soon as they move. Started at beta = 0 neither gets one (the loss reads real tokens, as
    training's does), and a warning says so."""
    inputs = tiny_inputs("bert")
    with torch.no_grad():
        expected = real_positions("bert", inputs, first_output(tiny_model("bert", initializer_range=0.2)(**inputs)))

    def gradients(model):
        model.zero_grad()
        output = real_positions("bert", inputs, first_output(model(**inputs)))
        output.pow(2).sum().backward()
        return output, evolution_modules(model)

    def largest(gradient):
        return 0.0 if gradient is None else gradient.abs().max().item()

    model = ea_hf.patch(tiny_model("bert", initializer_range=0.2), method="linear", gates="learned")
    output, modules = gradients(model)
    assert [(m.alpha, m.beta) for m in modules] == [(0.0, pytest.approx(0.2))] * len(modules)
    assert max_abs_diff(output, expected) < 1e-5
    assert all(largest(m.weight.grad) > 0 and largest(m.beta_gate.grad) == 0 for m in modules)
    with torch.no_grad():
        for m in modules:
            m.weight.sub_(m.weight.grad / largest(m.weight.grad))
    _, modules = gradients(model)
    assert all(largest(m.beta_gate.grad) > 0 for m in modules)

    with pytest.warns(UserWarning, match="never move beta or the kernel"):
        stuck = ea_hf.patch(tiny_model("bert", initializer_range=0.2), method="linear", gates="learned", beta=0.0)
    _, modules = gradients(stuck)
    assert [(largest(m.weight.grad), largest(m.beta_gate.grad)) for m in modules] == [(0.0, 0.0)] * len(modules)


def test_a_models_gate_gradients_match_finite_differences():
    """Through a whole model (float64, interior gate values): the attention path with autograd hands every layer's
    gates their exact gradients. (The causal step is checked on its own above.)"""
    model = ea_hf.patch(tiny_model("bert", initializer_range=0.2), gates="learned").double()
    set_gates(model, [(0.3 + 0.1 * i, 0.6 - 0.1 * i) for i in range(len(evolution_modules(model)))])
    inputs = tiny_inputs("bert")
    mask = inputs["attention_mask"].bool()
    # A fixed direction: the squares of a LayerNorm's outputs would sum to nearly a constant.
    direction = torch.randn(int(mask.sum()), model.config.hidden_size, dtype=torch.float64)

    def loss():
        return (first_output(model(**inputs))[mask] * direction).sum()

    loss().backward()
    step = 1e-6
    for module in evolution_modules(model):
        for gate in (module.alpha_gate, module.beta_gate):
            with torch.no_grad():
                gate += step
                above = loss()
                gate -= 2 * step
                below = loss()
                gate += step
            numeric = ((above - below) / (2 * step)).item()
            assert gate.grad.item() == pytest.approx(numeric, rel=1e-5, abs=1e-9)
    assert abs(evolution_modules(model)[-1].alpha_gate.grad.item()) > 1e-4
